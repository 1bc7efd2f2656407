"""Gemma 2 (`Gemma2ForCausalLM`, model_type "gemma2": 2B, 9B, 27B): the Llama shape with a GeGLU MLP
(tanh-GELU gate), RMSNorms that scale by (1 + w), a norm before *and* after attention and the MLP,
scores scaled by query_pre_attn_scalar^-1/2 and soft-capped (cap * tanh(s / cap), `attn_softcap`), the
logits soft-capped too (`logit_softcap`), embeddings multiplied by sqrt(d_model), and a sliding window
on every other layer (the even ones; the odd ones are `global_layers`), one RoPE for all. Gemma 3 is
the same sandwich with q/k norms and no caps (gemma3.py). A glasslm config is a Gemma 2 if it has that
shape without q/k norms.

Example:
    >>> from glasslm.core.config import ModelConfig
    >>> config = config_from_hf({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
    ...                          "head_dim": 16, "num_hidden_layers": 4, "sliding_window": 8}, None)
    >>> config.global_layers, config.attn_softcap, config.logit_softcap, FAMILY.fit_problems(config)
    ((1, 3), 50.0, 30.0, [])
"""

from __future__ import annotations

from typing import Any

from glasslm.core.config import ModelConfig
from glasslm.hf.errors import UnsupportedModelError
from glasslm.hf.families.common import bias_flags, block_shape_problems
from glasslm.hf.families.family import HFFamily
from glasslm.hf.families.rotary import (
    ROTARY_BUFFERS, rotary_config_from_hf, rotary_config_to_hf, rotary_gguf_form, rotary_weight_table,
)
from glasslm.hf.gguf.form import TensorFix

# transformers' Gemma2Config defaults, which llama.cpp also falls back to where a file says none.
_ATTN_CAP, _FINAL_CAP, _SCALAR = 50.0, 30.0, 256


def _layer_types(hf: dict[str, Any]) -> list[str]:
    """Per-layer attention kinds: `layer_types`, else Gemma 2's own: even layers sliding, odd ones global."""
    n_layers = hf.get("num_hidden_layers", 26)
    return hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]


def _cap(hf: dict[str, Any], key: str, default: float) -> float | None:
    value = hf.get(key, default)
    return None if value is None else float(value)


def config_from_hf(hf: dict[str, Any], context_length: int | None) -> ModelConfig:
    if hf.get("use_bidirectional_attention"):
        raise UnsupportedModelError("Gemma 2 with use_bidirectional_attention is not supported (not causal)")
    if hf.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        raise UnsupportedModelError(f"Gemma 2 hidden_activation {hf['hidden_activation']!r} is not supported")
    layer_types = _layer_types(hf)
    window = hf.get("sliding_window") if "sliding_attention" in layer_types else None
    attention_bias = bool(hf.get("attention_bias", False))
    flags = {"qkv": attention_bias, "out": attention_bias, "mlp": False}
    hf = {**hf, "tie_word_embeddings": hf.get("tie_word_embeddings", True)}
    return rotary_config_from_hf(
        hf, context_length, "gemma2", flags, window, activation="gelu_tanh", post_norms=True, norm_unit_offset=True,
        scale_embeddings=True, attn_scale=float(hf.get("query_pre_attn_scalar", _SCALAR)) ** -0.5,
        global_layers=tuple(i for i, t in enumerate(layer_types) if t == "full_attention") if window else (),
        attn_softcap=_cap(hf, "attn_logit_softcapping", _ATTN_CAP),
        logit_softcap=_cap(hf, "final_logit_softcapping", _FINAL_CAP))


def config_to_hf(config: ModelConfig, zero_biases: bool = False) -> dict[str, Any]:
    c = config
    hf = rotary_config_to_hf(c)
    del hf["hidden_act"]
    scalar = c.attn_score_scale ** -2
    return {**hf, "hidden_activation": "gelu_pytorch_tanh", "attention_bias": bias_flags(c)["qkv"],
            "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-9 * scalar else scalar,
            "sliding_window": c.sliding_window,
            "layer_types": ["sliding_attention" if c.layer_window(i) else "full_attention" for i in range(c.n_layers)],
            "attn_logit_softcapping": c.attn_softcap, "final_logit_softcapping": c.logit_softcap}


def fit_problems(config: ModelConfig) -> list[str]:
    c, flags = config, bias_flags(config)
    problems = [p for p in block_shape_problems(c) if p != "scaled embeddings" and not p.startswith("attention scores")]
    wanted = dict(positional="rope", norm="rmsnorm", mlp="swiglu", activation="gelu_tanh", qk_norm=False,
                  post_norms=True, norm_unit_offset=True, scale_embeddings=True, parallel_residual=False,
                  rope_local_theta=None)
    problems += [f"{name}={getattr(c, name)!r} (Gemma 2: {value!r})" for name, value in wanted.items()
                 if getattr(c, name) != value]
    if flags["qkv"] != flags["out"] or flags["mlp"]:
        problems.append(f"biases on {[site for site, on in flags.items() if on]} (Gemma 2: on q, k, v and o or none)")
    return problems


# llama.cpp's Gemma 2: a window on the even layers, scores by 1/sqrt(head_dim) (1/sqrt(d_model / heads) for
# the 46-layer 27B), both caps (50 and 30 where the file says none), each norm's gain stored as 1 + w.
_LLAMA_CPP_27B_LAYERS = 46


def _gemma2_from_gguf(values: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    head_dim = values.get("attention.key_length", values["embedding_length"] // values["attention.head_count"])
    scalar = (values["embedding_length"] // values["attention.head_count"]
              if values["block_count"] == _LLAMA_CPP_27B_LAYERS else head_dim)
    hf = {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar,
          "attn_logit_softcapping": values.get("attn_logit_softcapping", _ATTN_CAP),
          "final_logit_softcapping": values.get("final_logit_softcapping", _FINAL_CAP),
          "sliding_window": values.get("attention.sliding_window")}
    if not hf["sliding_window"]:  # (what llama.cpp then does has changed between its versions)
        raise UnsupportedModelError("this Gemma 2 file states no gemma2.attention.sliding_window")
    return hf


def _gemma2_to_gguf(hf: dict[str, Any]) -> dict[str, Any]:
    n_layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    head_dim = hf["hidden_size"] // heads if n_layers == _LLAMA_CPP_27B_LAYERS else hf["head_dim"]
    if hf["query_pre_attn_scalar"] != head_dim:
        raise UnsupportedModelError(f"llama.cpp scales this Gemma 2's attention scores by 1/sqrt({head_dim}); this "
                                    f"model's query_pre_attn_scalar is {hf['query_pre_attn_scalar']}")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf[key] is None:
            raise UnsupportedModelError(f"llama.cpp's Gemma 2 always soft-caps ({key}); this model does not")
    if hf["layer_types"] != ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]:
        raise UnsupportedModelError("llama.cpp's Gemma 2 slides a window on its even layers and on no others; "
                                    "this model's layers differ")
    return {"attn_logit_softcapping": hf["attn_logit_softcapping"],
            "final_logit_softcapping": hf["final_logit_softcapping"], "attention.sliding_window": hf["sliding_window"]}


_NORM_GAINS = TensorFix(r".*norm\.weight", lambda t, hf: t - 1, lambda t, hf: t + 1)
GGUF = rotary_gguf_form("gemma2", _gemma2_from_gguf, _gemma2_to_gguf, fixes=(_NORM_GAINS,))

FAMILY = HFFamily(
    name="gemma2", architecture="Gemma2ForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    fit_problems=fit_problems, weight_table=rotary_weight_table, ignored_tensors=ROTARY_BUFFERS, gguf=GGUF,
)
