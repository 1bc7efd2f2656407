"""Pieces several families share, kept once: per-site bias flags, the block shape every HF family
here has, rotary (rope) config fields both ways, and sliding windows.

Example:
    >>> from glasslm.presets import get_preset
    >>> bias_flags(get_preset("llama-tiny"))
    {'qkv': False, 'out': False, 'mlp': False, 'norm': False}
    >>> rope_from_hf({"rope_theta": 500000.0})
    {'rope_theta': 500000.0}
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from glasslm.core.config import ModelConfig
from glasslm.hf.errors import UnsupportedModelError

# ModelConfig's per-site bias switches (None: follow `bias`). Sites whose field ModelConfig does not
# have (yet) always follow `bias`; `bias_flags` and `bias_fields` are the only readers and writers.
BIAS_FIELDS = {"qkv": "attn_qkv_bias", "out": "attn_out_bias", "mlp": "mlp_bias", "norm": "norm_bias"}


def bias_flags(config: ModelConfig) -> dict[str, bool]:
    """Which parts of each block carry biases: q/k/v projections, attention output, MLP, norms."""
    c = config
    flags = {site: getattr(c, field, None) for site, field in BIAS_FIELDS.items()}
    flags = {site: c.bias if on is None else bool(on) for site, on in flags.items()}
    if c.norm != "layernorm":
        flags["norm"] = False  # RMSNorm has no shift
    return flags


def bias_fields(flags: dict[str, bool]) -> dict[str, bool]:
    """The ModelConfig fields that give these per-site biases (the inverse of `bias_flags`)."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    base = flags["out"]
    fields = {"bias": base}
    for site, on in flags.items():
        if on != base:
            if BIAS_FIELDS[site] not in known:
                raise UnsupportedModelError(
                    f"biases on the {site} site differ from the attention output's, and this ModelConfig "
                    f"has no {BIAS_FIELDS[site]} field to say so")
            fields[BIAS_FIELDS[site]] = on
    return fields


def missing_biases_refusal(architecture: str, missing: list[str]) -> UnsupportedModelError:
    """The error for a model lacking biases its HF form always has, saying how to export it anyway."""
    return UnsupportedModelError(
        f"a {architecture}-shaped model without biases ({', '.join(missing)}) has no exact Hugging Face form: "
        f"{architecture} always has biases. Export with zero biases (`--zero-biases`, "
        "export_hf(zero_biases=True)): transformers then computes the same logits, and glasslm re-imports it "
        "bias-free")


# What a dense family says of a mixture-of-experts config (the MoE families take it out of the list).
EXPERTS_PROBLEM = "mixture-of-experts layers (n_experts > 0)"


def block_shape_problems(config: ModelConfig) -> list[str]:
    """What no HF family here has: post-norm, no final norm, scaled embeddings, a logit bias, ...; and
    experts, which only the MoE families take (`EXPERTS_PROBLEM`)."""
    c, problems = config, []
    if c.n_experts:
        problems.append(EXPERTS_PROBLEM)
    if c.norm_placement != "pre":
        problems.append("post-norm blocks")
    if not c.final_norm:
        problems.append("no final norm")
    if c.scale_embeddings:
        problems.append("scaled embeddings")
    if c.unembed_bias:
        problems.append("a bias on the logits (unembed_bias)")
    if c.norm_unbiased_std:
        problems.append("LayerNorm by the unbiased std (norm_unbiased_std)")
    if not math.isclose(c.attn_score_scale, c.d_head ** -0.5, rel_tol=1e-12):
        problems.append(f"attention scores scaled by {c.attn_score_scale:g}, not 1/sqrt(d_head)")
    return problems


# Fields that say how a model is built or trained, not what its weights compute.
_NOT_COMPUTED = ("init", "init_std", "init_residual_scaling", "xavier_embeddings", "impl", "moe_aux_loss_coef",
                 "moe_z_loss_coef")
# The mixture-of-experts fields (said nothing about a dense model).
_EXPERT_FIELDS = ("n_experts", "experts_per_token", "d_expert", "moe_every", "router_renormalize", "d_shared_expert")
# The rope-scaling fields each rope_scaling reads (the others say nothing about the model).
_ROPE_SCALING_FIELDS = {
    "none": (),
    "llama3": ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_context"),
    "linear": ("rope_factor",),
    "dynamic": ("rope_factor", "rope_original_context"),
    "yarn": ("rope_factor", "rope_original_context", "rope_beta_fast", "rope_beta_slow", "rope_attention_factor"),
}
_ALL_ROPE_SCALING_FIELDS = tuple(sorted({name for names in _ROPE_SCALING_FIELDS.values() for name in names}))


def computed_fields(config: ModelConfig) -> dict[str, Any]:
    """The config as what the model computes: training-only fields (dropouts, init, impl) left out,
    fields that say one thing two ways by their meaning (bias sites, the attention score scale), and
    rope settings only where they are used. Two configs with equal `computed_fields` load the same
    weights and give the same logits.
    """
    c = config
    out = {k: v for k, v in c.to_dict().items() if k not in _NOT_COMPUTED and "dropout" not in k}
    for name in ("bias", *BIAS_FIELDS.values(), "attn_scale_by", "attn_scale"):
        out.pop(name)
    out.update(bias_sites=bias_flags(c), attn_score_scale=c.attn_score_scale)
    used = _ROPE_SCALING_FIELDS[c.rope_scaling] if c.positional == "rope" else ()
    unused = [name for name in _ALL_ROPE_SCALING_FIELDS if name not in used]
    if c.positional != "rope":
        unused += ["rope_theta", "rope_scaling", "rotary_dims", "rope_local_theta"]
    else:
        out["rotary_dims"] = c.rotary_dims or c.d_head  # None means all of d_head
    if c.positional == "rope" and c.rope_scaling == "dynamic":
        out.pop("context_length")  # config.json says the original context there; the table length is the user's
    if c.rope_scaling == "yarn" and c.rope_attention_factor is None:
        from glasslm.core.positions import yarn_attention_factor  # the default, said explicitly
        out["rope_attention_factor"] = yarn_attention_factor(c.rope_factor)
    for name in unused:
        out.pop(name)
    return _experts_computed(c, out)


def _experts_computed(config: ModelConfig, out: dict[str, Any]) -> dict[str, Any]:
    """`computed_fields`' expert fields: none for a dense model; the expert width said explicitly; no
    dense width where every layer is a mixture of experts."""
    c = config
    if c.n_experts == 0:
        return {k: v for k, v in out.items() if k not in _EXPERT_FIELDS}
    out["d_expert"] = c.d_expert or c.d_mlp
    if c.moe_every == 1:
        out.pop("d_mlp")
    return out


_SCALING_KEYS = {  # the rope_parameters keys each rope_type may have, besides rope_type and rope_theta
    "default": set(),
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "linear": {"factor"},
    "dynamic": {"factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "truncate"},
}


def rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """The rope parameters of an HF config: transformers 5's `rope_parameters` or the older
    `rope_scaling` with `rope_theta` beside it."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise UnsupportedModelError(f"cannot read rope parameters {params!r}")
    if "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]  # per-layer-type parameters: the global layers'
    return {"rope_theta": hf.get("rope_theta", 10000.0), **params}


def rope_from_hf(hf: dict[str, Any], d_head: int | None = None) -> dict[str, Any]:
    """rope_theta and scaling (and rotary_dims, for families that pass their `d_head`) as ModelConfig fields."""
    params = rope_parameters(hf)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _SCALING_KEYS:
        raise UnsupportedModelError(f"rope scaling {rope_type!r} is not supported "
                                    f"(plain rotary positions and {', '.join(sorted(_SCALING_KEYS)[1:])} are)")
    extra = set(params) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"} - _SCALING_KEYS[rope_type]
    if extra:
        raise UnsupportedModelError(f"unsupported {rope_type} rope parameters {sorted(extra)} in {params}")
    out: dict[str, Any] = {"rope_theta": float(params["rope_theta"])}
    partial = float(params.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        if d_head is None:
            raise UnsupportedModelError(f"partial_rotary_factor={partial} is not supported for this family")
        out["rotary_dims"] = int(d_head * partial)
    if rope_type == "default":
        return out
    out.update(rope_scaling=rope_type, rope_factor=float(params["factor"]))
    if rope_type == "llama3":
        out.update(rope_low_freq_factor=float(params["low_freq_factor"]),
                   rope_high_freq_factor=float(params["high_freq_factor"]),
                   rope_original_context=int(params["original_max_position_embeddings"]))
    elif rope_type == "yarn":
        out.update(_yarn_from_hf(params, hf))
    elif rope_type == "dynamic":  # transformers scales past max_position_embeddings, whatever else is said
        out["rope_original_context"] = int(hf.get("max_position_embeddings", 2048))
    return out


def _yarn_from_hf(params: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    if params.get("truncate", True) is not True:
        raise UnsupportedModelError("yarn rope scaling with truncate=false is not supported")
    factor = params.get("attention_factor")
    return {"rope_original_context": int(params.get("original_max_position_embeddings")
                                         or hf.get("max_position_embeddings", 2048)),
            "rope_beta_fast": float(params.get("beta_fast") or 32.0),
            "rope_beta_slow": float(params.get("beta_slow") or 1.0),
            "rope_attention_factor": None if factor is None else float(factor)}


def rope_parameters_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The transformers-5 `rope_parameters` entry of a config (its global layers')."""
    c = config
    rope: dict[str, Any] = {"rope_type": "default" if c.rope_scaling == "none" else c.rope_scaling,
                            "rope_theta": c.rope_theta}
    if c.rotary_dims is not None and c.rotary_dims != c.d_head:
        rope["partial_rotary_factor"] = c.rotary_dims / c.d_head
    if c.rope_scaling != "none":
        rope["factor"] = c.rope_factor
    if c.rope_scaling == "llama3":
        rope.update(low_freq_factor=c.rope_low_freq_factor, high_freq_factor=c.rope_high_freq_factor,
                    original_max_position_embeddings=c.rope_original_context)
    elif c.rope_scaling == "yarn":
        rope.update(original_max_position_embeddings=c.rope_original_context, beta_fast=c.rope_beta_fast,
                    beta_slow=c.rope_beta_slow)
        if c.rope_attention_factor is not None:
            rope["attention_factor"] = c.rope_attention_factor
    return rope


def rope_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The config.json rope keys: transformers >= 5 reads rope_parameters, older versions rope_theta
    (and rope_scaling)."""
    rope = rope_parameters_to_hf(config)
    out = {"rope_parameters": rope, "rope_theta": config.rope_theta}
    if config.rope_scaling != "none":
        out["rope_scaling"] = rope
    return out


def uniform_sliding_window(layer_types: list[str] | None, window: int | None, family: str) -> int | None:
    """The window every layer uses (None: full attention everywhere); some layers only is refused.

    `layer_types` lists "full_attention" / "sliding_attention" per layer (None: every layer uses
    `window`, if any).
    """
    if not layer_types:
        return window
    if all(t == "full_attention" for t in layer_types):
        return None
    if all(t == "sliding_attention" for t in layer_types):
        return window
    raise UnsupportedModelError(
        f"{family} with sliding-window attention on some layers only is not supported ({sorted(set(layer_types))})")
