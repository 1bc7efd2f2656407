"""Mixtral (`MixtralForCausalLM`, model_type "mixtral"): Mistral's layout with every MLP a mixture
of `num_local_experts` SwiGLU experts, each token routed to `num_experts_per_tok` of them with the
chosen softmax weights renormalised (`core/moe.py`). Its checkpoints name the MoE module
`block_sparse_moe` and an expert's gate, down and up projections w1, w2, w3. A glasslm config is a
Mixtral if it is Llama-shaped without biases or q/k norms, with experts on every layer, renormalised,
and no shared expert.

Example:
    >>> from glasslm.core.config import ModelConfig
    >>> config = ModelConfig(d_model=32, n_heads=4, positional="rope", norm="rmsnorm", mlp="swiglu",
    ...                      activation="silu", bias=False, n_experts=4)
    >>> FAMILY.fit_problems(config), config_to_hf(config)["num_local_experts"]
    ([], 4)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from glasslm.core.config import ModelConfig
from glasslm.hf.families.common import bias_flags, uniform_sliding_window
from glasslm.hf.errors import UnsupportedModelError
from glasslm.hf.families import llama
from glasslm.hf.families.experts import experts_from_gguf, experts_to_gguf, gguf_expert_table, HF_NAMES, expert_problems, experts_from_hf, with_experts, without_experts_problem
from glasslm.hf.families.family import HFFamily
from glasslm.hf.families.rotary import (
    ROTARY_BUFFERS, rotary_config_from_hf, rotary_config_to_hf, rotary_gguf_form, rotary_shape_problems,
    rotary_weight_table,
)
from glasslm.hf.plan import WeightTable


def config_from_hf(hf: dict[str, Any], context_length: int | None) -> ModelConfig:
    window = uniform_sliding_window(hf.get("layer_types"), hf.get("sliding_window"), "Mixtral")
    flags = {"qkv": False, "out": False, "mlp": False}
    experts = experts_from_hf({**hf, "decoder_sparse_step": 1}, "Mixtral", "num_local_experts")
    return rotary_config_from_hf(hf, context_length, "mixtral", flags, window, router_renormalize=True, **experts)


def config_to_hf(config: ModelConfig, zero_biases: bool = False) -> dict[str, Any]:
    c = config
    return {**rotary_config_to_hf(c), "intermediate_size": c.d_expert or c.d_mlp, "sliding_window": c.sliding_window,
            "num_local_experts": c.n_experts, "num_experts_per_tok": c.experts_per_token,
            "router_aux_loss_coef": c.moe_aux_loss_coef, "router_jitter_noise": 0.0}


def fit_problems(config: ModelConfig) -> list[str]:
    problems = without_experts_problem(rotary_shape_problems(config)) + expert_problems(config, every_layer=True)
    if any(bias_flags(config).values()):
        problems.append("biases (Mixtral has none)")
    if config.n_experts and not config.router_renormalize:
        problems.append("unnormalised expert weights (Mixtral renormalises the chosen experts' weights)")
    return problems


def weight_table(config: ModelConfig, hf_names: set[str] | None = None) -> WeightTable:
    return WeightTable(with_experts(dict(rotary_weight_table(config).entries), config, HF_NAMES["mixtral"], hf_names))


def _gguf_values(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("sliding_window"):
        raise UnsupportedModelError("llama.cpp's llama architecture has no sliding window; this Mixtral has one")
    return experts_to_gguf(hf, "llama", renormalized=True)


# llama.cpp's "llama" with {arch}.expert_count: Llama's q/k row order, experts as 3-D tensors.
GGUF = dataclasses.replace(
    rotary_gguf_form("llama", lambda values, names: experts_from_gguf(values), _gguf_values, fixes=llama.GGUF.fixes),
    experts=True, weight_table=gguf_expert_table(weight_table, HF_NAMES["mixtral"], "llama"))

FAMILY = HFFamily(
    name="mixtral", architecture="MixtralForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    fit_problems=fit_problems, weight_table=weight_table, ignored_tensors=ROTARY_BUFFERS, gguf=GGUF,
)
