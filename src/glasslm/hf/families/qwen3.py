"""Qwen3 (`Qwen3ForCausalLM`, model_type "qwen3"): Qwen2's layout without the q/k/v biases (an
`attention_bias` switch covers q, k, v and o alike) and with an RMSNorm over each head's queries and
keys before the rotary (`qk_norm`); `head_dim` is explicit (128 at every size). A glasslm config is
a Qwen3 if it is Llama-shaped with q/k norms and no sliding window.

Example:
    >>> from glasslm.presets import get_preset
    >>> config = get_preset("qwen3-0.6b")
    >>> FAMILY.fit_problems(config), config.qk_norm, config.d_head
    ([], True, 128)
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


def config_from_hf(hf: dict[str, Any], context_length: int | None) -> ModelConfig:
    layer_types = hf.get("layer_types") if hf.get("use_sliding_window") else None
    window = uniform_sliding_window(layer_types, hf.get("sliding_window") if hf.get("use_sliding_window") else None,
                                    "Qwen3")
    attention_bias = bool(hf.get("attention_bias", False))
    flags = {"qkv": attention_bias, "out": attention_bias, "mlp": False}
    return rotary_config_from_hf(hf, context_length, "qwen3", flags, window, qk_norm=True)


def config_to_hf(config: ModelConfig, zero_biases: bool = False) -> dict[str, Any]:
    return {**rotary_config_to_hf(config), "attention_bias": bias_flags(config)["qkv"],
            "use_sliding_window": False, "sliding_window": None}


def fit_problems(config: ModelConfig) -> list[str]:
    problems, flags = rotary_shape_problems(config, qk_norm=True), bias_flags(config)
    if flags["qkv"] != flags["out"] or flags["mlp"]:
        problems.append(f"biases on {[site for site, on in flags.items() if on]} (Qwen3: on q, k, v and o or none)")
    if config.sliding_window is not None:
        problems.append("a sliding window")
    return problems


FAMILY = HFFamily(
    name="qwen3", architecture="Qwen3ForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    fit_problems=fit_problems, weight_table=rotary_weight_table, ignored_tensors=ROTARY_BUFFERS,
    gguf=rotary_gguf_form("qwen3"),
)
