"""GPT-2 (`GPT2LMHeadModel`, model_type "gpt2"): learned positions, LayerNorm, a GELU MLP, one
fused c_attn projection, weights in HF's Conv1D layout, biases everywhere. A glasslm config is a
GPT-2 if it has that shape; a bias-free one (nanoGPT style) is exported with zero biases only when
asked, and config.json's "glasslm" entry then records which sites are bias-free.

Example:
    >>> from glasslm.presets import get_preset
    >>> config = get_preset("gpt2-small")
    >>> FAMILY.fit_problems(config), config_to_hf(config)["activation_function"]
    ([], 'gelu_new')
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from glasslm.core.config import ModelConfig
from glasslm.hf.errors import UnsupportedModelError
from glasslm.hf.families.common import (
    BIAS_FIELDS, bias_fields, bias_flags, block_shape_problems, missing_biases_refusal,
)
from glasslm.hf.families.family import HFFamily
from glasslm.hf.files import GLASSLM_KEY
from glasslm.hf.gguf.form import GGUFForm, TensorFix
from glasslm.hf.plan import SAME, Plan, WeightTable

# HF activation names -> ours. "gelu_new", "gelu_fast" and "gelu_pytorch_tanh" are all the tanh
# approximation 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))) written differently.
HF_ACTIVATIONS = {
    "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu", "relu": "relu", "silu": "silu", "swish": "silu",
}
ACTIVATION_NAMES = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}
_REFUSED_OPTIONS = (("scale_attn_by_inverse_layer_idx", False), ("scale_attn_weights", True),
                    ("add_cross_attention", False), ("reorder_and_upcast_attn", False))


def config_from_hf(hf: dict[str, Any], context_length: int | None) -> ModelConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in HF_ACTIVATIONS:
        raise UnsupportedModelError(f"GPT-2 activation_function {act!r} is not supported")
    for flag, wanted in _REFUSED_OPTIONS:
        if hf.get(flag, wanted) != wanted:
            raise UnsupportedModelError(f"GPT-2 option {flag}={hf[flag]!r} is not supported")
    n_positions = hf.get("n_positions", 1024)
    if context_length is not None and context_length != n_positions:
        raise UnsupportedModelError("GPT-2's learned position table fixes the context length to n_positions")
    d_model = hf.get("n_embd", 768)
    # A glasslm export of a bias-free model records which (zero) biases are not part of the model.
    sites = (hf.get(GLASSLM_KEY) or {}).get("bias_sites") or {}
    biases = bias_fields({site: bool(sites.get(site, True)) for site in BIAS_FIELDS})
    return ModelConfig(
        vocab_size=hf.get("vocab_size", 50257), context_length=n_positions, d_model=d_model,
        n_layers=hf.get("n_layer", 12), n_heads=hf.get("n_head", 12), d_mlp=hf.get("n_inner") or 4 * d_model,
        positional="learned", norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        activation=HF_ACTIVATIONS[act], mlp="mlp", **biases, tie_embeddings=hf.get("tie_word_embeddings", True),
        dropout=0.0,  # HF's dropout rates only matter for training; we import for inference
    )


def config_to_hf(config: ModelConfig, zero_biases: bool = False) -> dict[str, Any]:
    c, flags = config, bias_flags(config)
    missing = [site for site, on in flags.items() if not on]
    if missing and not zero_biases:
        raise missing_biases_refusal("GPT-2", missing)
    return {
        "vocab_size": c.vocab_size, "n_positions": c.context_length, "n_embd": c.d_model,
        "n_layer": c.n_layers, "n_head": c.n_heads, "n_inner": c.d_mlp,
        "activation_function": ACTIVATION_NAMES[c.activation], "layer_norm_epsilon": c.norm_eps,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
        "tie_word_embeddings": c.tie_embeddings, **({GLASSLM_KEY: {"bias_sites": flags}} if missing else {}),
    }


def fit_problems(config: ModelConfig) -> list[str]:
    c, problems = config, block_shape_problems(config)
    if c.positional != "learned":
        problems.append(f"positional={c.positional} (GPT-2 has learned positions)")
    if c.norm != "layernorm":
        problems.append(f"norm={c.norm}")
    if c.mlp != "mlp":
        problems.append(f"mlp={c.mlp}")
    if c.activation not in ACTIVATION_NAMES:
        problems.append(f"activation {c.activation!r} has no GPT-2 counterpart")
    if c.n_kv_heads != c.n_heads:
        problems.append("grouped-query attention")
    if c.d_head * c.n_heads != c.d_model:
        problems.append(f"d_head={c.d_head} with d_model/n_heads={c.d_model // c.n_heads}")
    if c.sliding_window is not None:
        problems.append("sliding-window attention")
    if c.rope_scaling != "none":
        problems.append("rope scaling without rotary positions")
    return problems


def _conv1d_to_linear(t: Tensor) -> Tensor:
    # HF's GPT-2 uses Conv1D, which stores weights (d_in, d_out); our Linear stores (d_out, d_in).
    return t.t().contiguous()


CONV1D = (_conv1d_to_linear, lambda t: (t.t(),))
_LINEARS = (("attn.c_attn", "attn.qkv", "qkv"), ("attn.c_proj", "attn.out", "out"),
            ("mlp.c_fc", "mlp.up", "mlp"), ("mlp.c_proj", "mlp.down", "mlp"))


def weight_table(config: ModelConfig, hf_names: set[str] | None = None) -> WeightTable:
    """The GPT-2 table. GPT2LMHeadModel files name tensors "transformer.h.0...", the bare GPT2Model
    (and the original hub gpt2) "h.0..."; export writes the former."""
    p = "transformer." if hf_names is None or any(n.startswith("transformer.") for n in hf_names) else ""
    flags = bias_flags(config)
    plan: Plan = {"embed.weight": ((p + "wte.weight",), *SAME), "pos_embed.weight": ((p + "wpe.weight",), *SAME)}
    absent: set[str] = set()

    def add_bias(ours: str, hf: str, on: bool) -> None:
        if on:
            plan[ours] = ((hf,), *SAME)
        else:
            absent.add(hf)

    for i in range(config.n_layers):
        hf, ours = f"{p}h.{i}.", f"blocks.{i}."
        for hf_ln, our_ln in (("ln_1", "ln1"), ("ln_2", "ln2")):
            plan[ours + our_ln + ".weight"] = ((hf + hf_ln + ".weight",), *SAME)
            add_bias(ours + our_ln + ".bias", hf + hf_ln + ".bias", flags["norm"])
        for hf_lin, our_lin, site in _LINEARS:
            # c_attn's output is [q | k | v], the same order as our fused qkv.
            plan[ours + our_lin + ".weight"] = ((hf + hf_lin + ".weight",), *CONV1D)
            add_bias(ours + our_lin + ".bias", hf + hf_lin + ".bias", flags[site])
    plan["ln_final.weight"] = ((p + "ln_f.weight",), *SAME)
    add_bias("ln_final.bias", p + "ln_f.bias", flags["norm"])
    if not config.tie_embeddings:
        plan["unembed.weight"] = (("lm_head.weight",), *SAME)
    return WeightTable(plan, frozenset(absent))


# llama.cpp stores GPT-2's Conv1D weights as ordinary (d_out, d_in) matrices.
_CONV1D_IN_GGUF = TensorFix(r"(transformer\.)?h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight",
                            lambda t, hf: t.t(), lambda t, hf: t.t())
GGUF = GGUFForm("gpt2", {"context_length": "n_positions", "embedding_length": "n_embd", "block_count": "n_layer",
                         "feed_forward_length": "n_inner", "attention.head_count": "n_head",
                         "attention.layer_norm_epsilon": "layer_norm_epsilon"},
                hf_extras=lambda values, names: {"activation_function": "gelu_new"}, fixes=(_CONV1D_IN_GGUF,))

FAMILY = HFFamily(
    name="gpt2", architecture="GPT2LMHeadModel", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    fit_problems=fit_problems, weight_table=weight_table,
    # Old checkpoints saved the causal mask as buffers attn.bias / attn.masked_bias.
    ignored_tensors=r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)", gguf=GGUF,
)
