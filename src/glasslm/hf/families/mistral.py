"""Mistral (`MistralForCausalLM`, model_type "mistral"): the Llama shape without biases, where each
query attends to its last `sliding_window` keys. A glasslm config is a Mistral if it is Llama-shaped
with a sliding window, no biases and no rope scaling (without a window it is a Llama).

Example:
    >>> from glasslm.core.config import ModelConfig
    >>> config = ModelConfig(d_model=32, n_heads=4, positional="rope", norm="rmsnorm", mlp="swiglu",
    ...                      activation="silu", bias=False, sliding_window=8)
    >>> FAMILY.fit_problems(config), config_to_hf(config)["sliding_window"]
    ([], 8)
"""

from __future__ import annotations

from typing import Any

from glasslm.core.config import ModelConfig
from glasslm.hf.families.common import bias_flags, uniform_sliding_window
from glasslm.hf.families.family import HFFamily
from glasslm.hf.families.rotary import (
    ROTARY_BUFFERS, rotary_config_from_hf, rotary_config_to_hf, rotary_shape_problems, rotary_weight_table,
)


def config_from_hf(hf: dict[str, Any], context_length: int | None) -> ModelConfig:
    window = uniform_sliding_window(hf.get("layer_types"), hf.get("sliding_window"), "Mistral")
    flags = {"qkv": False, "out": False, "mlp": False}
    return rotary_config_from_hf(hf, context_length, "mistral", flags, window)


def config_to_hf(config: ModelConfig, zero_biases: bool = False) -> dict[str, Any]:
    return {**rotary_config_to_hf(config), "sliding_window": config.sliding_window}


def fit_problems(config: ModelConfig) -> list[str]:
    problems = rotary_shape_problems(config)
    if config.sliding_window is None:
        problems.append("no sliding window")
    if any(bias_flags(config).values()):
        problems.append("a sliding window together with biases")
    if config.rope_scaling != "none":
        problems.append("a sliding window together with rope scaling")
    return problems


FAMILY = HFFamily(
    name="mistral", architecture="MistralForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    fit_problems=fit_problems, weight_table=rotary_weight_table, ignored_tensors=ROTARY_BUFFERS,
)
