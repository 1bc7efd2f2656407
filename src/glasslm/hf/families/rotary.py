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

from collections.abc import Mapping
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from glasslm.core.config import ModelConfig
from glasslm.hf.errors import UnsupportedModelError
from glasslm.hf.families.common import bias_fields, bias_flags, block_shape_problems, rope_from_hf, rope_to_hf
from glasslm.hf.gguf.form import ROTARY_KEYS, GGUFForm, TensorFix
from glasslm.hf.plan import SAME, Plan, WeightTable


def hf_rows_to_adjacent_pairs(
    weight: Float[Tensor, "heads_x_d_head d_in"], n_heads: int, rotary_dims: int | None = None
) -> Float[Tensor, "heads_x_d_head d_in"]:
    """Reorder q/k projection rows from HF's half-split rotary layout to our adjacent-pair layout.

    Only each head's first `rotary_dims` rows rotate (default: all of them, GPT-NeoX: a quarter);
    the rest keep their place.
    """
    return _reorder_rotary_rows(weight, n_heads, rotary_dims, (2, -1))


def adjacent_pairs_to_hf_rows(
    weight: Float[Tensor, "heads_x_d_head d_in"], n_heads: int, rotary_dims: int | None = None
) -> Float[Tensor, "heads_x_d_head d_in"]:
    """The inverse of `hf_rows_to_adjacent_pairs` (used on export)."""
    return _reorder_rotary_rows(weight, n_heads, rotary_dims, (-1, 2))


def _reorder_rotary_rows(weight: Tensor, n_heads: int, rotary_dims: int | None, split: tuple[int, int]) -> Tensor:
    """Transpose each head's first rotary_dims rows viewed as `split` (2 x r/2: halves -> pairs)."""
    d_in = weight.shape[-1]
    d_head = weight.shape[0] // n_heads
    rotary_dims = rotary_dims or d_head
    heads = weight.reshape(n_heads, d_head, d_in)
    rotary = heads[:, :rotary_dims].reshape(n_heads, *split, d_in).transpose(1, 2).reshape(n_heads, rotary_dims, d_in)
    return torch.cat([rotary, heads[:, rotary_dims:]], dim=1).reshape(n_heads * d_head, d_in)


def rotary_shape_problems(config: ModelConfig, qk_norm: bool = False, qk_norm_whole: bool = False) -> list[str]:
    """Why a config is not Llama-shaped ([] if it is), with q/k norms if `qk_norm` (Qwen3), over the
    whole projection if `qk_norm_whole` (OLMoE); biases and windows are each family's own."""
    c, problems = config, block_shape_problems(config)
    if c.qk_norm != qk_norm:
        problems.append("q/k norms" if c.qk_norm else "no q/k norms")
    elif c.qk_norm and c.qk_norm_whole != qk_norm_whole:
        problems.append("q/k norms over the whole projection" if c.qk_norm_whole else "q/k norms per head")
    others = dict(parallel_residual=False, post_norms=False, norm_unit_offset=False, global_layers=(),
                  rope_local_theta=None, rotary_dims=c.d_head if c.rotary_dims else None)
    problems += [f"{name}={getattr(c, name)!r}" for name, value in others.items() if getattr(c, name) != value]
    if c.positional != "rope":
        problems.append(f"positional={c.positional} (Llama-shaped families have rotary positions)")
    if c.norm != "rmsnorm":
        problems.append(f"norm={c.norm}")
    if c.mlp != "swiglu" or c.activation != "silu":
        problems.append(f"mlp={c.mlp} with activation={c.activation} (Llama needs swiglu with silu)")
    return problems


def rotary_config_from_hf(
    hf: dict[str, Any], context_length: int | None, family: str, flags: dict[str, bool], sliding_window: int | None,
    partial_rotary: bool = False, **fields: Any,
) -> ModelConfig:
    """The ModelConfig of a Llama-shaped HF config whose family read its bias `flags` (q/k/v, o,
    MLP) and window; `partial_rotary`: the family rotates the first partial_rotary_factor of each
    head (Phi-3), others refuse it; `fields` are further ModelConfig fields the family read (Qwen3's qk_norm)."""
    act = "silu" if "activation" in fields else hf.get("hidden_act", "silu")  # (Gemma reads its own)
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"{family} hidden_act {act!r} is not supported (only silu)")
    try:
        biases = bias_fields({**flags, "norm": flags["out"]})  # (RMSNorm: the norm site has no bias)
    except UnsupportedModelError as err:
        raise UnsupportedModelError(f"{family} with attention_bias={flags['out']} and "
                                    f"mlp_bias={flags['mlp']} is not supported: {err}") from None
    d_model, n_heads = hf.get("hidden_size", 4096), hf.get("num_attention_heads", 32)
    d_head = hf.get("head_dim") or d_model // n_heads
    return ModelConfig(**{**dict(
        vocab_size=hf.get("vocab_size", 32000),
        context_length=context_length or hf.get("max_position_embeddings", 2048),
        d_model=d_model, n_layers=hf.get("num_hidden_layers", 32), n_heads=n_heads,
        d_head=d_head,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads, d_mlp=hf.get("intermediate_size", 11008),
        positional="rope", norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6),
        activation="silu", mlp="swiglu", **biases,
        tie_embeddings=hf.get("tie_word_embeddings", False), dropout=0.0,
        sliding_window=sliding_window), **rope_from_hf(hf, d_head if partial_rotary else None), **fields})


def rotary_config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The config.json keys every Llama-shaped family writes (each adds its bias / window keys)."""
    c = config
    return {
        "vocab_size": c.vocab_size, "hidden_size": c.d_model, "intermediate_size": c.d_mlp,
        "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads, "head_dim": c.d_head, "hidden_act": "silu",
        # Dynamic NTK scaling starts past max_position_embeddings: there it says the original context.
        "max_position_embeddings": c.rope_original_context if c.rope_scaling == "dynamic" else c.context_length,
        "rms_norm_eps": c.norm_eps,
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
        q = hf_rows_to_adjacent_pairs(q, config.n_heads, config.rotary_dims)
        k = hf_rows_to_adjacent_pairs(k, config.n_kv_heads, config.rotary_dims)
        fused = torch.cat([q, k, v], dim=0)  # our fused layout: [q | k | v]
        return fused[:, 0] if squeeze else fused

    def split_qkv(fused: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        squeeze = fused.dim() == 1
        q, k, v = (fused[:, None] if squeeze else fused).split(sizes, dim=0)
        q = adjacent_pairs_to_hf_rows(q, config.n_heads, config.rotary_dims)
        k = adjacent_pairs_to_hf_rows(k, config.n_kv_heads, config.rotary_dims)
        return tuple(t[:, 0] if squeeze else t for t in (q, k, v))

    return fused_qkv, split_qkv


def rotary_weight_table(config: ModelConfig, hf_names: set[str] | None = None) -> WeightTable:
    """The Llama table (every bias a config lacks is simply absent in HF too)."""
    qkv = qkv_conversions(config)
    flags = bias_flags(config)

    def kinds(site: str) -> tuple[str, ...]:
        return ("weight", "bias") if flags[site] else ("weight",)

    # Norm names: Gemma's sandwich has four per layer, and its "post_attention_layernorm" is the
    # norm on attention's output, where Llama's is the norm before the MLP.
    norms = {"ln1": "input_layernorm", "ln2": "post_attention_layernorm"}
    if config.post_norms:
        norms = {"ln1": "input_layernorm", "ln1_post": "post_attention_layernorm",
                 "ln2": "pre_feedforward_layernorm", "ln2_post": "post_feedforward_layernorm"}
    plan: Plan = {"embed.weight": (("model.embed_tokens.weight",), *SAME)}
    for i in range(config.n_layers):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        for our_norm, hf_norm in norms.items():
            plan[ours + our_norm + ".weight"] = ((hf + hf_norm + ".weight",), *SAME)
        for kind in kinds("qkv"):
            plan[ours + f"attn.qkv.{kind}"] = (tuple(hf + f"self_attn.{x}_proj.{kind}" for x in "qkv"), *qkv)
        for kind in kinds("out"):
            plan[ours + f"attn.out.{kind}"] = ((hf + f"self_attn.o_proj.{kind}",), *SAME)
        if config.qk_norm:  # gains per head feature, reordered like the q/k rows
            heads = {"q": config.n_heads, "k": config.n_kv_heads} if config.qk_norm_whole else {"q": 1, "k": 1}
            for x in "qk":
                plan[ours + f"attn.{x}_norm.weight"] = ((hf + f"self_attn.{x}_norm.weight",),
                                                        *qk_norm_conversion(config, heads[x]))
        for proj in ("gate", "up", "down"):
            for kind in kinds("mlp"):
                plan[ours + f"mlp.{proj}.{kind}"] = ((hf + f"mlp.{proj}_proj.{kind}",), *SAME)
    plan["ln_final.weight"] = (("model.norm.weight",), *SAME)
    if not config.tie_embeddings:
        plan["unembed.weight"] = (("lm_head.weight",), *SAME)
    return WeightTable(plan)


def qk_norm_conversion(config: ModelConfig, heads: int = 1):
    """The q/k norm gains act on a head's features in HF's rotary order; ours are in adjacent-pair
    order, so a gain vector is reordered like one head's projection rows (like `heads` heads' rows
    where the norm spans the whole projection: OLMoE)."""

    def to_ours(gain: Tensor) -> Tensor:
        return hf_rows_to_adjacent_pairs(gain[:, None], heads, config.rotary_dims)[:, 0]

    def to_hf(gain: Tensor) -> tuple[Tensor]:
        return (adjacent_pairs_to_hf_rows(gain[:, None], heads, config.rotary_dims)[:, 0],)

    return to_ours, to_hf


ROTARY_BUFFERS = r".*rotary_emb\.inv_freq"  # old Llama files saved these; recomputed from the config


def _head_dim(hf: Mapping[str, Any]) -> int:
    return int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])


def rotary_hf_extras(values: Mapping[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """What every Llama-shaped GGUF file says beyond `ROTARY_KEYS`: rotating fewer dims than a
    head has (`rope.dimension_count`, refused by families that cannot), biases from which tensors it
    holds (Llama's attention_bias / mlp_bias; the other families fix theirs)."""
    hf: dict[str, Any] = {"attention_bias": "blk.0.attn_q.bias" in tensor_names,
                          "mlp_bias": "blk.0.ffn_up.bias" in tensor_names}
    heads = values.get("attention.head_count")
    head_dim = values.get("attention.key_length") or (values.get("embedding_length", 0) // heads if heads else None)
    rotated = values.get("rope.dimension_count")
    if rotated is not None and head_dim and rotated != head_dim:
        hf["partial_rotary_factor"] = rotated / head_dim
        hf.setdefault("rope_scaling", {})["partial_rotary_factor"] = rotated / head_dim
    return hf


def rotary_gguf_extras(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The GGUF values llama.cpp needs that config.json says another way: rotated dims, k/v widths."""
    head_dim = _head_dim(hf)
    params = hf.get("rope_parameters") or {}
    params = params.get("full_attention", params)
    rotated = round(head_dim * float(params.get("partial_rotary_factor", 1.0)))
    values = {"rope.dimension_count": rotated, "attention.key_length": head_dim, "attention.value_length": head_dim}
    if "rope_theta" in params:  # (Gemma's config.json says it only per layer type)
        values["rope.freq_base"] = float(params["rope_theta"])
    return values


def rotary_gguf_form(arch: str, hf_extras=None, gguf_extras=None, fixes: tuple[TensorFix, ...] = ()) -> GGUFForm:
    """A Llama-shaped family's GGUF form: `ROTARY_KEYS`, the shared extras, and the family's own."""

    def read(values: Mapping[str, Any], tensor_names: set[str]) -> dict[str, Any]:
        return {**rotary_hf_extras(values, tensor_names), **(hf_extras(values, tensor_names) if hf_extras else {})}

    def write(hf: Mapping[str, Any]) -> dict[str, Any]:
        return {**rotary_gguf_extras(hf), **(gguf_extras(hf) if gguf_extras else {})}

    return GGUFForm(arch, ROTARY_KEYS, hf_extras=read, gguf_extras=write, fixes=fixes)
