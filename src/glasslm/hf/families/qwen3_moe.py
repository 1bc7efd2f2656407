"""Qwen3-MoE (`Qwen3MoeForCausalLM`, model_type "qwen3_moe"; Qwen3-30B-A3B): Qwen3's attention (q/k
norms, explicit head_dim) with mixture-of-experts MLPs of `moe_intermediate_size` on every
`decoder_sparse_step`-th layer (dense ones of `intermediate_size` between), the chosen experts'
weights renormalised if `norm_topk_prob`. A glasslm config is a Qwen3-MoE if it is a Qwen3 with
experts and no shared expert.

Example:
    >>> from glasslm.core.config import ModelConfig
    >>> config = ModelConfig(d_model=32, n_heads=4, positional="rope", norm="rmsnorm", mlp="swiglu",
    ...                      activation="silu", bias=False, qk_norm=True, n_experts=4, d_expert=16)
    >>> FAMILY.fit_problems(config), config_to_hf(config)["moe_intermediate_size"]
    ([], 16)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from glasslm.core.config import ModelConfig
from glasslm.hf.families import qwen3
from glasslm.hf.families.experts import experts_from_gguf, experts_to_gguf, gguf_expert_table, HF_NAMES, expert_problems, experts_from_hf, experts_to_hf, with_experts, without_experts_problem
from glasslm.hf.families.family import HFFamily
from glasslm.hf.families.rotary import ROTARY_BUFFERS, rotary_gguf_form, rotary_weight_table
from glasslm.hf.plan import WeightTable


def config_from_hf(hf: dict[str, Any], context_length: int | None) -> ModelConfig:
    dense = qwen3.config_from_hf(hf, context_length)
    return dense.replace(d_expert=hf.get("moe_intermediate_size", 768),
                         router_renormalize=bool(hf.get("norm_topk_prob", False)),
                         **experts_from_hf(hf, "Qwen3-MoE", "num_experts"))


def config_to_hf(config: ModelConfig, zero_biases: bool = False) -> dict[str, Any]:
    return {**qwen3.config_to_hf(config), **experts_to_hf(config)}


def fit_problems(config: ModelConfig) -> list[str]:
    return without_experts_problem(qwen3.fit_problems(config)) + expert_problems(config)


def weight_table(config: ModelConfig, hf_names: set[str] | None = None) -> WeightTable:
    return WeightTable(with_experts(dict(rotary_weight_table(config).entries), config, HF_NAMES["mlp"], hf_names))


# llama.cpp's qwen3moe: experts on every layer, the chosen weights always renormalised.
GGUF = dataclasses.replace(
    rotary_gguf_form("qwen3moe", lambda values, names: {**experts_from_gguf(values), "norm_topk_prob": True},
                     lambda hf: experts_to_gguf(hf, "qwen3moe", renormalized=True)),
    experts=True, weight_table=gguf_expert_table(weight_table, HF_NAMES["mlp"], "qwen3moe"))

FAMILY = HFFamily(
    name="qwen3_moe", architecture="Qwen3MoeForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    fit_problems=fit_problems, weight_table=weight_table, ignored_tensors=ROTARY_BUFFERS, gguf=GGUF,
)
