"""Qwen2 (`Qwen2ForCausalLM`, model_type "qwen2"): the Llama shape with biases on the q/k/v
projections only (none on o_proj or the MLP); `head_dim` may differ from hidden_size / heads. A
glasslm config is a Qwen2 if it is Llama-shaped with exactly those biases and no sliding window.

Example:
    >>> from glasslm.core.config import ModelConfig
    >>> config = ModelConfig(d_model=32, n_heads=4, positional="rope", norm="rmsnorm", mlp="swiglu",
    ...                      activation="silu", bias=False, attn_qkv_bias=True)
    >>> FAMILY.fit_problems(config)
    []
"""

from __future__ import annotations

from typing import Any

from glasslm.core.config import ModelConfig
from glasslm.hf.families.common import bias_flags, uniform_sliding_window
from glasslm.hf.families.family import HFFamily
from glasslm.hf.families.rotary import (
    ROTARY_BUFFERS, rotary_config_from_hf, rotary_config_to_hf, rotary_gguf_form, rotary_shape_problems,
    rotary_weight_table,
)

QWEN2_BIASES = {"qkv": True, "out": False, "mlp": False}  # always, whatever config.json says


def _layer_types(hf: dict[str, Any]) -> list[str]:
    """Per-layer attention kinds: transformers 5's `layer_types`, else from the older switches."""
    n_layers = hf.get("num_hidden_layers", 32)
    return hf.get("layer_types") or [
        "sliding_attention" if hf.get("use_sliding_window") and i >= hf.get("max_window_layers", n_layers)
        else "full_attention" for i in range(n_layers)]


def config_from_hf(hf: dict[str, Any], context_length: int | None) -> ModelConfig:
    window = uniform_sliding_window(_layer_types(hf), hf.get("sliding_window"), "Qwen2")
    return rotary_config_from_hf(hf, context_length, "qwen2", QWEN2_BIASES, window)


def config_to_hf(config: ModelConfig, zero_biases: bool = False) -> dict[str, Any]:
    return {**rotary_config_to_hf(config), "use_sliding_window": False, "sliding_window": None}


def fit_problems(config: ModelConfig) -> list[str]:
    problems, flags = rotary_shape_problems(config), bias_flags(config)
    if {site: flags[site] for site in QWEN2_BIASES} != QWEN2_BIASES:
        problems.append(f"biases on {[site for site, on in flags.items() if on]} (Qwen2: on q/k/v only)")
    if config.sliding_window is not None:
        problems.append("a sliding window together with biases")
    return problems


FAMILY = HFFamily(
    name="qwen2", architecture="Qwen2ForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    fit_problems=fit_problems, weight_table=rotary_weight_table, ignored_tensors=ROTARY_BUFFERS,
    gguf=rotary_gguf_form("qwen2"),
)
