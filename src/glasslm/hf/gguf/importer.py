"""A GGUF file as a glasslm model: `import_gguf(path)`.

The file's architecture picks the family (`family_reading_gguf`), whose GGUF form turns the
metadata into a config.json and whose weight table — the same one Hugging Face directories are
read with — turns the tensors into ours, after the form has undone llama.cpp's tensor changes.

Tensors in a block format glasslm runs (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16) stay
in their blocks when they are Linear weights and nothing between the file and the model does more than
reorder their rows or take some of them: we find that out by sending each source row's number through
the same steps (a column of row numbers must come out as a permutation of them; a transpose or any
arithmetic shows up). Those layers become `BlockLinear`s, recorded as the `q4_0` ... `bf16` transforms.
Where a fused layer's sources come in different formats (a mixed Q4_K_M file's attn_q, attn_k and
attn_v), the layer is first split into parts by source (`row_split`) and each part keeps its own. The
token table stays in its blocks too (`BlockEmbedding`, a lookup decodes the rows it reads); a file
without an output matrix unembeds with its token embedding, as llama.cpp does, one copy of the blocks
serving both. Every other tensor (norms, biases, formats glasslm has no kernel for such as Q2_K, Q3_K
and the IQ kinds) is dequantized to float32 by the gguf package.
`GGUFImport.summary()` says which went which way.

Example:
    >>> import tempfile
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.presets import get_preset
    >>> from glasslm.hf.gguf.exporter import export_gguf
    >>> model = TransformerLM(get_preset("llama-tiny")).eval()
    >>> path = export_gguf(model, tempfile.mkdtemp() + "/tiny.gguf", None, "q4_0")
    >>> loaded = import_gguf(path)
    >>> loaded.family, type(loaded.model.blocks[0].mlp.up).__name__
    ('llama', 'BlockLinear')
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from glasslm.core.config import ModelConfig
from glasslm.core.layers import Linear
from glasslm.core.model import TransformerLM
from glasslm.hf.errors import UnsupportedModelError
from glasslm.hf.families import FAMILIES, HFFamily, family_reading_gguf
from glasslm.hf.gguf.reader import GGUFFile
from glasslm.hf.gguf.rope_factors import llama3_from_factors
from glasslm.hf.gguf.values import checked_values, rotary_table_problem
from glasslm.hf.plan import WeightTable
from glasslm.io.build import empty_model, model_from_state_dict
from glasslm.runtime import loading_threads
from glasslm.transforms import parameter_count
from glasslm.transforms.ggml import EMBED, LAYER_FORMATS, UNEMBED, keeps_as_loaded, packs_as_loaded

EMBEDDING, OUTPUT, ROPE_FREQS = "token_embd.weight", "output.weight", "rope_freqs.weight"
_EXPERT_PROJECTIONS = (".mlp.gate", ".mlp.up", ".mlp.down")  # MoE's stacked expert parameters


@dataclasses.dataclass
class GGUFImport:
    """A model read from a GGUF file, its tokenizer, and how its tensors came in."""

    model: TransformerLM
    tokenizer: Any
    family: str
    kept: Counter  # ggml type -> tensors kept in their blocks
    dequantized: Counter  # ggml type -> tensors held as float32 (dequantized, or f32 as stored)

    def summary(self) -> str:
        """One line: the family, parameters, and which tensors were kept and dequantized (a float32
        tensor of the file, a norm's weight say, is read as it is: counted apart, not as dequantized).

        >>> import collections
        >>> GGUFImport(None, None, "llama", collections.Counter({"q4_1": 210}),
        ...            collections.Counter({"f32": 61, "q8_0": 1})).summary().split("; ", 1)[1]
        'kept in their blocks: 210 q4_1; float32 as stored: 61 f32; dequantized to float32: 1 q8_0'
        """
        params = f"{parameter_count(self.model):,} parameters" if self.model is not None else "model"
        return f"{self.family} ({params}); {_storage(self.kept, self.dequantized)}"


def _storage(kept: Counter, dequantized: Counter) -> str:
    def counts(c: Counter) -> str:
        return ", ".join(f"{n} {qtype}" for qtype, n in sorted(c.items())) or "none"

    converted = Counter({qtype: n for qtype, n in dequantized.items() if qtype != "f32"})
    stored = f"float32 as stored: {dequantized['f32']} f32; " if dequantized["f32"] else ""
    return f"kept in their blocks: {counts(kept)}; {stored}dequantized to float32: {counts(converted)}"


def gguf_storage(path: str | os.PathLike) -> str:
    """How `import_gguf` would hold the file's tensors (the count of each ggml type kept in its
    blocks, and of each dequantized to float32), from the header alone: no tensor is read."""
    file = GGUFFile.open(path)
    config, family, hf = gguf_config(file)
    table = family.gguf_weight_table(config)
    reading = _Reading(file, family, hf, gguf_tensor_names(file, family, config, table))
    _, _, kept, dequantized = _plan_tensors(reading, table, _meta_layout(config)[1], keep_blocks=True)
    return _storage(kept, dequantized)


def gguf_family(file: GGUFFile) -> HFFamily:
    experts = bool(file.metadata.get(f"{file.arch}.expert_count"))
    family = family_reading_gguf(file.arch, experts)
    if family is None:
        known = sorted({f.gguf.arch + (" with experts" if f.gguf.experts else "") for f in FAMILIES.values() if f.gguf})
        raise UnsupportedModelError(f"{file.path}: GGUF architecture {file.arch!r}{' with experts' * experts} is not "
                                    f"supported (glasslm reads {', '.join(known)})")
    return family


def gguf_hf_config(file: GGUFFile, family: HFFamily, context_given: bool = False) -> dict[str, Any]:
    """The config.json the file's metadata and tensors describe (its metadata checked first:
    `values.checked_values`; `context_given`: the caller replaces the file's context length)."""
    prefix = file.arch + "."
    values = {key[len(prefix):]: value for key, value in file.metadata.items() if key.startswith(prefix)}
    names = file.tensor_names()
    values = checked_values(file.arch, values, len(names), context_given)
    hf = {"model_type": family.name, **family.gguf.hf_config(values, names)}
    if ROPE_FREQS in names and _reads_rope_freqs(file.arch):
        hf = _with_rope_factors(file, hf, values)
    hf["vocab_size"] = file.shape(EMBEDDING)[0]  # the tensor's rows are the truth (the key is optional)
    hf["tie_word_embeddings"] = _tied(file)
    return hf


def _reads_rope_freqs(arch: str) -> bool:
    """Whether llama.cpp's `arch` reads per-pair RoPE divisors (rope_freqs), by the gguf package's list."""
    import gguf

    kind = {name: kind for kind, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    return gguf.MODEL_TENSOR.ROPE_FREQS in gguf.MODEL_TENSORS.get(kind, ())


def _with_rope_factors(file: GGUFFile, hf: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """config.json with the Llama 3 rope scaling whose divisors the file's rope_freqs tensor holds
    (`rope_factors.llama3_from_factors`), checked against the frequencies its metadata states."""
    stated = hf.get("rope_scaling", {}).get("rope_type")
    if stated:
        raise UnsupportedModelError(f"rope_freqs together with rope.scaling.type {stated!r} (llama.cpp applies both) "
                                    "is not supported")
    heads = values["attention.head_count"]
    head_dim = values.get("attention.key_length") or values["embedding_length"] // heads
    rotated = values.get("rope.dimension_count") or head_dim
    if file.shape(ROPE_FREQS) != (rotated // 2,):
        raise ValueError(f"rope_freqs.weight has shape {file.shape(ROPE_FREQS)}; {rotated} rotated dims need "
                         f"({rotated // 2},)")
    theta = float(values.get("rope.freq_base", 10000.0))
    params = llama3_from_factors(file.dequantized(ROPE_FREQS), theta,
                                 values.get("rope.scaling.original_context_length"))
    return {**hf, "rope_scaling": {**hf.get("rope_scaling", {}), **params}} if params else hf


def gguf_config(file: GGUFFile, context_length: int | None = None) -> tuple[ModelConfig, HFFamily, dict[str, Any]]:
    """(config, family, config.json as a dict) of a GGUF file, without reading its weights; the
    metadata checked for type and range, and the tensors' shapes against what it describes. Anything
    wrong is a ValueError naming the file and the key or tensor."""
    family = gguf_family(file)
    try:
        hf = gguf_hf_config(file, family, context_length is not None)
        config = family.config_from_hf(hf, context_length)
        problem = rotary_table_problem(config.context_length, config.rotary_dims or config.d_head)
        if config.positional == "rope" and problem is not None:
            raise ValueError(problem)
    except ValueError as err:
        raise type(err)(f"{file.path}: {err}") from None
    check_tensor_shapes(file, family, config, hf)
    return config, family, hf


_JOINS = {torch.cat, torch.concat, torch.concatenate}
_ELEMENTWISE = {torch.add, torch.sub, torch.mul, torch.div, Tensor.add, Tensor.sub, Tensor.mul, Tensor.div,
                Tensor.__add__, Tensor.__radd__, Tensor.__sub__, Tensor.__rsub__, Tensor.__mul__, Tensor.__rmul__,
                Tensor.__truediv__, Tensor.__neg__}


class _MetaShapes(TorchFunctionMode):
    """Shapes of joins and arithmetic on meta tensors, worked out here: PyTorch computes them through
    its reference implementations, whose first use imports its compiler (~1 s at every load of a
    file). Every other op runs as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _JOINS or func is torch.stack:
            parts, dim = args[0], kwargs.get("dim", args[1] if len(args) > 1 else 0)
            if all(isinstance(t, Tensor) and t.is_meta for t in parts):
                return torch.empty(_joined_shape([tuple(t.shape) for t in parts], dim, func is torch.stack),
                                   dtype=parts[0].dtype, device="meta")
        if func in _ELEMENTWISE:
            tensors = [a for a in args if isinstance(a, Tensor)]
            if tensors and all(t.is_meta for t in tensors):
                return torch.empty(torch.broadcast_shapes(*(t.shape for t in tensors)), dtype=tensors[0].dtype,
                                   device="meta")
        return func(*args, **kwargs)


def _joined_shape(shapes: list[tuple[int, ...]], dim: int, stacked: bool) -> tuple[int, ...]:
    """The shape torch.cat (or torch.stack) gives parts of `shapes` along `dim`; RuntimeError if they do not fit."""
    first = shapes[0]
    if any(len(s) != len(first) for s in shapes) or (not stacked and not first):
        raise RuntimeError("parts of different ranks")
    dim = dim % (len(first) + stacked)
    if stacked:
        if any(s != first for s in shapes):
            raise RuntimeError("stacked parts differ in shape")
        return first[:dim] + (len(shapes),) + first[dim:]
    if any(s[:dim] + s[dim + 1:] != first[:dim] + first[dim + 1:] for s in shapes):
        raise RuntimeError("joined parts differ off the joining dimension")
    return first[:dim] + (sum(s[dim] for s in shapes),) + first[dim + 1:]


_LAYOUTS: dict[str, tuple[dict[str, torch.Size], set[str]]] = {}


def _meta_layout(config: ModelConfig) -> tuple[dict[str, torch.Size], set[str]]:
    """(each tensor's shape, the Linear layers' names) of the model `config` describes: built once on
    the meta device for the shape check and the loading plan (the last config's kept)."""
    key = repr(config)
    if key not in _LAYOUTS:
        model = empty_model(config)
        _LAYOUTS.clear()
        _LAYOUTS[key] = ({name: t.shape for name, t in model.state_dict().items()},
                         {name for name, m in model.named_modules() if isinstance(m, Linear)})
    return _LAYOUTS[key]


def check_tensor_shapes(file: GGUFFile, family: HFFamily, config: ModelConfig, hf: dict[str, Any]) -> None:
    """Every tensor the model reads has the shape the metadata describes, found without reading a
    byte of them: the file's shapes go through the same steps as the tensors will, on PyTorch's meta
    device. ValueError naming the tensor and both shapes (a file whose metadata and tensors disagree
    is refused before anything is allocated)."""
    table = family.gguf_weight_table(config)
    names = gguf_tensor_names(file, family, config, table)
    expected = _meta_layout(config)[0]
    for ours, (hf_names, to_ours, _) in table.entries.items():
        try:
            with _MetaShapes():
                sources = [family.gguf.to_hf(n, torch.empty(file.shape(names[n]), device="meta"), hf) for n in hf_names]
                shape = to_ours(*sources).shape
        except RuntimeError:  # the steps themselves do not fit these shapes
            shape = None
        if shape != expected[ours]:
            found = ", ".join(f"{names[n]} {tuple(file.shape(names[n]))}" for n in hf_names)
            raise ValueError(f"{file.path}: the metadata describes a model whose {ours} is {tuple(expected[ours])}, "
                             f"but the file holds {found}")


def _tied(file: GGUFFile) -> bool:
    """Tied when the file has no output matrix (llama.cpp then uses the embedding), or one that is
    byte for byte the embedding (older GPT-2 conversions wrote it twice)."""
    names = file.tensor_names()
    if OUTPUT not in names:
        return True
    return (file.qtype(OUTPUT) == file.qtype(EMBEDDING) and file.shape(OUTPUT) == file.shape(EMBEDDING)
            and torch.equal(file.blocks(OUTPUT), file.blocks(EMBEDDING)))


def gguf_tensor_names(file: GGUFFile, family: HFFamily, config: ModelConfig, table: WeightTable) -> dict[str, str]:
    """HF tensor name -> GGUF tensor name for every tensor the table reads, through the gguf package's
    own name map; refuses a file missing any or holding tensors no part of the model reads."""
    name_map = _tensor_name_map(file.arch, config.n_layers)
    names = {hf_name: name_map.get_name(hf_name, try_suffixes=(".weight", ".bias")) for hf_name in table.hf_names()}
    unmapped = sorted(hf_name for hf_name, gguf_name in names.items() if gguf_name is None)
    if unmapped:
        raise UnsupportedModelError(f"the gguf package has no GGUF name for {unmapped[:4]} ({family.name})")
    have = file.tensor_names()
    missing = sorted(set(names.values()) - have)
    read_apart = ({OUTPUT} if config.tie_embeddings else set()) | ({ROPE_FREQS} if _reads_rope_freqs(file.arch) else set())
    unexpected = sorted(have - set(names.values()) - read_apart)
    if missing or unexpected:
        raise ValueError(f"{file.path} does not match a {family.name} model with its metadata: missing tensors "
                         f"{missing[:8]}, unexpected tensors {unexpected[:8]}")
    return names  # type: ignore[return-value]


@functools.lru_cache(maxsize=4)
def _tensor_name_map(arch: str, n_layers: int) -> Any:
    """The gguf package's name map of `arch` with `n_layers` blocks (made once: the shape check and the
    load both ask, ~10 ms each for a 16-layer Llama)."""
    import gguf

    return gguf.get_tensor_name_map({name: kind for kind, name in gguf.MODEL_ARCH_NAMES.items()}[arch], n_layers)


@dataclasses.dataclass
class _Reading:
    """What reading the tensors needs: the file, its family's form, config.json, and the name map."""

    file: GGUFFile
    family: HFFamily
    hf: dict[str, Any]
    names: dict[str, str]
    device: torch.device | str = "cpu"
    impl: str = "fast"

    def in_place(self, qtype: str, source: str) -> bool:
        """Whether a block layer of `qtype` made from `source` may read the mapped file (it re-lays
        the bytes out as they arrive and keeps no reference to them)."""
        return packs_as_loaded(qtype, self.file.shape(source)[-1], self.device, self.impl)

    def ways(self, qtype: str, source: str) -> tuple[bool, bool]:
        """(in_place, keeps): how `_rows` may read the file for such a layer."""
        return self.in_place(qtype, source), self.keeps(qtype, source)

    def keeps(self, qtype: str, source: str) -> bool:
        """Whether that layer keeps the bytes as they are (float weights): a view of the mapped file
        that lives as long as it does (`GGUFFile.kept_blocks`) is all it needs."""
        return keeps_as_loaded(qtype, self.file.shape(source)[-1], self.device, self.impl)

    def hf_tensor(self, hf_name: str) -> Tensor:
        """An HF tensor in HF's layout, dequantized: llama.cpp's change undone."""
        return self.family.gguf.to_hf(hf_name, self.file.dequantized(self.names[hf_name]), self.hf)

    def row_order(self, hf_names: tuple[str, ...], to_ours: Callable[..., Tensor]) -> Tensor | None:
        """Which source row (counting through the sources in order) each row of our tensor is, if our
        tensor is only some of the sources' rows, each at most once, reordered (Phi-3's gate is the first
        half of its fused gate|up tensor); else None."""
        probes, start = [], 0
        for hf_name in hf_names:
            rows = self.file.shape(self.names[hf_name])[0]
            probe = torch.arange(start, start + rows, dtype=torch.float64)[:, None]   # (rows, 1)
            probes.append(self.family.gguf.to_hf(hf_name, probe, self.hf))
            start += rows
        out = to_ours(*probes)
        if out.dim() != 2 or out.shape[1] != 1 or not 0 < out.shape[0] <= start:
            return None
        order = out[:, 0]
        if not (torch.equal(order, order.round()) and bool(((order >= 0) & (order < start)).all())):
            return None
        rows = order.long()
        # Each row at most once (counted per row: ~20x faster than torch.unique on 8192 rows, 81 layers a load).
        return rows if int(torch.bincount(rows).max()) <= 1 else None


@dataclasses.dataclass
class _Plan:
    """What to load: our name -> tensor maker, the block layers per format, the split layers, and
    which tensors were kept in their blocks or dequantized (per format, for the summary)."""

    tensors: dict[str, Callable[[], Tensor]] = dataclasses.field(default_factory=dict)
    layers: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    splits: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    kept: Counter = dataclasses.field(default_factory=Counter)
    dequantized: Counter = dataclasses.field(default_factory=Counter)
    experts: dict[str, str] = dataclasses.field(default_factory=dict)  # stacked expert projection -> its format

    def keep(self, layer: str, qtype: str, make: Callable[[], Tensor], count: int = 1) -> None:
        self.tensors[layer + ".weight_blocks"] = make
        self.layers.setdefault(qtype, []).append(layer)
        self.kept.update({qtype: count})

    def records(self) -> list[dict[str, Any]]:
        """The transforms that give an empty model this structure: splits first, then each format."""
        split = [{"name": "row_split", "layers": self.splits}] if self.splits else []
        experts = [{"name": "expert_blocks", "qtype": "q8_0", "layers": self.experts}] if self.experts else []
        return split + [{"name": qtype, "layers": sorted(names)} for qtype, names in sorted(self.layers.items())] + experts


def _keep_experts(reading: _Reading, plan: _Plan, ours: str, hf_names: tuple[str, ...],
                  to_ours: Callable[..., Tensor]) -> bool:
    """Plans a stacked expert projection (`blocks.{i}.mlp.gate`: one 3-D file tensor, ffn_gate_exps) kept
    in its file's blocks as an `ExpertBlocks` of n_experts * d_out rows, where the file's format is one the
    layers run and nothing between the file and the model moves a row. False: it is dequantized."""
    if len(hf_names) != 1 or not ours.endswith(_EXPERT_PROJECTIONS):
        return False
    source = reading.names[hf_names[0]]
    file, qtype = reading.file, reading.file.qtype(source)
    shape = file.shape(source)
    if len(shape) != 3 or qtype not in LAYER_FORMATS:
        return False
    probe = torch.arange(shape[0] * shape[1], dtype=torch.float64).reshape(shape[0], shape[1], 1)
    moved = to_ours(reading.family.gguf.to_hf(hf_names[0], probe, reading.hf))
    if moved.shape != probe.shape or not torch.equal(moved, probe):
        return False
    rows = shape[0] * shape[1]

    def make() -> Tensor:
        in_place, keep = reading.ways(qtype, source)
        if in_place and keep:
            return file.kept_blocks(source).reshape(rows, -1)
        return (file.mapped_blocks(source) if in_place else file.blocks(source)).reshape(rows, -1)

    plan.tensors[ours + ".weight_blocks"] = make
    plan.experts[ours] = qtype
    plan.kept.update({f"{qtype} (experts)": 1})
    return True


def _keep_blocks(reading: _Reading, plan: _Plan, layer: str, hf_names: tuple[str, ...],
                 to_ours: Callable[..., Tensor]) -> bool:
    """Plans `layer` kept in its file's blocks, if its rows are some of the sources' rows: as one
    block layer where the sources share a format, else (llama.cpp's mixed files: attn_q / attn_k in
    one format, attn_v in another) as a row split whose parts each keep their source's format,
    provided each source's rows stay within its own part. False: the layer must be dequantized."""
    sources = [reading.names[n] for n in hf_names]
    qtypes = [reading.file.qtype(g) for g in sources]
    order = reading.row_order(hf_names, to_ours) if set(qtypes) <= set(LAYER_FORMATS) else None
    if order is None:
        return False
    file = reading.file
    if len(set(qtypes)) == 1:
        plan.keep(layer, qtypes[0], lambda: _rows(file, sources, order, *reading.ways(qtypes[0], sources[0])),
                   len(sources))
        return True
    if len(order) != sum(file.shape(g)[0] for g in sources):
        return False  # (a selection of rows from sources in several formats: not a file glasslm has met)
    # One part per run of sources in the same format (q and k together, v apart).
    runs = [list(group) for _, group in itertools.groupby(zip(sources, qtypes), key=lambda pair: pair[1])]
    sizes = [sum(file.shape(g)[0] for g, _ in run) for run in runs]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    if any(not torch.equal(order[s:s + n].sort().values, torch.arange(s, s + n)) for s, n in zip(starts, sizes)):
        return False  # rows move between parts: no split keeps them
    plan.splits[layer] = sizes
    for i, (run, start, rows) in enumerate(zip(runs, starts, sizes)):
        names, within = [g for g, _ in run], order[start:start + rows] - start
        ways = reading.ways(run[0][1], names[0])
        plan.keep(f"{layer}.parts.{i}", run[0][1],
                  lambda names=names, within=within, ways=ways: _rows(file, names, within, *ways), len(names))
    return True


def _rows(file: GGUFFile, sources: list[str], order: Tensor, in_place: bool = False, keep: bool = False) -> Tensor:
    """The sources' blocks, one after another, in `order`: copied once, or (`in_place`, for a layer
    that re-lays them out at once; `keep`, for one that keeps them as they are) not at all where one
    source's rows come in the file's order."""
    identity = torch.equal(order, torch.arange(len(order))) and len(order) == sum(file.shape(g)[0] for g in sources)
    if not in_place:
        blocks = file.blocks(sources[0]) if len(sources) == 1 else torch.cat([file.blocks(g) for g in sources])
        return blocks if identity else blocks[order]
    if len(sources) == 1:
        if keep and identity:
            return file.kept_blocks(sources[0])
        view = file.mapped_blocks(sources[0])
        return view if identity else view[order]
    return _gathered_rows(file, sources, None if identity else order)


def _gathered_rows(file: GGUFFile, sources: list[str], order: Tensor | None) -> Tensor:
    """Rows `order` (None: all) of the sources one after another, read from the mapped file in one copy."""
    shapes = [file.blocks_shape(g) for g in sources]
    out = torch.empty(sum(r for r, _ in shapes) if order is None else len(order), shapes[0][1], dtype=torch.uint8)
    start = 0
    for g, (rows, _) in zip(sources, shapes):
        view = file.mapped_blocks(g)
        if order is None:
            out[start:start + rows] = view
        else:  # the rows of `order` that come from this source, into their places
            picked = ((order >= start) & (order < start + rows)).nonzero()[:, 0]
            out[picked] = view[order[picked] - start]
        start += rows
    return out


def _split_biases(plan: _Plan) -> None:
    """A split layer's bias becomes its parts' biases (the same numbers, cut at the parts' rows)."""
    for layer, sizes in plan.splits.items():
        make = plan.tensors.pop(layer + ".bias", None)
        if make is None:
            continue
        for i, start in enumerate(sum(sizes[:i]) for i in range(len(sizes))):
            plan.tensors[f"{layer}.parts.{i}.bias"] = lambda start=start, rows=sizes[i]: make()[start:start + rows]


def _plan_tensors(reading: _Reading, table: WeightTable, linears: set[str], keep_blocks: bool):
    """(our name -> tensor maker, transform records, kept Counter, dequantized Counter)."""
    plan = _Plan()
    for ours, (hf_names, to_ours, _) in table.entries.items():
        layer = ours.removesuffix(".weight")
        if keep_blocks and layer in linears and _keep_blocks(reading, plan, layer, hf_names, to_ours):
            continue
        if keep_blocks and ours == "embed.weight" and _keep_embedding(reading, plan, hf_names, to_ours):
            continue
        if keep_blocks and _keep_experts(reading, plan, ours, hf_names, to_ours):
            continue
        plan.tensors[ours] = lambda hf_names=hf_names, to_ours=to_ours: to_ours(*map(reading.hf_tensor, hf_names))
        plan.dequantized.update(reading.file.qtype(reading.names[n]) for n in hf_names)
    _split_biases(plan)
    return plan.tensors, plan.records(), plan.kept, plan.dequantized


def _keep_embedding(reading: _Reading, plan: _Plan, hf_names: tuple[str, ...], to_ours: Callable[..., Tensor]) -> bool:
    """Plans the token table kept in its file's blocks (a BlockEmbedding, looked up a row at a time),
    where the file holds it in a format the layers run: a model that unembeds with it (no output
    matrix) gets one copy for both, as llama.cpp uses it. False: it is dequantized."""
    qtype = reading.file.qtype(reading.names[hf_names[0]])
    order = reading.row_order(hf_names, to_ours) if len(hf_names) == 1 and qtype in LAYER_FORMATS else None
    if order is None:
        return False
    source = reading.names[hf_names[0]]
    make = lambda: _rows(reading.file, [source], order, *reading.ways(qtype, source))  # noqa: E731
    if reading.hf.get("tie_word_embeddings"):
        plan.keep(UNEMBED, qtype, make)
    else:
        plan.keep(EMBED + ".table", qtype, make)
        plan.layers[qtype].remove(EMBED + ".table")
    plan.layers[qtype].append(EMBED)
    return True


def gguf_tokenizer(file: GGUFFile) -> Any | None:
    """The tokenizer the file's `tokenizer.ggml.*` keys describe (None: it has none); a vocabulary
    glasslm cannot run, or one whose lists are malformed, is a ValueError naming the file."""
    from glasslm.tokenizers.gguf import tokenizer_from_gguf

    if "tokenizer.ggml.tokens" not in file.metadata:
        return None
    try:
        return tokenizer_from_gguf(file.metadata)
    except ValueError as err:
        raise type(err)(f"{file.path}: {err}") from None


def import_gguf(
    path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
    context_length: int | None = None, keep_blocks: bool = True,
) -> GGUFImport:
    """The model (eval mode) and tokenizer in a GGUF file.

    `keep_blocks=False` dequantizes every tensor (a float model, e.g. to fine-tune all weights);
    `dtype` converts the float weights; `context_length` overrides a rotary model's.
    """
    from glasslm.tokenizers import eos_token_ids

    file = GGUFFile.open(path)
    config, family, hf = gguf_config(file, context_length)
    table = family.gguf_weight_table(config)
    reading = _Reading(file, family, hf, gguf_tensor_names(file, family, config, table), device, config.impl)
    linears = _meta_layout(config)[1]
    tensors, records, kept, dequantized = _plan_tensors(reading, table, linears, keep_blocks)
    with loading_threads():  # the kernels' one-time layout of every kept layer, on the free cores
        model = model_from_state_dict(config, tensors, device, dtype, str(path), transforms=records)
    file.drop_mapped()
    tokenizer = gguf_tokenizer(file)
    ends = [file.metadata.get(f"tokenizer.ggml.{role}_token_id") for role in ("eos", "eot", "eom")]
    model.eos_token_ids = eos_token_ids(tokenizer, {"eos_token_id": [i for i in ends if isinstance(i, int)] or None})
    return GGUFImport(model, tokenizer, family.name, kept, dequantized)
