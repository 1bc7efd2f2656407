"""Move models between glasslm and Hugging Face `transformers` (GPT-2 and Llama families).

Import reads an HF directory (`config.json` plus `model.safetensors`, sharded safetensors with an
index, or `pytorch_model.bin`) and builds the matching `TransformerLM`; export writes a directory
that `transformers.AutoModelForCausalLM.from_pretrained` loads and that gives the same logits.

Loading never holds two copies of the weights: the model is first built on the `meta` device
(shapes, no storage), then the checkpoint tensors — read memory-mapped — are *assigned* into it.
Buffers that are not saved (rotary cos/sin tables, the sinusoidal table) are then computed on the
real device by `materialize_buffers`.

Example:
    >>> import tempfile
    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> model = TransformerLM(get_preset("llama-tiny"))
    >>> out = export_hf(model, tempfile.mkdtemp())
    >>> back = import_hf(out)
    >>> all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))
    True
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from glasslm.core.config import ModelConfig
from glasslm.io.build import model_from_state_dict
from glasslm.io.checkpoint import read_json
from glasslm.core.model import TransformerLM

Family = Literal["gpt2", "llama", "mistral", "qwen2"]

HF_CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN_FILE = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"

# HF activation names -> ours. "gelu_new", "gelu_fast" and "gelu_pytorch_tanh" are all the tanh
# approximation 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))) written differently.
_HF_ACTIVATIONS = {
    "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu", "relu": "relu", "silu": "silu", "swish": "silu",
}
_GPT2_ACTIVATION_NAMES = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}


class UnsupportedModelError(ValueError):
    """The checkpoint or model is outside what glasslm can convert (named in the message)."""


# --- rotary layout -------------------------------------------------------------------------------
#
# Our RotaryPositions rotates ADJACENT feature pairs (x[2i], x[2i+1]) of each head, as in the
# RoFormer paper and Meta's original Llama code. HF's Llama rotates x[i] with x[i + d_head/2]
# ("rotate_half"), because Meta's weights were permuted when they were converted to HF. Both use
# the same frequency for pair i, so the models agree exactly once the rows of each head's q and k
# projections are reordered: our row 2i is HF row i and our row 2i+1 is HF row i + d_head/2.
# (q·k is unchanged by reordering features the same way in q and k; v and o need nothing.)

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


# --- configs -------------------------------------------------------------------------------------

LLAMA_LIKE: tuple[str, ...] = ("llama", "mistral", "qwen2")
_ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM"}
GLASSLM_KEY = "glasslm"  # config.json entry recording what HF's format cannot (a bias-free GPT-2)


# ModelConfig's per-site bias switches (None: follow `bias`). Sites whose field ModelConfig does not
# have (yet) always follow `bias`; `_bias_flags` and `_bias_fields` are the only readers and writers.
_BIAS_FIELDS = {"qkv": "attn_qkv_bias", "out": "attn_out_bias", "mlp": "mlp_bias", "norm": "norm_bias"}


def _bias_flags(config: ModelConfig) -> dict[str, bool]:
    """Which parts of each block carry biases: q/k/v projections, attention output, MLP, norms."""
    c = config
    flags = {site: getattr(c, field, None) for site, field in _BIAS_FIELDS.items()}
    flags = {site: c.bias if on is None else bool(on) for site, on in flags.items()}
    if c.norm != "layernorm":
        flags["norm"] = False  # RMSNorm has no shift
    return flags


def _bias_fields(flags: dict[str, bool]) -> dict[str, bool]:
    """The ModelConfig fields that give these per-site biases (the inverse of `_bias_flags`)."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    base = flags["out"]
    fields = {"bias": base}
    for site, on in flags.items():
        if on != base:
            if _BIAS_FIELDS[site] not in known:
                raise UnsupportedModelError(
                    f"biases on the {site} site differ from the attention output's, and this ModelConfig "
                    f"has no {_BIAS_FIELDS[site]} field to say so")
            fields[_BIAS_FIELDS[site]] = on
    return fields


def family_of(config: ModelConfig) -> Family:
    """Which HF architecture a glasslm config matches, or UnsupportedModelError saying why not.

    Rotary models map to Llama (no biases, or biases everywhere: attention_bias = mlp_bias),
    Qwen2 (biases on q/k/v only) or Mistral (a sliding window, no biases).
    """
    c = config
    common = []
    if c.norm_placement != "pre":
        common.append("post-norm blocks")
    if not c.final_norm:
        common.append("no final norm")
    if c.scale_embeddings:
        common.append("scaled embeddings")
    if c.unembed_bias:
        common.append("a bias on the logits (unembed_bias)")
    if c.norm_unbiased_std:
        common.append("LayerNorm by the unbiased std (norm_unbiased_std)")
    if not math.isclose(c.attn_score_scale, c.d_head ** -0.5, rel_tol=1e-12):
        common.append(f"attention scores scaled by {c.attn_score_scale:g}, not 1/sqrt(d_head)")
    if c.positional == "learned":
        problems = list(common)
        if c.norm != "layernorm":
            problems.append(f"norm={c.norm}")
        if c.mlp != "mlp":
            problems.append(f"mlp={c.mlp}")
        if c.n_kv_heads != c.n_heads:
            problems.append("grouped-query attention")
        if c.d_head * c.n_heads != c.d_model:
            problems.append(f"d_head={c.d_head} with d_model/n_heads={c.d_model // c.n_heads}")
        if c.sliding_window is not None:
            problems.append("sliding-window attention")
        if c.rope_scaling != "none":
            problems.append("rope scaling without rotary positions")
        if not problems:
            return "gpt2"
        raise UnsupportedModelError(f"learned positions but not GPT-2 shaped: {', '.join(problems)}")
    if c.positional == "rope":
        problems = list(common)
        if c.norm != "rmsnorm":
            problems.append(f"norm={c.norm}")
        if c.mlp != "swiglu" or c.activation != "silu":
            problems.append(f"mlp={c.mlp} with activation={c.activation} (Llama needs swiglu with silu)")
        flags = _bias_flags(c)
        family: Family = "llama"  # attention_bias (q, k, v and o alike) and mlp_bias
        if flags["qkv"] and not flags["out"] and not flags["mlp"]:
            family = "qwen2"
        elif flags["qkv"] != flags["out"]:
            problems.append(f"biases on {[k for k, v in flags.items() if v]} only")
        if c.sliding_window is not None:
            if family == "qwen2" or flags["qkv"]:
                problems.append("a sliding window together with biases")
            family = "mistral"
            if c.rope_scaling != "none":
                problems.append("a sliding window together with rope scaling")
        if not problems:
            return family
        raise UnsupportedModelError(f"rotary positions but not Llama/Qwen2/Mistral shaped: {', '.join(problems)}")
    raise UnsupportedModelError(
        f"positional={c.positional!r} has no Hugging Face counterpart here (only GPT-2: learned, Llama: rope)"
    )


def config_from_hf(hf: dict[str, Any], context_length: int | None = None) -> tuple[ModelConfig, Family]:
    """The ModelConfig equal to an HF `config.json` (as a dict), and which family it is.

    `context_length` overrides max_position_embeddings for rotary models (rotary tables are
    computed for that many positions; some configs advertise far more than you will use).
    """
    model_type = hf.get("model_type")
    architectures = hf.get("architectures") or []
    if model_type == "gpt2":
        return _gpt2_config_from_hf(hf, context_length), "gpt2"
    if model_type in LLAMA_LIKE:
        return _llama_config_from_hf(hf, context_length, model_type), model_type
    raise UnsupportedModelError(
        f"unsupported architecture model_type={model_type!r} {architectures}: glasslm converts "
        "GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM"
    )


def _gpt2_config_from_hf(hf: dict[str, Any], context_length: int | None) -> ModelConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in _HF_ACTIVATIONS:
        raise UnsupportedModelError(f"GPT-2 activation_function {act!r} is not supported")
    for flag, wanted in (("scale_attn_by_inverse_layer_idx", False), ("scale_attn_weights", True),
                         ("add_cross_attention", False), ("reorder_and_upcast_attn", False)):
        if hf.get(flag, wanted) != wanted:
            raise UnsupportedModelError(f"GPT-2 option {flag}={hf[flag]!r} is not supported")
    n_positions = hf.get("n_positions", 1024)
    if context_length is not None and context_length != n_positions:
        raise UnsupportedModelError("GPT-2's learned position table fixes the context length to n_positions")
    d_model = hf.get("n_embd", 768)
    # A glasslm export of a bias-free model records which (zero) biases are not part of the model.
    sites = (hf.get(GLASSLM_KEY) or {}).get("bias_sites") or {}
    biases = _bias_fields({site: bool(sites.get(site, True)) for site in _BIAS_FIELDS})
    return ModelConfig(
        vocab_size=hf.get("vocab_size", 50257), context_length=n_positions, d_model=d_model,
        n_layers=hf.get("n_layer", 12), n_heads=hf.get("n_head", 12), d_mlp=hf.get("n_inner") or 4 * d_model,
        positional="learned", norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        activation=_HF_ACTIVATIONS[act], mlp="mlp", **biases, tie_embeddings=hf.get("tie_word_embeddings", True),
        dropout=0.0,  # HF's dropout rates only matter for training; we import for inference
    )


def _rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and scaling from either the transformers-5 `rope_parameters` or the older keys."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise UnsupportedModelError(f"cannot read rope parameters {params!r}")
    if "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]  # per-layer-type parameters (all layers are full attention)
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if rope_type == "default":
        extra = set(params) - {"rope_type", "type", "rope_theta"}
        if extra:
            raise UnsupportedModelError(f"unsupported rope parameters {sorted(extra)} in {params}")
        return {"rope_theta": theta}
    if rope_type == "llama3":
        extra = set(params) - {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                               "original_max_position_embeddings"}
        if extra:
            raise UnsupportedModelError(f"unsupported llama3 rope parameters {sorted(extra)}")
        return {"rope_theta": theta, "rope_scaling": "llama3", "rope_factor": float(params["factor"]),
                "rope_low_freq_factor": float(params["low_freq_factor"]),
                "rope_high_freq_factor": float(params["high_freq_factor"]),
                "rope_original_context": int(params["original_max_position_embeddings"])}
    raise UnsupportedModelError(
        f"rope scaling {rope_type!r} is not supported (plain rotary positions and Llama 3's 'llama3' are)"
    )


def _sliding_window(hf: dict[str, Any], model_type: str, n_layers: int) -> int | None:
    """The window every layer uses, None for full attention; mixed layers are refused."""
    window = hf.get("sliding_window")
    if model_type == "llama":
        return None
    if model_type == "qwen2":
        types = hf.get("layer_types") or [
            "sliding_attention" if hf.get("use_sliding_window") and i >= hf.get("max_window_layers", n_layers)
            else "full_attention" for i in range(n_layers)]
        if all(t == "full_attention" for t in types):
            return None
        if not all(t == "sliding_attention" for t in types):
            raise UnsupportedModelError("Qwen2 with sliding-window attention on some layers only is not supported")
        return window
    types = hf.get("layer_types")
    if types and len(set(types)) > 1:
        raise UnsupportedModelError(f"mixed attention layer types {sorted(set(types))} are not supported")
    return window


def _llama_config_from_hf(hf: dict[str, Any], context_length: int | None, model_type: str) -> ModelConfig:
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"{model_type} hidden_act {act!r} is not supported (only silu)")
    flags = {"qkv": False, "out": False, "mlp": False}  # Mistral: none
    if model_type == "llama":
        attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
        flags = {"qkv": attention_bias, "out": attention_bias, "mlp": mlp_bias}
    elif model_type == "qwen2":
        flags = {"qkv": True, "out": False, "mlp": False}  # always: q/k/v biases, none on o_proj or the MLP
    try:
        biases = _bias_fields({**flags, "norm": flags["out"]})  # (RMSNorm: the norm site has no bias)
    except UnsupportedModelError as err:
        raise UnsupportedModelError(f"{model_type} with attention_bias={flags['out']} and "
                                    f"mlp_bias={flags['mlp']} is not supported: {err}") from None
    d_model, n_heads = hf.get("hidden_size", 4096), hf.get("num_attention_heads", 32)
    n_layers = hf.get("num_hidden_layers", 32)
    return ModelConfig(
        vocab_size=hf.get("vocab_size", 32000),
        context_length=context_length or hf.get("max_position_embeddings", 2048),
        d_model=d_model, n_layers=n_layers, n_heads=n_heads, d_head=hf.get("head_dim") or d_model // n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads, d_mlp=hf.get("intermediate_size", 11008),
        positional="rope", norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6),
        activation="silu", mlp="swiglu", **biases,
        tie_embeddings=hf.get("tie_word_embeddings", False), dropout=0.0,
        sliding_window=_sliding_window(hf, model_type, n_layers), **_rope_fields(hf),
    )


def config_to_hf(
    config: ModelConfig, dtype: torch.dtype = torch.float32, special_ids: dict[str, int | None] | None = None,
    zero_biases: bool = False,
) -> dict[str, Any]:
    """An HF `config.json` (as a dict) for a glasslm config of a supported family.

    `special_ids` ({"bos": id, "eos": id, "pad": id}, from the tokenizer) are written as given,
    None included: transformers fills absent GPT-2 ids with 50256, right only for GPT-2's own
    vocabulary. A bias-free GPT-2-shaped model needs `zero_biases=True` (see `export_hf`).
    """
    c = config
    family = family_of(c)
    dtype_name = str(dtype).removeprefix("torch.")
    ids = {f"{role}_token_id": (special_ids or {}).get(role) for role in ("bos", "eos", "pad")}
    head = {"architectures": [_ARCHITECTURES[family]], "model_type": family}
    if family == "gpt2":
        if c.activation not in _GPT2_ACTIVATION_NAMES:
            raise UnsupportedModelError(f"activation {c.activation!r} has no GPT-2 counterpart")
        flags = _bias_flags(c)
        missing = [site for site, on in flags.items() if not on]
        if missing and not zero_biases:
            raise UnsupportedModelError(
                f"a GPT-2-shaped model without biases ({', '.join(missing)}) has no exact Hugging Face form: "
                "GPT-2 always has biases. Export with zero biases (`--zero-biases`, export_hf(zero_biases=True)): "
                "transformers then computes the same logits, and glasslm re-imports it bias-free")
        marker = {GLASSLM_KEY: {"bias_sites": flags}} if missing else {}
        return {
            **head, "vocab_size": c.vocab_size, "n_positions": c.context_length, "n_embd": c.d_model,
            "n_layer": c.n_layers, "n_head": c.n_heads, "n_inner": c.d_mlp,
            "activation_function": _GPT2_ACTIVATION_NAMES[c.activation], "layer_norm_epsilon": c.norm_eps,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
            "tie_word_embeddings": c.tie_embeddings, **ids, "dtype": dtype_name, **marker,
        }
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": c.rope_theta, "factor": c.rope_factor,
                "low_freq_factor": c.rope_low_freq_factor, "high_freq_factor": c.rope_high_freq_factor,
                "original_max_position_embeddings": c.rope_original_context}
    out = {
        **head, "vocab_size": c.vocab_size, "hidden_size": c.d_model, "intermediate_size": c.d_mlp,
        "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads, "head_dim": c.d_head, "hidden_act": "silu",
        "max_position_embeddings": c.context_length, "rms_norm_eps": c.norm_eps,
        # transformers >= 5 reads rope_parameters; older versions read rope_theta (and rope_scaling).
        "rope_parameters": rope, "rope_theta": c.rope_theta,
        "tie_word_embeddings": c.tie_embeddings, **ids, "dtype": dtype_name,
    }
    if c.rope_scaling != "none":
        out["rope_scaling"] = rope
    if family == "llama":
        flags = _bias_flags(c)
        out.update(attention_bias=flags["qkv"], mlp_bias=flags["mlp"])
    elif family == "mistral":
        out["sliding_window"] = c.sliding_window
    elif family == "qwen2":
        out.update(use_sliding_window=False, sliding_window=None)
    return out


# --- reading tensors lazily ----------------------------------------------------------------------

class TensorSource:
    """Names and lazily-read tensors of a checkpoint, from one or many files.

    Safetensors files are opened with `safe_open` (memory-mapped): a tensor is read only when
    asked for. `.bin` files are loaded with `torch.load(weights_only=True, mmap=True)`.
    """

    def __init__(self, readers: dict[str, Callable[[], Tensor]], source: str):
        self._readers, self.source = readers, source

    def names(self) -> set[str]:
        return set(self._readers)

    def get(self, name: str) -> Tensor:
        return self._readers[name]()

    @classmethod
    def from_directory(cls, directory: str | os.PathLike) -> "TensorSource":
        path = Path(directory)
        if (path / SAFETENSORS_FILE).is_file():
            return cls.from_safetensors([path / SAFETENSORS_FILE], str(path / SAFETENSORS_FILE))
        if (path / SAFETENSORS_INDEX).is_file():
            return cls.from_safetensors(_shard_files(path, SAFETENSORS_INDEX), str(path / SAFETENSORS_INDEX))
        if (path / TORCH_BIN_FILE).is_file():
            return cls.from_torch_bin([path / TORCH_BIN_FILE], str(path / TORCH_BIN_FILE))
        if (path / TORCH_BIN_INDEX).is_file():
            return cls.from_torch_bin(_shard_files(path, TORCH_BIN_INDEX), str(path / TORCH_BIN_INDEX))
        raise FileNotFoundError(
            f"no weights in {path}: expected {SAFETENSORS_FILE}, {SAFETENSORS_INDEX} or {TORCH_BIN_FILE}"
        )

    @classmethod
    def from_safetensors(cls, files: Iterable[Path], source: str) -> "TensorSource":
        from safetensors import safe_open

        readers: dict[str, Callable[[], Tensor]] = {}
        for file in files:
            try:
                handle = safe_open(str(file), framework="pt", device="cpu")
            except Exception as err:  # SafetensorError and friends: name the file, no traceback
                raise ValueError(f"{file} is not a readable safetensors file ({err}); truncated or corrupt?") from None
            for name in handle.keys():
                readers[name] = lambda handle=handle, name=name: handle.get_tensor(name)
        return cls(readers, source)

    @classmethod
    def from_torch_bin(cls, files: Iterable[Path], source: str) -> "TensorSource":
        readers: dict[str, Callable[[], Tensor]] = {}
        import pickle

        for file in files:
            with open(file, "rb") as f:
                if f.read(1) == b"\x80":  # a bare pickle stream, not torch.save's zip archive
                    raise ValueError(f"refusing to load pickled code from {file}: a bare pickle, not a "
                                     "torch.save archive; convert it to safetensors with a tool you trust")
            try:
                # weights_only: the restricted unpickler, which refuses any code a file names.
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except pickle.UnpicklingError as err:
                named = re.search(r"Unsupported global: GLOBAL [\w.]+", str(err))
                reason = named.group(0) if named else "it names code to run"
                raise ValueError(f"refusing to load pickled code from {file}: it holds more than tensors "
                                 f"({reason}); convert it to safetensors with a tool you trust") from None
            except (RuntimeError, OSError, EOFError, ValueError) as err:
                raise ValueError(f"{file} is not a readable PyTorch weights file ({' '.join(str(err).split())}); "
                                 "truncated or corrupt?") from None
            if not isinstance(state, dict) or not all(isinstance(t, Tensor) for t in state.values()):
                raise ValueError(f"{file} does not hold a state dict of tensors")
            for name, tensor in state.items():
                readers[name] = lambda tensor=tensor: tensor
        return cls(readers, source)


def _shard_files(directory: Path, index_name: str) -> list[Path]:
    index = json.loads((directory / index_name).read_text())
    files = sorted(set(index["weight_map"].values()))
    missing = [f for f in files if not (directory / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{directory / index_name} lists shards that do not exist: {missing}")
    return [directory / f for f in files]


# --- weight name mapping -------------------------------------------------------------------------
#
# An import plan maps each of our tensor names to (the HF tensors it is made from, how to make it).
# Keeping the HF names explicit lets import report missing and unexpected tensors by name.

# One table per family maps each glasslm tensor to the HF tensors it is made of, with the conversion
# each way: (HF names, to_ours(*hf_tensors) -> ours, to_hf(ours) -> hf_tensors). Import reads it left
# to right, export right to left, so the two can never disagree about a name or a layout.
Plan = dict[str, tuple[tuple[str, ...], Callable[..., Tensor], Callable[[Tensor], tuple[Tensor, ...]]]]
SAME = (lambda t: t, lambda t: (t,))
_GPT2_BIAS = re.compile(r"\.(ln_\d|ln_f|c_attn|c_proj|c_fc)\.bias$")  # not the old attn.bias mask buffers


def _conv1d_to_linear(t: Tensor) -> Tensor:
    # HF's GPT-2 uses Conv1D, which stores weights (d_in, d_out); our Linear stores (d_out, d_in).
    return t.t().contiguous()


CONV1D = (_conv1d_to_linear, lambda t: (t.t(),))


def _gpt2_plan(config: ModelConfig, prefix: str = "transformer.") -> tuple[Plan, set[str]]:
    """The GPT-2 table, plus the HF bias names this config has no tensor for.

    HF GPT-2 always has those biases: import accepts them when they are zero (a glasslm export of a
    bias-free model), export writes zeros there when asked (`zero_biases`). `prefix` is
    "transformer." for GPT2LMHeadModel files, "" for the bare GPT2Model (and the original hub gpt2).
    """
    p = prefix
    flags = _bias_flags(config)
    plan: Plan = {"embed.weight": ((p + "wte.weight",), *SAME), "pos_embed.weight": ((p + "wpe.weight",), *SAME)}
    absent_biases: set[str] = set()

    def add_bias(ours: str, hf: str, on: bool) -> None:
        if on:
            plan[ours] = ((hf,), *SAME)
        else:
            absent_biases.add(hf)

    for i in range(config.n_layers):
        hf, ours = f"{p}h.{i}.", f"blocks.{i}."
        for hf_ln, our_ln in (("ln_1", "ln1"), ("ln_2", "ln2")):
            plan[ours + our_ln + ".weight"] = ((hf + hf_ln + ".weight",), *SAME)
            add_bias(ours + our_ln + ".bias", hf + hf_ln + ".bias", flags["norm"])
        for hf_lin, our_lin, site in (("attn.c_attn", "attn.qkv", "qkv"), ("attn.c_proj", "attn.out", "out"),
                                      ("mlp.c_fc", "mlp.up", "mlp"), ("mlp.c_proj", "mlp.down", "mlp")):
            # c_attn's output is [q | k | v], the same order as our fused qkv.
            plan[ours + our_lin + ".weight"] = ((hf + hf_lin + ".weight",), *CONV1D)
            add_bias(ours + our_lin + ".bias", hf + hf_lin + ".bias", flags[site])
    plan["ln_final.weight"] = ((p + "ln_f.weight",), *SAME)
    add_bias("ln_final.bias", p + "ln_f.bias", flags["norm"])
    if not config.tie_embeddings:
        plan["unembed.weight"] = (("lm_head.weight",), *SAME)
    return plan, absent_biases


def _llama_plan(config: ModelConfig) -> tuple[Plan, set[str]]:
    """The Llama / Mistral / Qwen2 table (every bias it lacks is simply absent in HF too)."""
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

    flags = _bias_flags(config)
    plan: Plan = {"embed.weight": (("model.embed_tokens.weight",), *SAME)}
    for i in range(config.n_layers):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        plan[ours + "ln1.weight"] = ((hf + "input_layernorm.weight",), *SAME)
        for kind in ("weight", "bias") if flags["qkv"] else ("weight",):
            plan[ours + f"attn.qkv.{kind}"] = (tuple(hf + f"self_attn.{x}_proj.{kind}" for x in "qkv"),
                                                fused_qkv, split_qkv)
        for kind in ("weight", "bias") if flags["out"] else ("weight",):
            plan[ours + f"attn.out.{kind}"] = ((hf + f"self_attn.o_proj.{kind}",), *SAME)
        plan[ours + "ln2.weight"] = ((hf + "post_attention_layernorm.weight",), *SAME)
        for proj in ("gate", "up", "down"):
            for kind in ("weight", "bias") if flags["mlp"] else ("weight",):
                plan[ours + f"mlp.{proj}.{kind}"] = ((hf + f"mlp.{proj}_proj.{kind}",), *SAME)
    plan["ln_final.weight"] = (("model.norm.weight",), *SAME)
    if not config.tie_embeddings:
        plan["unembed.weight"] = (("lm_head.weight",), *SAME)
    return plan, set()


# --- building models without a second copy of the weights ---------------------------------------

# --- import / export ------------------------------------------------------------------------------

def read_hf_config(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / HF_CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: not a Hugging Face model directory?")
    data = read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a model config")
    return data


def import_hf(
    directory: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
    context_length: int | None = None,
) -> TransformerLM:
    """A glasslm model (eval mode) with the weights of the HF model in `directory`.

    `directory` may also be a hub name ("gpt2", "org/name") found in the local HF cache (see
    `resolve_model_path`; nothing is downloaded). `dtype` converts the weights (default: keep the
    checkpoint's); `context_length` overrides a rotary model's max_position_embeddings.
    """
    directory = resolve_model_path(directory)
    config, family = config_from_hf(read_hf_config(directory), context_length)
    source = TensorSource.from_directory(directory)
    names = source.names()
    if family == "gpt2":
        # GPT2LMHeadModel saves "transformer.h.0...", the bare GPT2Model (and the original hub gpt2) "h.0...".
        plan, absent = _gpt2_plan(config, "transformer." if any(n.startswith("transformer.") for n in names) else "")
        # Old checkpoints saved the causal mask as buffers attn.bias / attn.masked_bias.
        ignorable = {n for n in names if re.fullmatch(r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)", n)}
        ignorable |= absent & names
    else:
        plan, _ = _llama_plan(config)
        ignorable = {n for n in names if n.endswith("rotary_emb.inv_freq")}  # recomputed from the config
    if config.tie_embeddings:
        ignorable.add("lm_head.weight")  # a tied model may carry a copy of the embedding; transformers re-ties it
    needed = {hf_name for hf_names, _, _ in plan.values() for hf_name in hf_names}
    missing, unexpected = sorted(needed - names), sorted(names - needed - ignorable)
    if missing or unexpected:
        raise ValueError(
            f"{source.source} does not match a {family} model with this config.json: "
            f"missing tensors {missing[:8]}, unexpected tensors {unexpected[:8]}"
        )
    for name in sorted(ignorable & names):
        if _GPT2_BIAS.search(name) and source.get(name).any():
            raise ValueError(
                f"{source.source}: {name} is not zero, but config.json's {GLASSLM_KEY!r} entry says the model "
                f"has no biases there; remove that entry to import the biases")
    makers = {ours: (lambda hf_names=hf_names, to_ours=to_ours: to_ours(*map(source.get, hf_names)))
              for ours, (hf_names, to_ours, _) in plan.items()}
    return model_from_state_dict(config, makers, device, dtype, source.source)


def hf_state_dict(model: TransformerLM, zero_biases: bool = False) -> dict[str, Tensor]:
    """The model's weights under HF names and layouts: the import table read right to left.

    `zero_biases` fills the biases a bias-free GPT-2-shaped model lacks with zeros (HF GPT-2
    always has them); without it such a model is refused.
    """
    c, family = model.config, family_of(model.config)
    ours = {name: t.detach() for name, t in model.state_dict().items()}
    if family == "gpt2":
        if not all(_bias_flags(c).values()) and not zero_biases:
            config_to_hf(c)  # raises the explanation
        plan, absent = _gpt2_plan(c)
    else:
        plan, absent = _llama_plan(c)
    out: dict[str, Tensor] = {}
    for name, (hf_names, _, to_hf) in plan.items():
        out.update(zip(hf_names, to_hf(ours[name])))
    for hf_bias in absent:
        # A bias has one entry per output feature: the last axis of its Conv1D weight, or the norm's size.
        weight = out[hf_bias.removesuffix("bias") + "weight"]
        out[hf_bias] = torch.zeros(weight.shape[-1], dtype=weight.dtype, device=weight.device)
    # A tied model saves only the embedding; transformers re-ties lm_head to it on load.
    return out


def export_hf(
    model: TransformerLM, directory: str | os.PathLike, tokenizer: Any | None = None,
    meta: dict[str, Any] | None = None, *, zero_biases: bool = False,
) -> Path:
    """Write `model` as an HF directory that `AutoModelForCausalLM` and `AutoTokenizer` load.

    Files: config.json (with the tokenizer's real bos/eos/pad ids, None where it has none),
    model.safetensors, generation_config.json, the tokenizer as tokenizer.json +
    tokenizer_config.json (a SentencePiece one as tokenizer.model), and a README.md model card
    built from `meta` (what `checkpoint_summary` returns: training data, steps, val loss).

    Raises UnsupportedModelError for architectures outside GPT-2 / Llama / Mistral / Qwen2. HF
    GPT-2 always has biases, so a bias-free GPT-2-shaped model (nanoGPT style, like the
    shakespeare-char presets) is refused unless `zero_biases=True`: then exact zeros are written,
    transformers computes the same logits, and config.json notes the model is bias-free so that
    `import_hf` gives the bias-free model back (same parameter count).
    """
    from safetensors.torch import save_file

    from glasslm.tokenizers import save_hf_tokenizer, special_token_ids

    c = model.config
    special_ids = {k: v for k, v in special_token_ids(tokenizer).items() if k != "unk"}
    config_dict = config_to_hf(c, model.embed.weight.dtype, special_ids, zero_biases)
    # safetensors wants contiguous CPU tensors that share no memory with each other.
    weights = {name: t.contiguous().cpu().clone() for name, t in hf_state_dict(model, zero_biases).items()}
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / SAFETENSORS_FILE), metadata={"format": "pt"})
    (path / HF_CONFIG_FILE).write_text(json.dumps(config_dict, indent=2))
    generation = {key: config_dict[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
                  if config_dict[key] is not None}
    (path / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2))
    if tokenizer is not None:
        save_hf_tokenizer(tokenizer, path, c.context_length)
    (path / "README.md").write_text(model_card(model, tokenizer, meta, config_dict["model_type"]))
    return path


def model_card(model: TransformerLM, tokenizer: Any | None, meta: dict[str, Any] | None, family: str) -> str:
    """A short README.md: architecture, size, tokenizer, training data, steps and val loss when known."""
    c, meta = model.config, meta or {}
    rows = [
        ("architecture", f"{_ARCHITECTURES[family]} ({family}): {c.n_layers} layers, d_model {c.d_model}, "
                         f"{c.n_heads} heads ({c.n_kv_heads} key/value) of size {c.d_head}, d_mlp {c.d_mlp}"),
        ("parameters", f"{model.num_parameters():,}"),
        ("context length", f"{c.context_length}"),
        ("tokenizer", "none saved" if tokenizer is None
         else f"{getattr(tokenizer, 'kind', '?')}, {tokenizer.vocab_size:,} tokens"),
    ]
    for key, label in (("data", "training data"), ("converted_from", "converted from"), ("init_from", "fine-tuned from"),
                       ("step", "training steps"), ("val_loss", "validation loss")):
        if meta.get(key) is not None:
            value = meta[key]
            rows.append((label, f"{value:.4f}" if isinstance(value, float) else str(value)))
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return (f"---\nlibrary_name: transformers\ntags: [glasslm]\n---\n\n# glasslm model\n\n"
            f"Exported by glasslm. Load it with transformers:\n\n```python\n"
            f"from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            f"model = AutoModelForCausalLM.from_pretrained(\"PATH\")\n"
            f"tokenizer = AutoTokenizer.from_pretrained(\"PATH\")\n```\n\n| | |\n|---|---|\n{table}\n")


# --- the local Hugging Face cache -----------------------------------------------------------------

_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def hf_cache_dir() -> Path:
    """Where the Hugging Face hub keeps downloaded models: $HF_HUB_CACHE, else $HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub (the huggingface_hub rules)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return cache / "huggingface" / "hub"


def resolve_model_path(spec: str | os.PathLike) -> Path:
    """A local path as is; a hub name ("gpt2", "org/name") as its snapshot in the local HF cache.

    The cache layout is models--org--name/snapshots/<revision>/, with refs/main naming the
    revision. Nothing is downloaded: a name missing from the cache is an error naming where it
    was looked for.
    """
    path = Path(spec)
    if path.exists() or not _HUB_NAME.fullmatch(str(spec)):
        return path
    repo = hf_cache_dir() / ("models--" + str(spec).replace("/", "--"))
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = repo / "snapshots" / ref.read_text().strip()
        if snapshot.is_dir():
            return snapshot
    snapshots = sorted((repo / "snapshots").iterdir(), key=lambda p: p.stat().st_mtime) \
        if (repo / "snapshots").is_dir() else []
    if snapshots:
        return snapshots[-1]  # no refs/main: the most recently written revision
    raise FileNotFoundError(
        f"{spec} is not a local path, and the local Hugging Face cache has no {repo.name}: looked in {repo} "
        "(set HF_HUB_CACHE or HF_HOME to another cache; glasslm never downloads, so fetch it first, "
        f"e.g. `hf download {spec}`)"
    )


# --- tokenizers and one loader for both kinds of directory ---------------------------------------

def hf_tokenizer(directory: str | os.PathLike) -> Any | None:
    """The tokenizer of an HF model directory (tokenizer.json, tokenizer.model, or GPT-2's
    vocab.json + merges.txt), or None if it has none."""
    from glasslm.tokenizers import read_hf_tokenizer

    return read_hf_tokenizer(resolve_model_path(directory))


def is_hf_directory(directory: str | os.PathLike) -> bool:
    """True if `directory/config.json` is an HF config (it names a model_type), not a glasslm one."""
    path = Path(directory) / HF_CONFIG_FILE
    if not path.is_file():
        return False
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError:
        return False
    return isinstance(data, dict) and "model_type" in data


def load_model(
    path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> tuple[TransformerLM, Any | None]:
    """(model in eval mode, tokenizer or None) from a glasslm checkpoint, run directory, HF model
    directory, or a hub name in the local HF cache.

    Either way the weights are memory-mapped and assigned into a meta-device model, so loading a
    large model needs about one copy of its weights in memory.
    """
    from glasslm.io.checkpoint import load_checkpoint

    path = resolve_model_path(path)
    if is_hf_directory(path):
        return import_hf(path, device, dtype), hf_tokenizer(path)
    model, tokenizer, _ = load_checkpoint(path, device)  # a run directory means its best (else latest)
    return (model if dtype is None else model.to(dtype)), tokenizer


def checkpoint_summary(path: str | os.PathLike) -> dict[str, Any]:
    """What is known about how a checkpoint was made (for model cards and `glasslm info`):
    data, steps, best validation loss, and where it was converted or fine-tuned from."""
    from glasslm.io.checkpoint import resolve_checkpoint

    path = resolve_model_path(path)
    if is_hf_directory(path):
        return {"converted_from": str(path)}
    directory = resolve_checkpoint(path)
    summary: dict[str, Any] = {}
    for name in ("meta.json", "trainer_state.json"):
        if (directory / name).is_file():
            summary.update(read_json(directory / name))
    out = {key: summary.get(key) for key in ("data", "converted_from", "step")}
    out["init_from"] = (summary.get("train_config") or {}).get("init_from")
    best = summary.get("best_val_loss")
    out["val_loss"] = best if isinstance(best, (int, float)) and best != float("inf") else None
    return out


def init_weights_from(model: TransformerLM, path: str | os.PathLike) -> None:
    """Copy the weights of a checkpoint / HF directory / cached hub name into `model` (fine-tuning).

    The architectures must match except for training-only settings (dropout, attention impl)
    and, for rotary models, the context length.
    """
    from glasslm.io.build import load_weights

    source, _ = load_model(path)
    if _comparable(source.config) != _comparable(model.config):
        raise ValueError(f"{path} holds a different architecture than the model to train: {source.config} vs {model.config}")
    load_weights(model, source.state_dict(), str(path))


def _comparable(config: ModelConfig) -> dict[str, Any]:
    """The fields that must agree between pretrained weights and the model to fine-tune."""
    out = config.to_dict()
    for name in ("dropout", "impl", "init", "init_std"):
        out.pop(name)
    if config.positional != "learned":
        out.pop("context_length")  # rotary / sinusoidal tables are recomputed for any length
    return out


def checkpoint_config(path: str | os.PathLike) -> tuple[ModelConfig, Any | None, dict[str, Any]]:
    """(config, tokenizer or None, summary) of any checkpoint without reading its weights."""
    from glasslm.io.checkpoint import load_config, resolve_checkpoint
    from glasslm.tokenizers import load_tokenizer

    path = resolve_model_path(path)
    if is_hf_directory(path):
        return config_from_hf(read_hf_config(path))[0], hf_tokenizer(path), checkpoint_summary(path)
    directory = resolve_checkpoint(path)
    tokenizer = None
    if any((directory / name).exists() for name in ("tokenizer.json", "glasslm_tokenizer.json", "tokenizer.model")):
        tokenizer = load_tokenizer(directory)
    return load_config(directory / "config.json"), tokenizer, checkpoint_summary(directory)
