"""Qwen2-MoE (`Qwen2MoeForCausalLM`, model_type "qwen2_moe"; Qwen1.5-MoE-A2.7B): Qwen2's attention (biases
on q/k/v when `qkv_bias`, the default) with mixture-of-experts MLPs of `moe_intermediate_size` on every
`decoder_sparse_step`-th layer, plus a shared expert of `shared_expert_intermediate_size` every token
goes through, scaled by sigmoid(shared_expert_gate(x)). A glasslm config is a Qwen2-MoE if it is a
Llama shape with experts and a shared expert.

Example:
    >>> from glasslm.core.config import ModelConfig
    >>> config = ModelConfig(d_model=32, n_heads=4, positional="rope", norm="rmsnorm", mlp="swiglu",
    ...                      activation="silu", bias=False, attn_qkv_bias=True, n_experts=4, d_shared_expert=48)
    >>> FAMILY.fit_problems(config), config_to_hf(config)["shared_expert_intermediate_size"]
    ([], 48)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from glasslm.core.config import ModelConfig
from glasslm.hf.errors import UnsupportedModelError
from glasslm.hf.families.common import bias_flags, uniform_sliding_window
from glasslm.hf.families.experts import experts_from_gguf, experts_to_gguf, gguf_expert_table, HF_NAMES, expert_problems, experts_from_hf, experts_to_hf, with_experts, without_experts_problem
from glasslm.hf.families.family import HFFamily
from glasslm.hf.families.rotary import (
    ROTARY_BUFFERS, rotary_config_from_hf, rotary_config_to_hf, rotary_gguf_form, rotary_shape_problems,
    rotary_weight_table,
)
from glasslm.hf.plan import WeightTable


def config_from_hf(hf: dict[str, Any], context_length: int | None) -> ModelConfig:
    window = uniform_sliding_window(hf.get("layer_types"), hf.get("sliding_window") if hf.get("use_sliding_window")
                                    else None, "Qwen2-MoE")
    qkv = bool(hf.get("qkv_bias", True))
    flags = {"qkv": qkv, "out": False, "mlp": False}
    shared = hf.get("shared_expert_intermediate_size", 5632)
    if not shared:
        raise UnsupportedModelError(f"Qwen2-MoE with shared_expert_intermediate_size={shared!r} (no shared expert) "
                         "is not supported")
    return rotary_config_from_hf(
        hf, context_length, "qwen2_moe", flags, window, d_expert=hf.get("moe_intermediate_size", 1408),
        router_renormalize=bool(hf.get("norm_topk_prob", False)), d_shared_expert=shared,
        **experts_from_hf(hf, "Qwen2-MoE", "num_experts"))


def config_to_hf(config: ModelConfig, zero_biases: bool = False) -> dict[str, Any]:
    return {**rotary_config_to_hf(config), **experts_to_hf(config), "qkv_bias": bias_flags(config)["qkv"],
            "shared_expert_intermediate_size": config.d_shared_expert, "use_sliding_window": False,
            "sliding_window": None}


def fit_problems(config: ModelConfig) -> list[str]:
    problems = without_experts_problem(rotary_shape_problems(config)) + expert_problems(config, shared=True)
    flags = bias_flags(config)
    if flags["out"] or flags["mlp"]:
        problems.append(f"biases on {[site for site, on in flags.items() if on]} (Qwen2-MoE: on q/k/v only)")
    if config.sliding_window is not None:
        problems.append("a sliding window")
    return problems


def weight_table(config: ModelConfig, hf_names: set[str] | None = None) -> WeightTable:
    return WeightTable(with_experts(dict(rotary_weight_table(config).entries), config, HF_NAMES["mlp"], hf_names))


def _gguf_config(values: Any, names: set[str]) -> dict[str, Any]:
    return {**experts_from_gguf(values), "norm_topk_prob": False, "qkv_bias": "blk.0.attn_q.bias" in names}


# llama.cpp's qwen2moe: experts on every layer, the chosen weights not renormalised, the shared expert.
GGUF = dataclasses.replace(
    rotary_gguf_form("qwen2moe", _gguf_config, lambda hf: experts_to_gguf(hf, "qwen2moe", renormalized=False)),
    experts=True, weight_table=gguf_expert_table(weight_table, HF_NAMES["mlp"], "qwen2moe"))

FAMILY = HFFamily(
    name="qwen2_moe", architecture="Qwen2MoeForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    fit_problems=fit_problems, weight_table=weight_table, ignored_tensors=ROTARY_BUFFERS, gguf=GGUF,
)
