"""Gemma 3 text models (`Gemma3ForCausalLM`, model_type "gemma3_text": 270M and 1B): the Llama shape
with a GeGLU MLP (tanh-GELU gate), RMSNorms that scale by (1 + w), a norm before *and* after
attention and the MLP, q/k RMSNorm per head, scores scaled by query_pre_attn_scalar^-1/2, embeddings
multiplied by sqrt(d_model), and sliding-window layers (their own RoPE base, unscaled) between
full-attention ones (every sixth) — each a ModelConfig field. A glasslm config is a Gemma 3 if it
has that sandwich shape.

Example:
    >>> from glasslm.presets import get_preset
    >>> config = get_preset("gemma3-270m")
    >>> FAMILY.fit_problems(config), config.global_layers
    ([], (5, 11, 17))
"""

from __future__ import annotations

from typing import Any

from glasslm.core.config import ModelConfig
from glasslm.hf.errors import UnsupportedModelError
from glasslm.hf.families.common import bias_flags, block_shape_problems, rope_parameters, rope_parameters_to_hf
from glasslm.hf.families.family import HFFamily
from glasslm.hf.families.rotary import (
    ROTARY_BUFFERS, rotary_config_from_hf, rotary_config_to_hf, rotary_gguf_form, rotary_weight_table,
)
from glasslm.hf.gguf.form import TensorFix


def _layer_types(hf: dict[str, Any]) -> list[str]:
    """Per-layer attention kinds: `layer_types`, else every `sliding_window_pattern`-th layer global."""
    n_layers, pattern = hf.get("num_hidden_layers", 26), hf.get("sliding_window_pattern", 6)
    return hf.get("layer_types") or ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                     for i in range(n_layers)]


def _local_theta(hf: dict[str, Any]) -> float:
    """The sliding-window layers' RoPE base; only plain RoPE there (Gemma 3 scales the global layers only)."""
    local = (hf.get("rope_parameters") or {}).get("sliding_attention")
    if local is None:
        return float(hf.get("rope_local_base_freq", 10000.0))
    if local.get("rope_type", "default") != "default" or set(local) - {"rope_type", "rope_theta"}:
        raise UnsupportedModelError(f"Gemma 3 with scaled RoPE on its sliding-window layers is not supported ({local})")
    return float(local["rope_theta"])


def config_from_hf(hf: dict[str, Any], context_length: int | None) -> ModelConfig:
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            raise UnsupportedModelError(f"Gemma 3 with {key}={hf[key]} is not supported")
    if hf.get("use_bidirectional_attention"):
        raise UnsupportedModelError("Gemma 3 with use_bidirectional_attention is not supported (not causal)")
    if hf.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        raise UnsupportedModelError(f"Gemma 3 hidden_activation {hf['hidden_activation']!r} is not supported")
    layer_types = _layer_types(hf)
    window = hf.get("sliding_window") if "sliding_attention" in layer_types else None
    attention_bias = bool(hf.get("attention_bias", False))
    flags = {"qkv": attention_bias, "out": attention_bias, "mlp": False}
    hf = {**hf, "rope_parameters": rope_parameters(hf), "tie_word_embeddings": hf.get("tie_word_embeddings", True)}
    return rotary_config_from_hf(
        hf, context_length, "gemma3_text", flags, window, activation="gelu_tanh", qk_norm=True, post_norms=True,
        norm_unit_offset=True, scale_embeddings=True, attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        global_layers=tuple(i for i, t in enumerate(layer_types) if t == "full_attention") if window else (),
        rope_local_theta=_local_theta(hf) if window else None)


def config_to_hf(config: ModelConfig, zero_biases: bool = False) -> dict[str, Any]:
    c = config
    hf = rotary_config_to_hf(c)
    del hf["hidden_act"], hf["rope_theta"]
    hf.pop("rope_scaling", None)
    layer_types = ["sliding_attention" if c.layer_window(i) else "full_attention" for i in range(c.n_layers)]
    local = {"rope_type": "default", "rope_theta": c.rope_local_theta or c.rope_theta}
    return {**hf, "hidden_activation": "gelu_pytorch_tanh", "attention_bias": bias_flags(c)["qkv"],
            "query_pre_attn_scalar": _whole(c.attn_score_scale ** -2), "sliding_window": c.sliding_window,
            "layer_types": layer_types, "final_logit_softcapping": None, "attn_logit_softcapping": None,
            "rope_parameters": {"sliding_attention": local, "full_attention": rope_parameters_to_hf(c)}}


def _whole(x: float) -> float | int:
    return round(x) if abs(x - round(x)) < 1e-9 * x else x


def fit_problems(config: ModelConfig) -> list[str]:
    c, flags = config, bias_flags(config)
    problems = [p for p in block_shape_problems(c) if p != "scaled embeddings" and not p.startswith("attention scores")]
    wanted = dict(positional="rope", norm="rmsnorm", mlp="swiglu", activation="gelu_tanh", qk_norm=True,
                  post_norms=True, norm_unit_offset=True, scale_embeddings=True, parallel_residual=False)
    problems += [f"{name}={getattr(c, name)!r} (Gemma 3: {value!r})" for name, value in wanted.items()
                 if getattr(c, name) != value]
    if flags["qkv"] != flags["out"] or flags["mlp"]:
        problems.append(f"biases on {[site for site, on in flags.items() if on]} (Gemma 3: on q, k, v and o or none)")
    if c.sliding_window is not None and c.rope_local_theta is None:
        problems.append("sliding-window layers without their own RoPE base (rope_local_theta)")
    return problems


# llama.cpp's Gemma 3: every 6th layer global (unless the file lists its layers), local layers' RoPE
# base 10000 unless `rope.freq_base_swa` says, scores scaled by 1/sqrt(head_dim) (1/sqrt(d_model /
# heads) for the 62-layer 27B), and each norm's gain stored as 1 + w.
_LLAMA_CPP_WINDOW_PATTERN = 6


def _gemma3_from_gguf(values: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    head_dim = values.get("attention.key_length", 256)
    hf: dict[str, Any] = {
        "sliding_window_pattern": values.get("attention.sliding_window_pattern", _LLAMA_CPP_WINDOW_PATTERN),
        "rope_local_base_freq": values.get("rope.freq_base_swa", 10000.0), "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": (values["embedding_length"] // values["attention.head_count"]
                                  if values.get("block_count") == 62 else head_dim),
        "sliding_window": values.get("attention.sliding_window"),
        "final_logit_softcapping": values.get("final_logit_softcapping")}
    if not values.get("attention.sliding_window"):
        hf["layer_types"] = ["full_attention"] * values.get("block_count", 0)
    return hf


def _gemma3_to_gguf(hf: dict[str, Any]) -> dict[str, Any]:
    head_dim = hf["head_dim"] if hf["num_hidden_layers"] != 62 else hf["hidden_size"] // hf["num_attention_heads"]
    if hf["query_pre_attn_scalar"] != head_dim:
        raise UnsupportedModelError(f"llama.cpp scales this Gemma 3's attention scores by 1/sqrt({head_dim}); this "
                                    f"model's query_pre_attn_scalar is {hf['query_pre_attn_scalar']}")
    types = hf.get("layer_types") or []
    if "sliding_attention" not in types:
        return {}
    if types != ["full_attention" if (i + 1) % _LLAMA_CPP_WINDOW_PATTERN == 0 else "sliding_attention"
                 for i in range(len(types))]:
        raise UnsupportedModelError("llama.cpp's Gemma 3 makes every 6th layer global; this model's layers differ")
    return {"attention.sliding_window": hf["sliding_window"],
            "rope.freq_base_swa": hf["rope_parameters"]["sliding_attention"]["rope_theta"]}


_NORM_GAINS = TensorFix(r".*norm\.weight", lambda t, hf: t - 1, lambda t, hf: t + 1)
GGUF = rotary_gguf_form("gemma3", _gemma3_from_gguf, _gemma3_to_gguf, fixes=(_NORM_GAINS,))

FAMILY = HFFamily(
    name="gemma3_text", architecture="Gemma3ForCausalLM", config_from_hf=config_from_hf,
    config_to_hf=config_to_hf, fit_problems=fit_problems, weight_table=rotary_weight_table,
    ignored_tensors=ROTARY_BUFFERS, gguf=GGUF,
)
