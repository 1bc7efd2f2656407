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
    >>> from glasslm.config import get_preset
    >>> from glasslm.model import TransformerLM
    >>> model = TransformerLM(get_preset("llama-tiny"))
    >>> out = export_hf(model, tempfile.mkdtemp())
    >>> back = import_hf(out)
    >>> all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))
    True
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from .config import ModelConfig
from .checkpoint import model_from_state_dict, read_json
from .model import TransformerLM

Family = Literal["gpt2", "llama"]

HF_CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN_FILE = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"

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

def family_of(config: ModelConfig) -> Family:
    """Which HF architecture a glasslm config matches, or UnsupportedModelError saying why not."""
    c = config
    common = []
    if c.norm_placement != "pre":
        common.append("post-norm blocks")
    if not c.final_norm:
        common.append("no final norm")
    if c.scale_embeddings:
        common.append("scaled embeddings")
    if c.positional == "learned":
        problems = list(common)
        if c.norm != "layernorm":
            problems.append(f"norm={c.norm}")
        if c.mlp != "mlp":
            problems.append(f"mlp={c.mlp}")
        if c.n_kv_heads != c.n_heads:
            problems.append("grouped-query attention")
        if not problems:
            return "gpt2"
        raise UnsupportedModelError(f"learned positions but not GPT-2 shaped: {', '.join(problems)}")
    if c.positional == "rope":
        problems = list(common)
        if c.norm != "rmsnorm":
            problems.append(f"norm={c.norm}")
        if c.mlp != "swiglu" or c.activation != "silu":
            problems.append(f"mlp={c.mlp} with activation={c.activation} (Llama needs swiglu with silu)")
        if c.bias:
            problems.append("biases")
        if not problems:
            return "llama"
        raise UnsupportedModelError(f"rotary positions but not Llama shaped: {', '.join(problems)}")
    raise UnsupportedModelError(
        f"positional={c.positional!r} has no Hugging Face counterpart here (only GPT-2: learned, Llama: rope)"
    )


def config_from_hf(hf: dict[str, Any], context_length: int | None = None) -> tuple[ModelConfig, Family]:
    """The ModelConfig equal to an HF `config.json` (as a dict), and which family it is.

    `context_length` overrides max_position_embeddings for Llama models (rotary tables are
    computed for that many positions; some configs advertise far more than you will use).
    """
    model_type = hf.get("model_type")
    architectures = hf.get("architectures") or []
    if model_type == "gpt2":
        return _gpt2_config_from_hf(hf, context_length), "gpt2"
    if model_type == "llama":
        return _llama_config_from_hf(hf, context_length), "llama"
    raise UnsupportedModelError(
        f"unsupported architecture model_type={model_type!r} {architectures}: "
        "glasslm converts GPT2LMHeadModel and LlamaForCausalLM"
    )


def _gpt2_config_from_hf(hf: dict[str, Any], context_length: int | None) -> ModelConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in _HF_ACTIVATIONS:
        raise UnsupportedModelError(f"GPT-2 activation_function {act!r} is not supported")
    for flag, wanted in (("scale_attn_by_inverse_layer_idx", False), ("scale_attn_weights", True),
                         ("add_cross_attention", False)):
        if hf.get(flag, wanted) != wanted:
            raise UnsupportedModelError(f"GPT-2 option {flag}={hf[flag]!r} is not supported")
    n_positions = hf.get("n_positions", 1024)
    if context_length is not None and context_length != n_positions:
        raise UnsupportedModelError("GPT-2's learned position table fixes the context length to n_positions")
    d_model = hf.get("n_embd", 768)
    return ModelConfig(
        vocab_size=hf.get("vocab_size", 50257), context_length=n_positions, d_model=d_model,
        n_layers=hf.get("n_layer", 12), n_heads=hf.get("n_head", 12), d_mlp=hf.get("n_inner") or 4 * d_model,
        positional="learned", norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        activation=_HF_ACTIVATIONS[act], mlp="mlp", bias=True,
        tie_embeddings=hf.get("tie_word_embeddings", True),
        dropout=0.0,  # HF's dropout rates only matter for training; we import for inference
    )


def _rope_theta(hf: dict[str, Any]) -> float:
    """rope_theta from either the transformers-5 `rope_parameters` or the older top-level keys."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise UnsupportedModelError(f"cannot read rope parameters {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise UnsupportedModelError(
            f"rope scaling {rope_type!r} is not supported (only plain rotary positions, rope_scaling=None)"
        )
    if set(params) - {"rope_type", "type", "rope_theta"}:
        raise UnsupportedModelError(f"unsupported rope parameters {params}")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _llama_config_from_hf(hf: dict[str, Any], context_length: int | None) -> ModelConfig:
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"Llama hidden_act {act!r} is not supported (only silu)")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag, False):
            raise UnsupportedModelError(f"Llama option {flag}=True is not supported")
    d_model, n_heads = hf.get("hidden_size", 4096), hf.get("num_attention_heads", 32)
    head_dim = hf.get("head_dim") or d_model // n_heads
    if head_dim * n_heads != d_model:
        raise UnsupportedModelError(f"head_dim {head_dim} x {n_heads} heads != hidden_size {d_model}")
    return ModelConfig(
        vocab_size=hf.get("vocab_size", 32000),
        context_length=context_length or hf.get("max_position_embeddings", 2048),
        d_model=d_model, n_layers=hf.get("num_hidden_layers", 32), n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads, d_mlp=hf.get("intermediate_size", 11008),
        positional="rope", rope_theta=_rope_theta(hf), norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6),
        activation="silu", mlp="swiglu", bias=False, tie_embeddings=hf.get("tie_word_embeddings", False),
        dropout=0.0,
    )


def config_to_hf(config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """An HF `config.json` (as a dict) for a glasslm config of the GPT-2 or Llama family."""
    c = config
    dtype_name = str(dtype).removeprefix("torch.")
    if family_of(c) == "gpt2":
        if c.activation not in _GPT2_ACTIVATION_NAMES:
            raise UnsupportedModelError(f"activation {c.activation!r} has no GPT-2 counterpart")
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": c.vocab_size, "n_positions": c.context_length, "n_embd": c.d_model,
            "n_layer": c.n_layers, "n_head": c.n_heads, "n_inner": c.d_mlp,
            "activation_function": _GPT2_ACTIVATION_NAMES[c.activation], "layer_norm_epsilon": c.norm_eps,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
            "tie_word_embeddings": c.tie_embeddings, "dtype": dtype_name,
        }
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": c.vocab_size, "hidden_size": c.d_model, "intermediate_size": c.d_mlp,
        "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads, "head_dim": c.d_head, "hidden_act": "silu",
        "max_position_embeddings": c.context_length, "rms_norm_eps": c.norm_eps,
        # transformers >= 5 reads rope_parameters; older versions read rope_theta.
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta}, "rope_theta": c.rope_theta,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": c.tie_embeddings,
        "dtype": dtype_name,
    }


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

Plan = dict[str, tuple[tuple[str, ...], Callable[..., Tensor]]]


def _same(t: Tensor) -> Tensor:
    return t


def _conv1d_to_linear(t: Tensor) -> Tensor:
    # HF's GPT-2 uses Conv1D, which stores weights (d_in, d_out); our Linear stores (d_out, d_in).
    return t.t().contiguous()


def _gpt2_plan(config: ModelConfig, hf_names: set[str]) -> tuple[Plan, set[str]]:
    """The import plan for HF GPT-2 tensors, plus HF names that may be present and are not needed."""
    # GPT2LMHeadModel saves "transformer.h.0...", the bare GPT2Model (and the original hub gpt2) "h.0...".
    p = "transformer." if any(n.startswith("transformer.") for n in hf_names) else ""
    plan: Plan = {"embed.weight": ((p + "wte.weight",), _same), "pos_embed.weight": ((p + "wpe.weight",), _same)}
    for i in range(config.n_layers):
        hf, ours = f"{p}h.{i}.", f"blocks.{i}."
        for hf_ln, our_ln in (("ln_1", "ln1"), ("ln_2", "ln2")):
            plan[ours + our_ln + ".weight"] = ((hf + hf_ln + ".weight",), _same)
            plan[ours + our_ln + ".bias"] = ((hf + hf_ln + ".bias",), _same)
        for hf_lin, our_lin in (("attn.c_attn", "attn.qkv"), ("attn.c_proj", "attn.out"),
                                ("mlp.c_fc", "mlp.up"), ("mlp.c_proj", "mlp.down")):
            # c_attn's output is [q | k | v], the same order as our fused qkv.
            plan[ours + our_lin + ".weight"] = ((hf + hf_lin + ".weight",), _conv1d_to_linear)
            plan[ours + our_lin + ".bias"] = ((hf + hf_lin + ".bias",), _same)
    plan["ln_final.weight"] = ((p + "ln_f.weight",), _same)
    plan["ln_final.bias"] = ((p + "ln_f.bias",), _same)
    if not config.tie_embeddings:
        plan["unembed.weight"] = (("lm_head.weight",), _same)
    # Old checkpoints saved the causal mask as buffers attn.bias / attn.masked_bias; a tied model may
    # also carry a copy of wte as lm_head.weight (transformers ties it to wte anyway).
    ignorable = {n for n in hf_names if re.fullmatch(rf"{re.escape(p)}h\.\d+\.attn\.(bias|masked_bias)", n)}
    if config.tie_embeddings:
        ignorable.add("lm_head.weight")
    return plan, ignorable


def _llama_plan(config: ModelConfig, hf_names: set[str]) -> tuple[Plan, set[str]]:
    """The import plan for HF Llama tensors, plus HF names that may be present and are not needed."""
    def fused_qkv(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        q = hf_rows_to_adjacent_pairs(q, config.n_heads)
        k = hf_rows_to_adjacent_pairs(k, config.n_kv_heads)
        return torch.cat([q, k, v], dim=0)  # our fused layout: [q | k | v]

    plan: Plan = {"embed.weight": (("model.embed_tokens.weight",), _same)}
    for i in range(config.n_layers):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        plan[ours + "ln1.weight"] = ((hf + "input_layernorm.weight",), _same)
        plan[ours + "attn.qkv.weight"] = (tuple(hf + f"self_attn.{x}_proj.weight" for x in "qkv"), fused_qkv)
        plan[ours + "attn.out.weight"] = ((hf + "self_attn.o_proj.weight",), _same)
        plan[ours + "ln2.weight"] = ((hf + "post_attention_layernorm.weight",), _same)
        for proj in ("gate", "up", "down"):
            plan[ours + f"mlp.{proj}.weight"] = ((hf + f"mlp.{proj}_proj.weight",), _same)
    plan["ln_final.weight"] = (("model.norm.weight",), _same)
    if not config.tie_embeddings:
        plan["unembed.weight"] = (("lm_head.weight",), _same)
    ignorable = {n for n in hf_names if n.endswith("rotary_emb.inv_freq")}  # recomputed from the config
    if config.tie_embeddings:
        ignorable.add("lm_head.weight")
    return plan, ignorable


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
    """A glasslm model (eval mode) with the weights of the HF GPT-2 or Llama model in `directory`.

    `dtype` converts the weights (default: keep the checkpoint's); `context_length` overrides a
    Llama's max_position_embeddings.
    """
    config, family = config_from_hf(read_hf_config(directory), context_length)
    source = TensorSource.from_directory(directory)
    names = source.names()
    plan, ignorable = (_gpt2_plan if family == "gpt2" else _llama_plan)(config, names)
    needed = {hf_name for hf_names, _ in plan.values() for hf_name in hf_names}
    missing, unexpected = sorted(needed - names), sorted(names - needed - ignorable)
    if missing or unexpected:
        raise ValueError(
            f"{source.source} does not match a {family} model with this config.json: "
            f"missing tensors {missing[:8]}, unexpected tensors {unexpected[:8]}"
        )
    makers = {ours: (lambda hf_names=hf_names, convert=convert: convert(*map(source.get, hf_names)))
              for ours, (hf_names, convert) in plan.items()}
    return model_from_state_dict(config, makers, device, dtype, source.source)


def hf_state_dict(model: TransformerLM) -> dict[str, Tensor]:
    """The model's weights under HF names and layouts (the inverse of the import mapping)."""
    c, family = model.config, family_of(model.config)
    ours = {name: t.detach() for name, t in model.state_dict().items()}
    out: dict[str, Tensor] = {}
    if family == "gpt2":
        def bias(name: str, size: int) -> Tensor:
            # A bias-free GPT-2-shaped model (e.g. nanoGPT's) exports exact zeros: HF GPT-2 always has biases.
            ref = ours["embed.weight"]
            return ours.get(name, torch.zeros(size, dtype=ref.dtype, device=ref.device))

        p = "transformer."
        out[p + "wte.weight"] = ours["embed.weight"]
        out[p + "wpe.weight"] = ours["pos_embed.weight"]
        for i in range(c.n_layers):
            hf, b = f"{p}h.{i}.", f"blocks.{i}."
            for hf_ln, our_ln in (("ln_1", "ln1"), ("ln_2", "ln2")):
                out[hf + hf_ln + ".weight"] = ours[b + our_ln + ".weight"]
                out[hf + hf_ln + ".bias"] = bias(b + our_ln + ".bias", c.d_model)
            for hf_lin, our_lin in (("attn.c_attn", "attn.qkv"), ("attn.c_proj", "attn.out"),
                                    ("mlp.c_fc", "mlp.up"), ("mlp.c_proj", "mlp.down")):
                weight = ours[b + our_lin + ".weight"]
                out[hf + hf_lin + ".weight"] = weight.t()  # Conv1D layout (d_in, d_out)
                out[hf + hf_lin + ".bias"] = bias(b + our_lin + ".bias", weight.shape[0])
        out[p + "ln_f.weight"] = ours["ln_final.weight"]
        out[p + "ln_f.bias"] = bias("ln_final.bias", c.d_model)
    else:
        out["model.embed_tokens.weight"] = ours["embed.weight"]
        q_size, kv_size = c.n_heads * c.d_head, c.n_kv_heads * c.d_head
        for i in range(c.n_layers):
            hf, b = f"model.layers.{i}.", f"blocks.{i}."
            out[hf + "input_layernorm.weight"] = ours[b + "ln1.weight"]
            q, k, v = ours[b + "attn.qkv.weight"].split([q_size, kv_size, kv_size], dim=0)
            out[hf + "self_attn.q_proj.weight"] = adjacent_pairs_to_hf_rows(q, c.n_heads)
            out[hf + "self_attn.k_proj.weight"] = adjacent_pairs_to_hf_rows(k, c.n_kv_heads)
            out[hf + "self_attn.v_proj.weight"] = v
            out[hf + "self_attn.o_proj.weight"] = ours[b + "attn.out.weight"]
            out[hf + "post_attention_layernorm.weight"] = ours[b + "ln2.weight"]
            for proj in ("gate", "up", "down"):
                out[hf + f"mlp.{proj}_proj.weight"] = ours[b + f"mlp.{proj}.weight"]
        out["model.norm.weight"] = ours["ln_final.weight"]
    if not c.tie_embeddings:
        # A tied model saves only the embedding; transformers re-ties lm_head to it on load.
        out["lm_head.weight"] = ours["unembed.weight"]
    return out


def export_hf(model: TransformerLM, directory: str | os.PathLike, tokenizer: Any | None = None) -> Path:
    """Write `model` as an HF directory (config.json + model.safetensors) that transformers loads.

    Raises UnsupportedModelError for architectures outside the GPT-2 and Llama families.
    A byte-level BPE `tokenizer` is saved alongside as GPT-2-format vocab.json + merges.txt.
    """
    from safetensors.torch import save_file

    config_dict = config_to_hf(model.config, model.embed.weight.dtype)
    # safetensors wants contiguous CPU tensors that share no memory with each other.
    weights = {name: t.contiguous().cpu().clone() for name, t in hf_state_dict(model).items()}
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / SAFETENSORS_FILE), metadata={"format": "pt"})
    (path / HF_CONFIG_FILE).write_text(json.dumps(config_dict, indent=2))
    if tokenizer is not None and getattr(tokenizer, "kind", None) == "bpe":
        tokenizer.save(path)
    return path


# --- tokenizers and one loader for both kinds of directory ---------------------------------------

def hf_tokenizer(directory: str | os.PathLike) -> Any | None:
    """A glasslm byte-level BPE tokenizer from GPT-2-format `vocab.json` + `merges.txt`, if present."""
    from .tokenizers import BPETokenizer

    path = Path(directory)
    vocab, merges = path / "vocab.json", path / "merges.txt"
    if not (vocab.is_file() and merges.is_file()):
        return None
    return BPETokenizer.from_gpt2_files(vocab, merges)


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
    """(model in eval mode, tokenizer or None) from a glasslm checkpoint, run directory or HF model directory.

    Either way the weights are memory-mapped and assigned into a meta-device model, so loading a
    large model needs about one copy of its weights in memory.
    """
    from .checkpoint import load_checkpoint

    if is_hf_directory(path):
        return import_hf(path, device, dtype), hf_tokenizer(path)
    model, tokenizer, _ = load_checkpoint(path, device)  # a run directory means its best (else latest)
    return (model if dtype is None else model.to(dtype)), tokenizer
