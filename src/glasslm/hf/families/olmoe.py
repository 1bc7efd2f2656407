"""OLMoE (`OlmoeForCausalLM`, model_type "olmoe"; OLMoE-1B-7B): Llama's layout with an RMSNorm over the
whole query projection and one over the whole key projection (all heads' features at once, not each
head's: `qk_norm_whole`), and every MLP a mixture of `num_experts` SwiGLU experts of `intermediate_size`,
each token routed to `num_experts_per_tok` of them by softmax, the chosen weights not renormalised unless
`norm_topk_prob`. A glasslm config is an OLMoE if it is Llama-shaped with whole-projection q/k norms and
experts on every layer, without a shared expert.

Example:
    >>> from glasslm.core.config import ModelConfig
    >>> config = ModelConfig(d_model=32, n_heads=4, positional="rope", norm="rmsnorm", mlp="swiglu",
    ...                      activation="silu", bias=False, qk_norm=True, qk_norm_whole=True, n_experts=4,
    ...                      router_renormalize=False)
    >>> FAMILY.fit_problems(config), config_to_hf(config)["num_experts"]
    ([], 4)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from glasslm.core.config import ModelConfig
from glasslm.hf.errors import UnsupportedModelError
from glasslm.hf.families.common import bias_flags
from glasslm.hf.families.experts import (
    HF_NAMES, expert_problems, experts_from_gguf, experts_from_hf, experts_to_gguf, gguf_expert_table, with_experts,
    without_experts_problem,
)
from glasslm.hf.families.family import HFFamily
from glasslm.hf.families.rotary import (
    ROTARY_BUFFERS, rotary_config_from_hf, rotary_config_to_hf, rotary_gguf_form, rotary_shape_problems,
    rotary_weight_table,
)
from glasslm.hf.plan import WeightTable


def config_from_hf(hf: dict[str, Any], context_length: int | None) -> ModelConfig:
    if hf.get("clip_qkv") is not None:
        raise UnsupportedModelError(f"OLMoE with clip_qkv={hf['clip_qkv']} (clamped q/k/v) is not supported")
    d_model, n_heads = hf.get("hidden_size", 2048), hf.get("num_attention_heads", 16)
    if hf.get("head_dim") not in (None, d_model // n_heads):  # (transformers sizes the k norm by hidden / heads)
        raise UnsupportedModelError(f"OLMoE with head_dim={hf['head_dim']} other than hidden_size / "
                                    f"num_attention_heads ({d_model // n_heads}) is not supported")
    attention_bias = bool(hf.get("attention_bias", False))
    flags = {"qkv": attention_bias, "out": attention_bias, "mlp": False}
    experts = experts_from_hf({**hf, "decoder_sparse_step": 1}, "OLMoE", "num_experts")
    return rotary_config_from_hf(hf, context_length, "olmoe", flags, None, qk_norm=True, qk_norm_whole=True,
                                 router_renormalize=bool(hf.get("norm_topk_prob", False)), **experts)


def config_to_hf(config: ModelConfig, zero_biases: bool = False) -> dict[str, Any]:
    c = config
    hf = {**rotary_config_to_hf(c), "intermediate_size": c.d_expert or c.d_mlp, "num_experts": c.n_experts,
          "num_experts_per_tok": c.experts_per_token, "norm_topk_prob": c.router_renormalize,
          "router_aux_loss_coef": c.moe_aux_loss_coef, "attention_bias": bias_flags(c)["qkv"], "clip_qkv": None}
    hf.pop("head_dim")  # (OLMoE's config has none: hidden_size / num_attention_heads)
    return hf


def fit_problems(config: ModelConfig) -> list[str]:
    c = config
    problems = without_experts_problem(rotary_shape_problems(c, qk_norm=True, qk_norm_whole=True))
    problems += expert_problems(c, every_layer=True)
    flags = bias_flags(c)
    if flags["qkv"] != flags["out"] or flags["mlp"]:
        problems.append(f"biases on {[site for site, on in flags.items() if on]} (OLMoE: on q, k, v and o or none)")
    if c.sliding_window is not None:
        problems.append("a sliding window")
    if c.d_head * c.n_heads != c.d_model:
        problems.append(f"d_head={c.d_head} other than d_model / n_heads (OLMoE's config has no head_dim)")
    return problems


def weight_table(config: ModelConfig, hf_names: set[str] | None = None) -> WeightTable:
    return WeightTable(with_experts(dict(rotary_weight_table(config).entries), config, HF_NAMES["mlp"], hf_names))


def _gguf_values(hf: dict[str, Any]) -> dict[str, Any]:
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    if kv_heads != heads:  # (llama.cpp checks attn_k_norm's shape against embedding_length)
        raise UnsupportedModelError(f"llama.cpp's olmoe has a key norm as wide as the embedding, so no grouped-query "
                                    f"heads; this model has {kv_heads} key/value heads for {heads} query heads")
    values = experts_to_gguf(hf, "olmoe", renormalized=False)
    values.pop("expert_feed_forward_length", None)  # llama.cpp's olmoe sizes its experts by feed_forward_length
    return values


def _hf_values(values: dict[str, Any], names: set[str]) -> dict[str, Any]:
    hf = experts_from_gguf(values)
    hf.pop("moe_intermediate_size", None)
    return {**hf, "norm_topk_prob": False}


# llama.cpp's olmoe: HF's rotary row order (no permutation), the experts' softmax weights never renormalised.
GGUF = dataclasses.replace(rotary_gguf_form("olmoe", _hf_values, _gguf_values), experts=True,
                           weight_table=gguf_expert_table(weight_table, HF_NAMES["mlp"], "olmoe"))

FAMILY = HFFamily(
    name="olmoe", architecture="OlmoeForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    fit_problems=fit_problems, weight_table=weight_table, ignored_tensors=ROTARY_BUFFERS, gguf=GGUF,
)
