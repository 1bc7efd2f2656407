"""LoRA adapters both ways between glasslm and Hugging Face PEFT.

`export_peft_adapter` writes adapter_config.json + adapter_model.safetensors that
`peft.PeftModel.from_pretrained(<the exported base>, directory)` loads and computes the same with;
`import_peft_adapter` puts a PEFT LoRA adapter trained elsewhere onto a glasslm model of its base.

Both directions go through the family's weight table, so they follow every layout change export
makes: q/k rows reordered for rotary models, q/k/v split into three projections (Llama) or kept
fused (GPT-2's c_attn, a Conv1D stored transposed). An adapter's update B A changes rows the way
its weight's rows change, so B goes through the same conversion as the weight and A stays.
Conversions are found by probing the table's functions with random factors, not by family names.

Example:
    >>> import tempfile
    >>> import torch
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.presets import get_preset
    >>> from glasslm.transforms import apply_transform
    >>> from glasslm.transforms.lora import LoRAConfig
    >>> model = TransformerLM(get_preset("llama-tiny", n_layers=1)).eval()
    >>> apply_transform(model, "lora", LoRAConfig(rank=4, sites=("q", "v")))
    >>> folder = export_peft_adapter(model, tempfile.mkdtemp())
    >>> sorted(p.name for p in folder.iterdir())
    ['adapter_config.json', 'adapter_model.safetensors']
    >>> base = TransformerLM(get_preset("llama-tiny", n_layers=1)).eval()
    >>> import_peft_adapter(base, folder)
    >>> sorted(base.blocks[0].attn.qkv.row_blocks) == sorted(model.blocks[0].attn.qkv.row_blocks)
    True
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from glasslm.hf.families import family_for
from glasslm.transforms import apply_transform
from glasslm.transforms.lora import LoRAConfig, LoRALinear, lora_layers

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# Which glasslm site each adapted module is, by the end of its name (q/k/v: by rows, below).
_SITE_OF = {"attn.out": "attn_out", "mlp.up": "mlp_up", "mlp.gate": "mlp_gate", "mlp.down": "mlp_down",
            "unembed": "unembed"}


@dataclass
class HFAdapter:
    """One adapted HF module: update = scaling * B A (B A transposed for a Conv1D weight)."""

    a: Tensor            # (rank, d_in)
    b: Tensor            # (hf_rows, rank)
    scaling: float
    transposed: bool     # the HF weight is stored (d_in, d_out): PEFT's fan_in_fan_out


def _probe(b: Tensor, d_in: int) -> Tensor:
    """B (rows, rank) as the first columns of a weight-shaped (rows, d_in) matrix: a row-acting
    conversion of the padded matrix converts B alone."""
    padded = b.new_zeros(b.shape[0], d_in)
    padded[:, :b.shape[1]] = b
    return padded


def _orientation(convert: Any, n_rows: int, d_in: int, rank: int) -> list[bool]:
    """For each tensor `convert` makes from a (n_rows, d_in) weight: is it stored transposed?"""
    generator = torch.Generator().manual_seed(0)
    b, a = torch.randn(n_rows, rank, generator=generator), torch.randn(rank, d_in, generator=generator)

    def same(b_part: Tensor, update: Tensor) -> bool:  # is b_part @ a this update (rows of B moved as W's)?
        return b_part.shape[1] == d_in and update.shape[1] == d_in and torch.allclose(b_part[:, :rank] @ a, update,
                                                                                    atol=1e-4)

    orientation = []
    for part, full in zip(convert(_probe(b, d_in)), convert(b @ a)):
        if same(part, full) or same(part.T, full.T):
            orientation.append(not same(part, full))
        else:
            raise ValueError("this weight conversion is not a row rearrangement; adapters cannot follow it")
    return orientation


def _hf_adapters(layer: LoRALinear, hf_names: tuple[str, ...], to_hf: Any) -> dict[str, HFAdapter]:
    """Our adapters on one weight as PEFT adapters on the HF tensors that weight becomes."""
    rank = layer.lora_a[0].shape[0]
    a_all = torch.cat(list(layer.lora_a)).detach()                     # (blocks * rank, d_in)
    b_all = layer.lora_a[0].new_zeros(layer.d_out, a_all.shape[0])     # (d_out, blocks * rank)
    for i, ((start, end), b) in enumerate(zip(layer.row_blocks, layer.lora_b)):
        b_all[start:end, i * rank:(i + 1) * rank] = b.detach()
    transposed = _orientation(to_hf, layer.d_out, layer.d_in, a_all.shape[0])
    marks = layer.lora_a[0].new_zeros(layer.d_out, a_all.shape[0])    # which columns reach which HF tensor
    for i, (start, end) in enumerate(layer.row_blocks):
        marks[start:end, i * rank:(i + 1) * rank] = 1.0
    adapters = {}
    for name, part, mark, flipped in zip(hf_names, to_hf(_probe(b_all, layer.d_in)),
                                         to_hf(_probe(marks, layer.d_in)), transposed):
        part, mark = (part.T, mark.T) if flipped else (part, mark)
        kept = mark[:, :a_all.shape[0]].abs().sum(0) > 0               # the blocks whose rows land here
        if kept.any():
            adapters[name.removesuffix(".weight")] = HFAdapter(a_all[kept], part[:, :a_all.shape[0]][:, kept],
                                                               layer.scaling, flipped)
    return adapters


def export_peft_adapter(model: nn.Module, directory: str | os.PathLike, base_model: str | None = None) -> Path:
    """Write `model`'s LoRA adapters as a PEFT adapter directory for its exported HF base."""
    table = family_for(model.config).weight_table(model.config)
    adapters: dict[str, HFAdapter] = {}
    for name, layer in lora_layers(model).items():
        hf_names, _, to_hf = table.entries[f"{name}.weight"]
        adapters.update(_hf_adapters(layer, hf_names, to_hf))
    if not adapters:
        raise ValueError("this model has no LoRA adapters to export")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for module, adapter in adapters.items():
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = adapter.a.contiguous()
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = adapter.b.contiguous()
    save_file(tensors, folder / ADAPTER_WEIGHTS_FILE)
    (folder / ADAPTER_CONFIG_FILE).write_text(json.dumps(_peft_config(adapters, model, base_model), indent=2))
    return folder


PEFT_BASE_DIR = "base"  # where a glasslm base is exported inside a PEFT adapter directory


def export_peft_with_base(model: nn.Module, directory: str | os.PathLike, base: str) -> tuple[Path, str]:
    """(folder, the base it names) after writing `model`'s adapters as a PEFT adapter directory whose
    `base_model_name_or_path` transformers can load, so `AutoPeftModelForCausalLM.from_pretrained(folder)`
    works: a Hugging Face base directory's absolute path, a hub name as it is, and a glasslm base
    (which transformers cannot read) exported to `folder/base` first and named by its absolute path."""
    from glasslm.hf.convert import export_hf
    from glasslm.hf.files import is_hf_directory
    from glasslm.hf.load import load_chat_template, load_model

    folder, local = Path(directory), Path(base)
    if not local.exists():
        named = base  # a hub name
    elif is_hf_directory(local):
        named = str(local.resolve())
    else:
        base_model, tokenizer = load_model(local)
        # A bias-free GPT-2-shaped base gets exact zero biases (HF GPT-2 always has them; same logits).
        zero_biases = bool(family_for(base_model.config).weight_table(base_model.config, None).absent_biases)
        export_hf(base_model, folder / PEFT_BASE_DIR, tokenizer, zero_biases=zero_biases,
                  chat_template=load_chat_template(local, tokenizer))
        named = str((folder / PEFT_BASE_DIR).resolve())
    return export_peft_adapter(model, folder, base_model=named), named


def _peft_config(adapters: dict[str, HFAdapter], model: nn.Module, base_model: str | None) -> dict[str, Any]:
    ranks = {module: adapter.a.shape[0] for module, adapter in adapters.items()}
    rank = Counter(ranks.values()).most_common(1)[0][0]
    scaling = next(iter(adapters.values())).scaling
    flipped = {adapter.transposed for adapter in adapters.values()}
    if len(flipped) > 1:
        raise ValueError("PEFT takes one fan_in_fan_out per adapter; this model mixes weight layouts")
    dropout = next((r.get("dropout", 0.0) for r in getattr(model, "applied_transforms", []) if r["name"] == "lora"), 0.0)
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": scaling * rank, "lora_dropout": dropout, "bias": "none",
        "target_modules": sorted(adapters), "fan_in_fan_out": flipped.pop(), "use_rslora": False,
        # PEFT scales each module by alpha / r: modules of another rank (GPT-2's fused c_attn with
        # q and v adapted holds both) keep glasslm's scaling through these patterns.
        "rank_pattern": {m: r for m, r in ranks.items() if r != rank},
        "alpha_pattern": {m: scaling * r for m, r in ranks.items() if r != rank},
    }


def read_peft_adapter(directory: str | os.PathLike) -> dict[str, HFAdapter]:
    """HF module name -> its LoRA adapter, from a PEFT adapter directory."""
    folder = Path(directory)
    for needed in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE):
        if not (folder / needed).is_file():
            raise FileNotFoundError(f"{folder} is not a PEFT adapter directory: {needed} is missing")
    config = json.loads((folder / ADAPTER_CONFIG_FILE).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{folder}: glasslm reads LoRA adapters, this one is {config.get('peft_type')}")
    tensors = load_file(folder / ADAPTER_WEIGHTS_FILE)
    adapters = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        rank = a.shape[0]
        alpha = _pattern(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        adapters[module] = HFAdapter(a.float(), b.float(), scaling, bool(config.get("fan_in_fan_out")))
    if not adapters:
        raise ValueError(f"{folder}: no lora_A/lora_B tensors found")
    return adapters


def _pattern(patterns: dict[str, Any], module: str, default: Any) -> Any:
    # PEFT matches a pattern key against the end of the module's name.
    for key, value in patterns.items():
        if module == key or module.endswith("." + key):
            return value
    return default


def _hf_parts(shapes: list[torch.Size], j: int, b: Tensor, d_in: int, transposed: bool) -> list[Tensor]:
    """HF-shaped tensors, zero except the j-th, which holds B (padded) in that tensor's layout."""
    parts = []
    for k, shape in enumerate(shapes):
        rows = shape[1] if transposed else shape[0]
        part = _probe(b, d_in) if k == j else torch.zeros(rows, d_in)
        parts.append(part.T if transposed else part)
    return parts


def _ours_blocks(adapters: dict[str, HFAdapter], hf_names: tuple[str, ...], to_ours: Any, to_hf: Any,
                 d_out: int, d_in: int) -> list[tuple[tuple[int, int], Tensor, Tensor]]:
    """Each adapted HF tensor of one of our weights as ((start, end) rows in ours, A, scaled B rows)."""
    shapes = [t.shape for t in to_hf(torch.zeros(d_out, d_in))]
    found = []
    for j, name in enumerate(hf_names):
        adapter = adapters.get(name.removesuffix(".weight"))
        if adapter is None:
            continue
        rank = adapter.a.shape[0]
        b_ours = to_ours(*_hf_parts(shapes, j, adapter.b * adapter.scaling, d_in, adapter.transposed))[:, :rank]
        marks = to_ours(*_hf_parts(shapes, j, torch.ones_like(adapter.b), d_in, adapter.transposed))[:, :rank]
        touched = (marks.abs().sum(1) > 0).nonzero().flatten()           # our rows this HF tensor feeds
        start, end = int(touched.min()), int(touched.max()) + 1
        found.append(((start, end), adapter.a, b_ours[start:end]))
    return found


def _sites(name: str, layer_rows: list[tuple[int, int]], qkv_rows: dict[str, tuple[int, int]]) -> set[str]:
    if name.endswith("attn.qkv"):
        return {site for site, (lo, hi) in qkv_rows.items() if any(s < hi and lo < e for s, e in layer_rows)}
    return {site for suffix, site in _SITE_OF.items() if name == suffix or name.endswith("." + suffix)}


def import_peft_adapter(model: nn.Module, directory: str | os.PathLike) -> None:
    """Add the PEFT LoRA adapter in `directory` to `model` (a glasslm model of the adapter's base)."""
    adapters = read_peft_adapter(directory)
    table = family_for(model.config).weight_table(model.config)
    c = model.config
    q_rows, kv_rows = c.n_heads * c.d_head, c.n_kv_heads * c.d_head
    qkv_rows = {"q": (0, q_rows), "k": (q_rows, q_rows + kv_rows), "v": (q_rows + kv_rows, q_rows + 2 * kv_rows)}
    found: dict[str, list] = {}
    for weight_name, (hf_names, to_ours, to_hf) in table.entries.items():
        if weight_name.endswith(".weight") and any(n.removesuffix(".weight") in adapters for n in hf_names):
            d_out, d_in = model.get_parameter(weight_name).shape
            found[weight_name.removesuffix(".weight")] = _ours_blocks(adapters, hf_names, to_ours, to_hf, d_out, d_in)
    used = {n.removesuffix(".weight") for names, _, _ in table.entries.values() for n in names}
    if set(adapters) - used:
        raise ValueError(f"{directory}: adapters on modules this model does not have: {sorted(set(adapters) - used)}")
    sites = set().union(*(_sites(name, [rows for rows, _, _ in blocks], qkv_rows) for name, blocks in found.items()))
    rank = max(a.shape[0] for a in (adapter.a for adapter in adapters.values()))
    apply_transform(model, "lora", LoRAConfig(rank=rank, alpha=float(rank), sites=tuple(sorted(sites))))
    for name, layer in lora_layers(model).items():
        _fill(layer, found.get(name, []))


@torch.no_grad()
def _fill(layer: LoRALinear, blocks: list[tuple[tuple[int, int], Tensor, Tensor]]) -> None:
    """Set each of our blocks from the HF adapter covering its rows (scaling is 1: B carries it)."""
    for i, (start, end) in enumerate(layer.row_blocks):
        layer.lora_b[i].zero_()
        for (lo, hi), a, b_rows in blocks:
            if lo <= start and end <= hi:
                layer.lora_a[i].zero_()
                layer.lora_a[i][:a.shape[0]] = a
                layer.lora_b[i][:, :a.shape[0]] = b_rows[start - lo:end - lo]
