"""Llama (`LlamaForCausalLM`, model_type "llama"; SmolLM and TinyLlama are Llamas): the Llama shape
with attention biases on q, k, v and o alike (`attention_bias`) and on the MLP (`mlp_bias`), and
Llama 3's rope scaling. A glasslm config is a Llama if it is Llama-shaped with no sliding window and
the same biases on q/k/v as on the attention output.

Example:
    >>> from glasslm.presets import get_preset
    >>> FAMILY.fit_problems(get_preset("llama-tiny"))
    []
"""

from __future__ import annotations

from typing import Any

from glasslm.core.config import ModelConfig
from glasslm.hf.families.common import bias_flags
from glasslm.hf.families.family import HFFamily
from glasslm.hf.families.rotary import (
    ROTARY_BUFFERS, adjacent_pairs_to_hf_rows, hf_rows_to_adjacent_pairs, rotary_config_from_hf, rotary_config_to_hf,
    rotary_gguf_form, rotary_shape_problems, rotary_weight_table,
)
from glasslm.hf.gguf.form import TensorFix


def config_from_hf(hf: dict[str, Any], context_length: int | None) -> ModelConfig:
    attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    flags = {"qkv": attention_bias, "out": attention_bias, "mlp": mlp_bias}
    return rotary_config_from_hf(hf, context_length, "llama", flags, sliding_window=None)


def config_to_hf(config: ModelConfig, zero_biases: bool = False) -> dict[str, Any]:
    flags = bias_flags(config)
    return {**rotary_config_to_hf(config), "attention_bias": flags["qkv"], "mlp_bias": flags["mlp"]}


def fit_problems(config: ModelConfig) -> list[str]:
    problems, flags = rotary_shape_problems(config), bias_flags(config)
    if flags["qkv"] != flags["out"]:
        problems.append(f"biases on {[site for site, on in flags.items() if on]} only "
                        "(Llama's attention_bias covers q, k, v and o alike)")
    if config.sliding_window is not None:
        problems.append("a sliding window")
    return problems


def _permuted_rows(role: str) -> TensorFix:
    """llama.cpp stores Llama's q and k rows in Meta's original rotary order (adjacent pairs, ours),
    not HF's half-split one: its converter permutes them (weights and biases) per head."""

    def heads(hf: Any) -> int:
        return hf["num_attention_heads"] if role == "q" else hf.get("num_key_value_heads") or hf["num_attention_heads"]

    def rows(reorder: Any) -> Any:
        return lambda t, hf: (reorder(t[:, None], heads(hf))[:, 0] if t.dim() == 1 else reorder(t, heads(hf)))

    return TensorFix(rf"model\.layers\.\d+\.self_attn\.{role}_proj\.(weight|bias)",
                     rows(adjacent_pairs_to_hf_rows), rows(hf_rows_to_adjacent_pairs))


GGUF = rotary_gguf_form("llama", fixes=(_permuted_rows("q"), _permuted_rows("k")))

FAMILY = HFFamily(
    name="llama", architecture="LlamaForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    fit_problems=fit_problems, weight_table=rotary_weight_table, ignored_tensors=ROTARY_BUFFERS, gguf=GGUF,
)
