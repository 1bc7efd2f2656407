"""Phi-3 and Phi-4-mini (`Phi3ForCausalLM`, model_type "phi3"): the Llama shape with q, k and v in one
projection (`qkv_proj`, [q | k | v] rows), the MLP's gate and up in one (`gate_up_proj`, [gate | up]
rows), RoPE on the first `partial_rotary_factor` of each head (Phi-4-mini: 3/4; the rest pass
unrotated) and a sliding window on every layer where config.json sets one (Phi-3-mini-4k: 2047).
No biases. LongRoPE (Phi-3.5, Phi-4-mini's `rope_scaling`) is refused by name.

Phi-3 computes what a Llama (or, with its window, a Mistral) of the same numbers computes wherever
every feature of a head rotates, so a glasslm config is a Phi-3 only where a Llama cannot say it:
partial rotary without biases or q/k norms. A full-rotary Phi-3 is read as itself and written as a
Llama or Mistral, the same logits in transformers.

Example:
    >>> config = config_from_hf({"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
    ...                          "partial_rotary_factor": 0.75, "tie_word_embeddings": True}, None)
    >>> config.d_head, config.rotary_dims, FAMILY.fit_problems(config)
    (16, 12, [])
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from glasslm.core.config import ModelConfig
from glasslm.hf.errors import UnsupportedModelError
from glasslm.hf.families.common import bias_flags, rope_parameters
from glasslm.hf.families.family import HFFamily
from glasslm.hf.families.rotary import (
    ROTARY_BUFFERS, qkv_conversions, rotary_config_from_hf, rotary_config_to_hf, rotary_gguf_form,
    rotary_shape_problems, rotary_weight_table,
)
from glasslm.hf.plan import WeightTable


def config_from_hf(hf: dict[str, Any], context_length: int | None) -> ModelConfig:
    if "partial_rotary_factor" in hf:  # (older config.json files say it beside rope_scaling, not in it)
        hf = {**hf, "rope_parameters": {"partial_rotary_factor": hf["partial_rotary_factor"], **rope_parameters(hf)}}
    no_bias = {"qkv": False, "out": False, "mlp": False}
    return rotary_config_from_hf(hf, context_length, "phi3", no_bias, hf.get("sliding_window"), partial_rotary=True)


def config_to_hf(config: ModelConfig, zero_biases: bool = False) -> dict[str, Any]:
    return {**rotary_config_to_hf(config), "sliding_window": config.sliding_window}


def fit_problems(config: ModelConfig) -> list[str]:
    c = config
    problems = [p for p in rotary_shape_problems(c) if not p.startswith("rotary_dims=")]
    if not c.rotary_dims or c.rotary_dims == c.d_head:
        problems.append("every feature of a head rotates (a Llama or Mistral; Phi-3 is claimed for partial rotary)")
    if any(bias_flags(c).values()):
        problems.append(f"biases on {[site for site, on in bias_flags(c).items() if on]} (Phi-3 has none)")
    return problems


def weight_table(config: ModelConfig, hf_names: set[str] | None = None) -> WeightTable:
    """The Llama table with q|k|v read from one tensor and gate, up cut from one (each takes its rows)."""
    table = dict(rotary_weight_table(config, hf_names).entries)
    fused_qkv, split_qkv = qkv_conversions(config)
    sizes = [config.n_heads * config.d_head, config.n_kv_heads * config.d_head, config.n_kv_heads * config.d_head]
    d_mlp = config.d_mlp
    for i in range(config.n_layers):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        table[ours + "attn.qkv.weight"] = ((hf + "self_attn.qkv_proj.weight",),
                                           lambda t: fused_qkv(*t.split(sizes)),
                                           lambda t: (torch.cat(split_qkv(t)),))
        del table[ours + "mlp.gate.weight"], table[ours + "mlp.up.weight"]
        table[ours + "mlp.gate.weight"] = ((hf + "mlp.gate_up_proj.weight",), lambda t: _half(t, 0, d_mlp), _whole)
        table[ours + "mlp.up.weight"] = ((hf + "mlp.gate_up_proj.weight",), lambda t: _half(t, 1, d_mlp), _whole)
    return WeightTable(table)


def _half(gate_up: Tensor, which: int, d_mlp: int) -> Tensor:
    return gate_up[which * d_mlp:(which + 1) * d_mlp]


def _whole(part: Tensor) -> tuple[Tensor]:
    return (part,)  # (export stacks gate's rows then up's: plan.hf_tensors)


def _phi3_from_gguf(values: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    if {"rope_factors_long.weight", "rope_factors_short.weight"} & tensor_names:
        raise UnsupportedModelError("LongRoPE (rope_factors_long / rope_factors_short: Phi-3.5, Phi-4-mini) is not "
                                    "supported")
    return {"sliding_window": values.get("attention.sliding_window") or None}


def _phi3_to_gguf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("sliding_window"):
        raise UnsupportedModelError("llama.cpp runs Phi-3 without its sliding window (llama.cpp#13676): this "
                                    f"model's window of {hf['sliding_window']} would be lost")
    return {}


# llama.cpp's Phi-3 rotates as HF does (half-split, NEOX) and keeps the fused tensors: nothing to undo.
GGUF = rotary_gguf_form("phi3", _phi3_from_gguf, _phi3_to_gguf)

FAMILY = HFFamily(
    name="phi3", architecture="Phi3ForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    fit_problems=fit_problems, weight_table=weight_table, ignored_tensors=ROTARY_BUFFERS, gguf=GGUF,
)
