"""The Llama shape that Llama, Mistral and Qwen2 share (and Qwen3, Gemma build on): rotary
positions, RMSNorm, a SwiGLU MLP, separate q/k/v projections, and their weight table.

Rotary layout: our RotaryPositions rotates ADJACENT feature pairs (x[2i], x[2i+1]) of each head, as
in the RoFormer paper and Meta's original Llama code. HF's Llama rotates x[i] with x[i + d_head/2]
("rotate_half"), because Meta's weights were permuted when they were converted to HF. Both use the
same frequency for pair i, so the models agree exactly once the rows of each head's q and k
projections are reordered: our row 2i is HF row i and our row 2i+1 is HF row i + d_head/2.
(q·k is unchanged by reordering features the same way in q and k; v and o need nothing.)

Example:
    >>> w = torch.arange(4.0)[:, None]          # one head of d_head 4: HF rows [0, 1 | 2, 3]
    >>> hf_rows_to_adjacent_pairs(w, n_heads=1)[:, 0].tolist()
    [0.0, 2.0, 1.0, 3.0]
    >>> torch.equal(adjacent_pairs_to_hf_rows(hf_rows_to_adjacent_pairs(w, 1), 1), w)
    True
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from glasslm.core.config import ModelConfig
from glasslm.hf.errors import UnsupportedModelError
from glasslm.hf.families.common import bias_fields, bias_flags, block_shape_problems, rope_from_hf, rope_to_hf
from glasslm.hf.plan import SAME, Plan, WeightTable


def hf_rows_to_adjacent_pairs(
    weight: Float[Tensor, "heads_x_d_head d_in"], n_heads: int
) -> Float[Tensor, "heads_x_d_head d_in"]:
    """Reorder q/k projection rows from HF's half-split rotary layout to our adjacent-pair layout."""
    d_in = weight.shape[-1]
    d_head = weight.shape[0] // n_heads
    # (heads, [first half | second half], d_head/2, d_in) -> interleave the two halves.
    return weight.reshape(n_heads, 2, d_head // 2, d_in).transpose(1, 2).reshape(n_heads * d_head, d_in)


def adjacent_pairs_to_hf_rows(
    weight: Float[Tensor, "heads_x_d_head d_in"], n_heads: int
) -> Float[Tensor, "heads_x_d_head d_in"]:
    """The inverse of `hf_rows_to_adjacent_pairs` (used on export)."""
    d_in = weight.shape[-1]
    d_head = weight.shape[0] // n_heads
    return weight.reshape(n_heads, d_head // 2, 2, d_in).transpose(1, 2).reshape(n_heads * d_head, d_in)


def rotary_shape_problems(config: ModelConfig) -> list[str]:
    """Why a config is not Llama-shaped ([] if it is); biases and windows are each family's own."""
    c, problems = config, block_shape_problems(config)
    if c.positional != "rope":
        problems.append(f"positional={c.positional} (Llama-shaped families have rotary positions)")
    if c.norm != "rmsnorm":
        problems.append(f"norm={c.norm}")
    if c.mlp != "swiglu" or c.activation != "silu":
        problems.append(f"mlp={c.mlp} with activation={c.activation} (Llama needs swiglu with silu)")
    return problems


def rotary_config_from_hf(
    hf: dict[str, Any], context_length: int | None, family: str, flags: dict[str, bool], sliding_window: int | None,
) -> ModelConfig:
    """The ModelConfig of a Llama-shaped HF config whose family read its bias `flags` (q/k/v, o,
    MLP) and window."""
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"{family} hidden_act {act!r} is not supported (only silu)")
    try:
        biases = bias_fields({**flags, "norm": flags["out"]})  # (RMSNorm: the norm site has no bias)
    except UnsupportedModelError as err:
        raise UnsupportedModelError(f"{family} with attention_bias={flags['out']} and "
                                    f"mlp_bias={flags['mlp']} is not supported: {err}") from None
    d_model, n_heads = hf.get("hidden_size", 4096), hf.get("num_attention_heads", 32)
    return ModelConfig(
        vocab_size=hf.get("vocab_size", 32000),
        context_length=context_length or hf.get("max_position_embeddings", 2048),
        d_model=d_model, n_layers=hf.get("num_hidden_layers", 32), n_heads=n_heads,
        d_head=hf.get("head_dim") or d_model // n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads, d_mlp=hf.get("intermediate_size", 11008),
        positional="rope", norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6),
        activation="silu", mlp="swiglu", **biases,
        tie_embeddings=hf.get("tie_word_embeddings", False), dropout=0.0,
        sliding_window=sliding_window, **rope_from_hf(hf),
    )


def rotary_config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The config.json keys every Llama-shaped family writes (each adds its bias / window keys)."""
    c = config
    return {
        "vocab_size": c.vocab_size, "hidden_size": c.d_model, "intermediate_size": c.d_mlp,
        "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads, "head_dim": c.d_head, "hidden_act": "silu",
        "max_position_embeddings": c.context_length, "rms_norm_eps": c.norm_eps,
        **rope_to_hf(c), "tie_word_embeddings": c.tie_embeddings,
    }


def qkv_conversions(config: ModelConfig):
    """(HF q, k, v -> our fused [q | k | v], and back), rows permuted to our rotary layout."""
    sizes = [config.n_heads * config.d_head, config.n_kv_heads * config.d_head, config.n_kv_heads * config.d_head]

    def fused_qkv(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # Biases are permuted like the rows they belong to; a trailing axis makes them 2-D for that.
        squeeze = q.dim() == 1
        if squeeze:
            q, k, v = q[:, None], k[:, None], v[:, None]
        q = hf_rows_to_adjacent_pairs(q, config.n_heads)
        k = hf_rows_to_adjacent_pairs(k, config.n_kv_heads)
        fused = torch.cat([q, k, v], dim=0)  # our fused layout: [q | k | v]
        return fused[:, 0] if squeeze else fused

    def split_qkv(fused: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        squeeze = fused.dim() == 1
        q, k, v = (fused[:, None] if squeeze else fused).split(sizes, dim=0)
        q, k = adjacent_pairs_to_hf_rows(q, config.n_heads), adjacent_pairs_to_hf_rows(k, config.n_kv_heads)
        return tuple(t[:, 0] if squeeze else t for t in (q, k, v))

    return fused_qkv, split_qkv


def rotary_weight_table(config: ModelConfig, hf_names: set[str] | None = None) -> WeightTable:
    """The Llama table (every bias a config lacks is simply absent in HF too)."""
    qkv = qkv_conversions(config)
    flags = bias_flags(config)

    def kinds(site: str) -> tuple[str, ...]:
        return ("weight", "bias") if flags[site] else ("weight",)

    plan: Plan = {"embed.weight": (("model.embed_tokens.weight",), *SAME)}
    for i in range(config.n_layers):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        plan[ours + "ln1.weight"] = ((hf + "input_layernorm.weight",), *SAME)
        for kind in kinds("qkv"):
            plan[ours + f"attn.qkv.{kind}"] = (tuple(hf + f"self_attn.{x}_proj.{kind}" for x in "qkv"), *qkv)
        for kind in kinds("out"):
            plan[ours + f"attn.out.{kind}"] = ((hf + f"self_attn.o_proj.{kind}",), *SAME)
        plan[ours + "ln2.weight"] = ((hf + "post_attention_layernorm.weight",), *SAME)
        for proj in ("gate", "up", "down"):
            for kind in kinds("mlp"):
                plan[ours + f"mlp.{proj}.{kind}"] = ((hf + f"mlp.{proj}_proj.{kind}",), *SAME)
    plan["ln_final.weight"] = (("model.norm.weight",), *SAME)
    if not config.tie_embeddings:
        plan["unembed.weight"] = (("lm_head.weight",), *SAME)
    return WeightTable(plan)


ROTARY_BUFFERS = r".*rotary_emb\.inv_freq"  # old Llama files saved these; recomputed from the config
