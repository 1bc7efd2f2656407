"""Load checkpoints saved by other people's code: nanoGPT, TransformerLens / ARENA, CS336 and the seeds.

Each format maps a foreign state dict onto a `TransformerLM` whose config is read from the
tensors' shapes (and, for nanoGPT, its `model_args`). Nothing is unpickled: `.pt` files are read
with `torch.load(weights_only=True)`, which only rebuilds tensors and plain containers.

| format | written by | keys look like |
|---|---|---|
| `nanogpt` | nanoGPT's train.py (`ckpt.pt`) | `model_args`, `model` -> `transformer.h.0.attn.c_attn.weight` |
| `transformerlens` | TransformerLens / ARENA (seed 000) | `blocks.0.attn.W_Q` (n_heads, d_model, d_head), `unembed.b_U` |
| `cs336` | CS336 assignment 1 (seed 003) | `layers.0.attn.q_proj.weight`, `ffn.w1.weight`, `lm_head.weight` |
| `seed001` | "Transformers in a Nutshell" (Lightning) | `blocks.0.attn.W_Q.weight`, `blocks.0.mlp.res_proj.weight` |
| `seed002` | the decoder-only "Vaswani" tutorial | `decoder.layers.0.self_attention_block.w_q.weight` |
| `seed004` | tiny-transformer | `stack.blocks.0.n_heads.multihead.0.key.weight` |

Some formats do not record the number of heads (it never changes a tensor's shape); pass
`n_heads=` then. Any other ModelConfig field may be overridden the same way.

Example:
    >>> FORMATS["cs336"].preset
    'cs336-lm'
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from glasslm.core.config import ModelConfig
from glasslm.presets import get_preset
from glasslm.core.model import TransformerLM

StateDict = dict[str, Tensor]


class FormatError(ValueError):
    """A file that is not (or not entirely) the checkpoint format it was said to be."""


def read_state_dict(path: str | Path) -> tuple[StateDict, dict[str, Any]]:
    """The tensors of a foreign checkpoint file, and its other top-level entries.

    Accepts a bare state dict, nanoGPT's / CS336's {"model": ...}, and Lightning's {"state_dict": ...}
    (whose "model." prefix is removed); `torch.compile`'s "_orig_mod." prefixes are removed too.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint file at {path}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        data: Any = load_file(path)
    else:
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise FormatError(f"{path} cannot be read as tensors without running pickled code: {first}") from None
    if not isinstance(data, dict):
        raise FormatError(f"{path} holds a {type(data).__name__}, not a state dict")
    extra: dict[str, Any] = {}
    prefix = ""
    for key in ("model", "state_dict"):
        if isinstance(data.get(key), dict):
            extra = {k: v for k, v in data.items() if k != key}
            prefix = "model." if key == "state_dict" else ""  # LightningModule wraps the model as self.model
            data = data[key]
            break
    tensors = {}
    for name, value in data.items():
        if not isinstance(value, Tensor):
            continue
        name = name.replace("_orig_mod.", "")
        if prefix and name.startswith(prefix):
            name = name[len(prefix):]
        tensors[name] = value
    if not tensors:
        raise FormatError(f"{path} holds no tensors")
    return tensors, extra


class _Take:
    """Hands out a state dict's tensors by name and remembers which were used, to name leftovers."""

    def __init__(self, tensors: StateDict, fmt: str, ignore: str = r"$^"):
        self.tensors, self.fmt, self.used = tensors, fmt, set()
        self.ignore = re.compile(ignore)

    def __call__(self, name: str) -> Tensor:
        if name not in self.tensors:
            raise FormatError(f"not a {self.fmt} checkpoint: no tensor {name!r}")
        self.used.add(name)
        return self.tensors[name].detach().to(torch.float32)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def count(self, pattern: str) -> int:
        """How many distinct integers fill `{}` in pattern across the keys (layers, heads)."""
        regex = re.compile(re.escape(pattern).replace(r"\{\}", r"(\d+)"))
        return len({m.group(1) for m in map(regex.match, self.tensors) if m})

    def check_all_used(self) -> None:
        left = sorted(n for n in self.tensors if n not in self.used and not self.ignore.search(n))
        if left:
            raise FormatError(f"{len(left)} tensors of this {self.fmt} checkpoint have no place in the model: "
                              f"{', '.join(left[:5])}{' ...' if len(left) > 5 else ''}")


def _need_heads(overrides: dict[str, Any], fmt: str) -> int:
    if "n_heads" not in overrides:
        raise FormatError(f"{fmt} checkpoints do not record the number of heads; pass n_heads (--n-heads)")
    return overrides["n_heads"]


# Each reader: (tensors, extra, overrides) -> (config fields, our state dict, the _Take that checks leftovers).
Reader = Callable[[_Take, dict[str, Any], dict[str, Any]], tuple[dict[str, Any], StateDict]]


def _ln(take: _Take, ours: str, theirs: str, w: str = "weight", b: str | None = "bias") -> StateDict:
    out = {f"{ours}.weight": take(f"{theirs}.{w}")}
    if b is not None and take.has(f"{theirs}.{b}"):
        out[f"{ours}.bias"] = take(f"{theirs}.{b}")
    return out


def _linear(take: _Take, ours: str, theirs: str) -> StateDict:
    out = {f"{ours}.weight": take(f"{theirs}.weight")}
    if take.has(f"{theirs}.bias"):
        out[f"{ours}.bias"] = take(f"{theirs}.bias")
    return out


def _nanogpt(take: _Take, extra: dict[str, Any], overrides: dict[str, Any]) -> tuple[dict[str, Any], StateDict]:
    args = extra.get("model_args")
    if not isinstance(args, dict):
        raise FormatError("not a nanoGPT ckpt.pt: no model_args entry")
    n_layers = args["n_layer"]
    fields = dict(vocab_size=args["vocab_size"], context_length=args["block_size"], d_model=args["n_embd"],
                  n_layers=n_layers, n_heads=args["n_head"], bias=bool(args.get("bias", True)))
    sd = {"embed.weight": take("transformer.wte.weight"), "pos_embed.weight": take("transformer.wpe.weight")}
    for i in range(n_layers):
        t, o = f"transformer.h.{i}", f"blocks.{i}"
        sd |= _ln(take, f"{o}.ln1", f"{t}.ln_1") | _ln(take, f"{o}.ln2", f"{t}.ln_2")
        sd |= _linear(take, f"{o}.attn.qkv", f"{t}.attn.c_attn") | _linear(take, f"{o}.attn.out", f"{t}.attn.c_proj")
        sd |= _linear(take, f"{o}.mlp.up", f"{t}.mlp.c_fc") | _linear(take, f"{o}.mlp.down", f"{t}.mlp.c_proj")
    sd |= _ln(take, "ln_final", "transformer.ln_f")
    # nanoGPT ties lm_head to wte; its state dict holds the same matrix under both names.
    head = take("lm_head.weight")
    fields["tie_embeddings"] = torch.equal(head, sd["embed.weight"])
    if not fields["tie_embeddings"]:
        sd["unembed.weight"] = head
    return fields, sd


def _transformerlens(take: _Take, extra: dict[str, Any], overrides: dict[str, Any]) -> tuple[dict[str, Any], StateDict]:
    n_layers = take.count("blocks.{}.attn.W_Q")
    W_E, W_pos = take("embed.W_E"), take("pos_embed.W_pos")
    n_heads, d_model, d_head = take.tensors["blocks.0.attn.W_Q"].shape
    fields = dict(vocab_size=W_E.shape[0], context_length=W_pos.shape[0], d_model=d_model, n_layers=n_layers,
                  n_heads=n_heads, d_head=d_head, d_mlp=take.tensors["blocks.0.mlp.W_in"].shape[1],
                  tie_embeddings=False, unembed_bias=take.has("unembed.b_U"),
                  bias=take.has("blocks.0.attn.b_O"), attn_qkv_bias=take.has("blocks.0.attn.b_Q"),
                  mlp_bias=take.has("blocks.0.mlp.b_in"), norm_bias=take.has("blocks.0.ln1.b"))
    sd = {"embed.weight": W_E, "pos_embed.weight": W_pos}
    for i in range(n_layers):
        t, o = f"blocks.{i}", f"blocks.{i}"
        sd |= _ln(take, f"{o}.ln1", f"{t}.ln1", "w", "b") | _ln(take, f"{o}.ln2", f"{t}.ln2", "w", "b")
        # W_Q[h] maps d_model -> d_head as x @ W_Q[h]; our rows are each head's output features in turn.
        rows = lambda W: W.permute(0, 2, 1).reshape(n_heads * d_head, d_model)  # noqa: E731
        sd[f"{o}.attn.qkv.weight"] = torch.cat([rows(take(f"{t}.attn.W_{x}")) for x in "QKV"])
        if fields["attn_qkv_bias"]:
            sd[f"{o}.attn.qkv.bias"] = torch.cat([take(f"{t}.attn.b_{x}").reshape(-1) for x in "QKV"])
        sd[f"{o}.attn.out.weight"] = take(f"{t}.attn.W_O").reshape(n_heads * d_head, d_model).T
        if fields["bias"]:
            sd[f"{o}.attn.out.bias"] = take(f"{t}.attn.b_O")
        sd[f"{o}.mlp.up.weight"], sd[f"{o}.mlp.down.weight"] = take(f"{t}.mlp.W_in").T, take(f"{t}.mlp.W_out").T
        if fields["mlp_bias"]:
            sd[f"{o}.mlp.up.bias"], sd[f"{o}.mlp.down.bias"] = take(f"{t}.mlp.b_in"), take(f"{t}.mlp.b_out")
    sd |= _ln(take, "ln_final", "ln_final", "w", "b")
    sd["unembed.weight"] = take("unembed.W_U").T
    if fields["unembed_bias"]:
        sd["unembed_bias"] = take("unembed.b_U")
    return fields, sd


def _cs336(take: _Take, extra: dict[str, Any], overrides: dict[str, Any]) -> tuple[dict[str, Any], StateDict]:
    n_layers = take.count("layers.{}.attn.q_proj.weight")
    embed = take("token_embeddings.weight")
    fields = dict(vocab_size=embed.shape[0], d_model=embed.shape[1], n_layers=n_layers,
                  n_heads=_need_heads(overrides, "cs336"), d_mlp=take.tensors["layers.0.ffn.w1.weight"].shape[0])
    sd = {"embed.weight": embed}
    for i in range(n_layers):
        t, o = f"layers.{i}", f"blocks.{i}"
        sd[f"{o}.ln1.weight"], sd[f"{o}.ln2.weight"] = take(f"{t}.ln1.weight"), take(f"{t}.ln2.weight")
        sd[f"{o}.attn.qkv.weight"] = torch.cat([take(f"{t}.attn.{x}_proj.weight") for x in "qkv"])
        sd[f"{o}.attn.out.weight"] = take(f"{t}.attn.output_proj.weight")
        # SwiGLU: w2(silu(w1 x) * w3 x); ours is down(silu(gate x) * up x).
        sd[f"{o}.mlp.gate.weight"], sd[f"{o}.mlp.up.weight"] = take(f"{t}.ffn.w1.weight"), take(f"{t}.ffn.w3.weight")
        sd[f"{o}.mlp.down.weight"] = take(f"{t}.ffn.w2.weight")
    sd["ln_final.weight"], sd["unembed.weight"] = take("ln_final.weight"), take("lm_head.weight")
    return fields, sd


def _seed001(take: _Take, extra: dict[str, Any], overrides: dict[str, Any]) -> tuple[dict[str, Any], StateDict]:
    n_layers = take.count("blocks.{}.attn.W_Q.weight")
    embed, pos = take("tok_emb.weight"), take("pos_emb.weight")
    fields = dict(vocab_size=embed.shape[0], context_length=pos.shape[0], d_model=embed.shape[1],
                  n_layers=n_layers, n_heads=_need_heads(overrides, "seed001"),
                  d_mlp=take.tensors["blocks.0.mlp.hidden.weight"].shape[0])
    sd = {"embed.weight": embed, "pos_embed.weight": pos}
    for i in range(n_layers):
        t, o = f"blocks.{i}", f"blocks.{i}"
        sd |= _ln(take, f"{o}.ln1", f"{t}.ln1") | _ln(take, f"{o}.ln2", f"{t}.ln2")
        sd[f"{o}.attn.qkv.weight"] = torch.cat([take(f"{t}.attn.W_{x}.weight") for x in "QKV"])
        sd[f"{o}.attn.out.weight"] = take(f"{t}.attn.res_proj.weight")
        sd |= _linear(take, f"{o}.mlp.up", f"{t}.mlp.hidden") | _linear(take, f"{o}.mlp.down", f"{t}.mlp.res_proj")
    sd |= _ln(take, "ln_final", "ln")
    sd["unembed.weight"] = take("head.weight")
    return fields, sd


def _seed002(take: _Take, extra: dict[str, Any], overrides: dict[str, Any]) -> tuple[dict[str, Any], StateDict]:
    layer = "decoder.layers.{}"
    n_layers = take.count(layer + ".self_attention_block.w_q.weight")
    embed = take("word_embedding.embedding.weight")
    fields = dict(vocab_size=embed.shape[0], d_model=embed.shape[1], n_layers=n_layers,
                  n_heads=_need_heads(overrides, "seed002"),
                  d_mlp=take.tensors["decoder.layers.0.feed_forward_block.linear_1.weight"].shape[0])
    if take.has("position_embedding.pe"):  # the sinusoid table buffer: its length is the context
        fields["context_length"] = take.tensors["position_embedding.pe"].shape[-2]
        take.used.add("position_embedding.pe")  # recomputed, not loaded
    sd = {"embed.weight": embed}
    for i in range(n_layers):
        t, o = layer.format(i), f"blocks.{i}"
        attn, ffn = f"{t}.self_attention_block", f"{t}.feed_forward_block"
        sd |= _ln(take, f"{o}.ln1", f"{t}.residual_connections.0.norm", "alpha")
        sd |= _ln(take, f"{o}.ln2", f"{t}.residual_connections.1.norm", "alpha")
        sd[f"{o}.attn.qkv.weight"] = torch.cat([take(f"{attn}.w_{x}.weight") for x in "qkv"])
        sd[f"{o}.attn.out.weight"] = take(f"{attn}.w_o.weight")
        sd |= _linear(take, f"{o}.mlp.up", f"{ffn}.linear_1") | _linear(take, f"{o}.mlp.down", f"{ffn}.linear_2")
    sd |= _ln(take, "ln_final", "decoder.norm", "alpha")
    sd["unembed.weight"], sd["unembed_bias"] = take("projection_layer.proj.weight"), take("projection_layer.proj.bias")
    return fields, sd


def _seed004(take: _Take, extra: dict[str, Any], overrides: dict[str, Any]) -> tuple[dict[str, Any], StateDict]:
    block = "stack.blocks.{}"
    n_layers = take.count(block + ".ln1.weight")
    n_heads = take.count("stack.blocks.0.n_heads.multihead.{}.key.weight")
    embed, pos = take("stack.tok_embs.weight"), take("stack.pos_embs.weight")
    fields = dict(vocab_size=embed.shape[0], context_length=pos.shape[0], d_model=embed.shape[1],
                  n_layers=n_layers, n_heads=n_heads, d_head=take.tensors["stack.blocks.0.n_heads.multihead.0.key.weight"].shape[0],
                  d_mlp=take.tensors["stack.blocks.0.ffn.0.weight"].shape[0])
    sd = {"embed.weight": embed, "pos_embed.weight": pos}
    for i in range(n_layers):
        t, o = block.format(i), f"blocks.{i}"
        heads = f"{t}.n_heads.multihead"
        sd |= _ln(take, f"{o}.ln1", f"{t}.ln1") | _ln(take, f"{o}.ln2", f"{t}.ln2")
        # Each head has its own query/key/value Linear; ours stacks all queries, then keys, then values.
        sd[f"{o}.attn.qkv.weight"] = torch.cat(
            [take(f"{heads}.{h}.{x}.weight") for x in ("query", "key", "value") for h in range(n_heads)])
        sd |= _linear(take, f"{o}.attn.out", f"{t}.n_heads.output_linear")
        sd |= _linear(take, f"{o}.mlp.up", f"{t}.ffn.0") | _linear(take, f"{o}.mlp.down", f"{t}.ffn.2")
    sd |= _ln(take, "ln_final", "stack.ln")
    sd["unembed.weight"], sd["unembed_bias"] = take("stack.lm_head.weight"), take("stack.lm_head.bias")
    return fields, sd


@dataclass(frozen=True)
class Format:
    reader: Reader
    preset: str | None  # the glasslm preset whose architecture the format has (sizes come from the file)
    ignore: str  # buffers the foreign code saves that are not weights (causal masks, index tables)
    about: str


FORMATS: dict[str, Format] = {
    "nanogpt": Format(_nanogpt, None, r"\.attn\.bias$", "nanoGPT's ckpt.pt (model_args + model)"),
    "transformerlens": Format(_transformerlens, "arena-gpt2", r"\.(IGNORE|mask|EPSILON)$",
                              "TransformerLens / ARENA state dict (seed 000)"),
    "cs336": Format(_cs336, "cs336-lm", r"$^", "CS336 assignment 1 TransformerLM state dict (seed 003)"),
    "seed001": Format(_seed001, "lightning-char-gpt", r"(\.mask|^pos_idxs)$",
                      "'Transformers in a Nutshell' GPT (seed 001), a state dict or a Lightning checkpoint"),
    "seed002": Format(_seed002, "aiayn-decoder-prenorm", r"$^", "decoder-only Vaswani tutorial model (seed 002)"),
    "seed004": Format(_seed004, "tiny-transformer", r"\.tril$", "tiny-transformer state dict (seed 004)"),
}


def load_foreign(path: str | Path, fmt: str, **overrides: Any) -> TransformerLM:
    """A TransformerLM holding the weights of a checkpoint saved by another codebase, in eval mode.

    `fmt` is a key of FORMATS; `overrides` set ModelConfig fields the file does not record
    (n_heads for cs336/seed001/seed002, context_length for cs336, ...).
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
    spec = FORMATS[fmt]
    tensors, extra = read_state_dict(path)
    take = _Take(tensors, fmt, spec.ignore)
    try:
        fields, state = spec.reader(take, extra, overrides)
    except KeyError as err:
        raise FormatError(f"not a {fmt} checkpoint: missing {err}") from None
    take.check_all_used()
    base = get_preset(spec.preset) if spec.preset else get_preset("gpt2-small", activation="gelu")
    config = ModelConfig.from_dict({**base.to_dict(), "d_head": None, "d_mlp": None, "n_kv_heads": None,
                                    **fields, **overrides}, where=fmt)
    model = TransformerLM(config)
    ours = dict(model.named_parameters())  # weights only: position/rotary tables are recomputed
    missing = sorted(set(ours) - set(state))
    if missing:
        raise FormatError(f"this {fmt} checkpoint lacks {', '.join(missing[:5])} for its config")
    for name, tensor in state.items():
        if name not in ours or ours[name].shape != tensor.shape:
            got = tuple(tensor.shape)
            want = tuple(ours[name].shape) if name in ours else "no such tensor"
            raise FormatError(f"{fmt}: {name} has shape {got}, the model expects {want} "
                              "(is n_heads right?)")
    model.load_state_dict(state, strict=False)  # strict would also ask for the recomputed buffers
    return model.eval()
