"""A PEFT LoRA adapter onto a glasslm model of its base: the same model PEFT loads, or an error.

Each adapted HF module is matched to the glasslm module whose weight holds its rows
(`layout.weight_parts`); its B and DoRA magnitudes are put in our row order and its A kept. glasslm
gives every adapter one rank (the largest) and one scaling (PEFT's for that rank), so a module of
another rank is zero-padded, and one of another scaling (rank_pattern, alpha_pattern) has the ratio
folded into its B: each computes what PEFT's does. The base tensors PEFT loads over the base's
(biases with `bias="all"/"lora_only"`, whole modules in `modules_to_save`) become the adapter's own
trained biases and `full` modules (`glasslm.transforms.lora.LoRAConfig`), so the result trains on
and exports back as PEFT's adapter would.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from glasslm.hf.peft import experts
from glasslm.hf.peft.files import PeftAdapter, PeftAdapterError, read_peft_adapter
from glasslm.hf.peft.layout import HFPart, hf_table, our_weight, weight_parts
from glasslm.transforms import apply_transform
from glasslm.transforms.lora import (
    EXPERT_SITES, LoRAConfig, LoRAExperts, adaptable_modules, lora_layers, trained_parameters,
)


@dataclass
class Placed:
    """One HF module's adapter in glasslm's terms: A, B with our rows (zero on rows it does not
    cover, the scaling ratio folded in), the rows it covers, and magnitudes on those rows."""

    a: Tensor                 # (rank, d_in)
    b: Tensor                 # (d_out, rank)
    covered: Tensor           # (d_out,) bool
    magnitude: Tensor | None  # (d_out,)


@dataclass
class ImportPlan:
    placed: dict[str, list[Placed]] = field(default_factory=dict)  # glasslm module -> its HF modules' adapters
    sites: set[str] = field(default_factory=set)
    changed: dict[str, Tensor] = field(default_factory=dict)       # glasslm parameter -> the adapter's value
    full: set[str] = field(default_factory=set)


def import_peft_adapter(model: nn.Module, directory: str | os.PathLike) -> None:
    """Add the PEFT LoRA adapter in `directory` to `model` (a glasslm model of the adapter's base), in
    place; an option or tensor glasslm cannot honour exactly is refused by name."""
    adapter = read_peft_adapter(directory)
    plan = ImportPlan()
    expert_adapters = experts.take_expert_adapters(adapter)  # (out of adapter.modules)
    rank = _rank(model, adapter, expert_adapters)
    _place_adapters(model, adapter, plan, rank)
    _carried_tensors(model, adapter, plan)
    config = _lora_config(model, adapter, plan, expert_adapters, rank)
    apply_transform(model, "lora", config)
    with torch.no_grad():
        for name, layer in lora_layers(model).items():
            if isinstance(layer, LoRAExperts):
                experts.fill(layer, expert_adapters.pop(name, {}), layer.base.n_experts, adapter.source)
            else:
                _fill(layer, plan.placed.get(name, []))
        if expert_adapters:
            raise PeftAdapterError(f"{directory}: expert adapters on layers without experts in this model: "
                                   f"{sorted(expert_adapters)}")
        trained = trained_parameters(model, config)
        for name, value in plan.changed.items():
            name = _after_wrapping(model, name)
            if name not in trained:  # a base tensor the adapter state would not keep
                raise PeftAdapterError(f"{directory}: the adapter changes the base's {name}, which glasslm's LoRA "
                                       f"(bias={config.bias}, full={list(config.full)}) does not train")
            trained[name].copy_(value.to(trained[name].dtype))


def _hf_index(model: nn.Module) -> dict[str, tuple[str, HFPart]]:
    """HF module name -> (the glasslm module whose weight holds it, its row map), for every adaptable module."""
    index, table = {}, hf_table(model)
    for name in adaptable_modules(model):
        for part in weight_parts(model, name, table):
            index[part.module] = (name, part)
    return index


def _rank(model: nn.Module, adapter: PeftAdapter, expert_adapters: dict[str, dict[str, tuple]]) -> int:
    """glasslm's one rank for every adapter: the largest of the adapter's modules and expert stacks."""
    n_experts = getattr(model.config, "n_experts", 0) or 1
    expert_ranks = [a.shape[0] // n_experts for groups in expert_adapters.values() for a, _, _ in groups.values()]
    return max([adapter.rank(m) for m in adapter.modules] + expert_ranks, default=1)


def _place_adapters(model: nn.Module, adapter: PeftAdapter, plan: ImportPlan, rank: int) -> None:
    index = _hf_index(model)
    scaling = LoRAConfig(rank=rank, **_scaling_options(adapter)).scaling
    unknown = sorted(set(adapter.modules) - set(index))
    if unknown:
        raise PeftAdapterError(f"{adapter.source}: adapters on modules glasslm cannot adapt in this model: {unknown}")
    sites_of = adaptable_modules(model)
    for module, tensors in adapter.modules.items():
        name, part = index[module]
        if tensors.embedding != (name == "embed") or (tensors.magnitude is not None) != adapter.dora:
            raise PeftAdapterError(f"{adapter.source}: {module}'s tensors do not fit a "
                                   f"{'DoRA ' if adapter.dora else ''}adapter on {name}")
        weight = our_weight(model, name)
        if tensors.a.shape[1] != weight.shape[1] or tensors.b.shape[0] != len(part.rows):
            raise PeftAdapterError(f"{adapter.source}: {module}'s A {tuple(tensors.a.shape)} and B "
                                   f"{tuple(tensors.b.shape)} do not fit its weight {tuple(weight.shape)}")
        placed = _placed(tensors, part, weight.shape[0], adapter.scaling(module) / scaling)
        plan.placed.setdefault(name, []).append(placed)
        plan.sites |= {site for site, (start, end) in sites_of[name].items() if placed.covered[start:end].any()}


def _scaling_options(adapter: PeftAdapter) -> dict:
    """LoRAConfig's alpha and rsLoRA as PEFT's config has them (a zero alpha: scaling 1, folded into B)."""
    alpha = float(adapter.config.get("lora_alpha", 8))
    return {"alpha": alpha, "rslora": bool(adapter.config.get("use_rslora"))} if alpha else {"alpha": 1.0}


def _placed(tensors, part: HFPart, d_out: int, ratio: float) -> Placed:
    b = tensors.b.new_zeros(d_out, tensors.b.shape[1])
    b[part.rows] = tensors.b * ratio
    covered = torch.zeros(d_out, dtype=torch.bool)
    covered[part.rows] = True
    magnitude = None
    if tensors.magnitude is not None:
        magnitude = tensors.magnitude.new_zeros(d_out)
        magnitude[part.rows] = tensors.magnitude
    return Placed(tensors.a, b, covered, magnitude)


@torch.no_grad()
def _fill(layer: nn.Module, placed: list[Placed]) -> None:
    """Set each of our blocks from the HF adapter covering its rows; a block none covers adds nothing
    (B zero; DoRA: each magnitude stays at its row's norm, where the transform put it: a factor of one)."""
    for i, (start, end) in enumerate(layer.row_blocks):
        layer.lora_a[i].zero_()
        layer.lora_b[i].zero_()
        covering = [p for p in placed if p.covered[start:end].any()]
        if not covering:
            continue
        if len(covering) > 1 or not covering[0].covered[start:end].all():
            raise PeftAdapterError(f"rows {start}..{end} of this weight are adapted by parts of several HF modules; "
                                   "glasslm's adapter blocks cannot split them")
        rank = covering[0].a.shape[0]
        layer.lora_a[i][:rank] = covering[0].a
        layer.lora_b[i][:, :rank] = covering[0].b[start:end]
        if layer.magnitude is not None:
            layer.magnitude[i].copy_(covering[0].magnitude[start:end])


def _lora_config(model: nn.Module, adapter: PeftAdapter, plan: ImportPlan,
                 expert_adapters: dict[str, dict[str, tuple]], rank: int) -> LoRAConfig:
    groups = {group for found in expert_adapters.values() for group in found}
    plan.sites |= {site for group in groups for site in EXPERT_SITES[group]}
    tied = model.config.tie_embeddings and (plan.full or plan.sites & {"embed", "unembed"})
    if adapter.config.get("ensure_weight_tying") and tied:
        raise PeftAdapterError(f"{adapter.source}: ensure_weight_tying keeps a tied embedding and lm_head one "
                               "module while they train, which glasslm does not implement")
    return LoRAConfig(rank=rank, dropout=float(adapter.config.get("lora_dropout") or 0.0),
                      sites=tuple(sorted(plan.sites)), dora=adapter.dora, bias=adapter.bias,
                      full=tuple(sorted(plan.full)), **_scaling_options(adapter))


def _carried_tensors(model: nn.Module, adapter: PeftAdapter, plan: ImportPlan) -> None:
    """The base tensors the adapter carries that differ from the model's, as glasslm parameters; whole
    modules (modules_to_save, or a differing embedding/unembedding) become `full` modules."""
    table = hf_table(model)
    owner = {hf: (ours, hf_names) for ours, (hf_names, _, _) in table.entries.items() for hf in hf_names}
    for entry in adapter.modules_to_save:  # PEFT takes every module whose name ends with the entry
        modules = {ours.rpartition(".")[0] for hf, (ours, _) in owner.items() if hf.rpartition(".")[0].endswith(entry)}
        if not modules or not modules <= {"embed", "unembed"}:
            raise PeftAdapterError(f"{adapter.source}: modules_to_save {entry!r} ({sorted(modules) or 'not found'}): "
                                   "glasslm trains whole only the embedding and the unembedding")
        plan.full |= modules
    for hf_name, value in adapter.original.items():  # the base's own module, saved beside a trained copy
        ours, hf_names = owner.get(hf_name, (None, ()))
        if ours and _replaced(table, ours, hf_names, _current(model, ours), hf_name, value, adapter.source) is not None:
            raise PeftAdapterError(f"{adapter.source}: the adapter's original {hf_name} is not this base's: it was "
                                   "saved for a different base")
    for hf_name, value in adapter.carried.items():
        if hf_name not in owner:
            raise PeftAdapterError(f"{adapter.source}: the adapter carries {hf_name}, which this model does not have")
        ours, hf_names = owner[hf_name]
        current = plan.changed[ours] if ours in plan.changed else _current(model, ours)  # q, k, v biases: one of ours
        new = _replaced(table, ours, hf_names, current, hf_name, value, adapter.source)
        if new is not None:
            plan.changed[ours] = new
            if ours in ("embed.weight", "unembed.weight"):
                plan.full.add(ours.removesuffix(".weight"))
    if plan.full & plan.sites:
        raise PeftAdapterError(f"{adapter.source}: {sorted(plan.full & plan.sites)} both adapted and changed whole")


def _replaced(table, ours: str, hf_names: tuple[str, ...], current: Tensor, hf_name: str, value: Tensor,
              source: str) -> Tensor | None:
    """`current` (our tensor `ours`) with its HF part `hf_name` set to `value` (None: that changes nothing)."""
    _, to_ours, to_hf = table.entries[ours]
    parts = dict(zip(hf_names, to_hf(current)))
    if parts[hf_name].shape != value.shape:
        raise PeftAdapterError(f"{source}: the adapter's {hf_name} has shape {tuple(value.shape)}, the base's "
                               f"{tuple(parts[hf_name].shape)}: it was saved for a different base (a resized "
                               "vocabulary?)")
    parts[hf_name] = value.to(parts[hf_name].dtype)
    new = to_ours(*(parts[n] for n in hf_names))
    return None if torch.equal(new, current) else new


def _current(model: nn.Module, ours: str) -> Tensor:
    if ours == "unembed.weight" and model.unembed is None:
        return model.embed.weight.detach()  # tied: lm_head is the table
    return model.get_parameter(_after_wrapping(model, ours)).detach()


def _after_wrapping(model: nn.Module, name: str) -> str:
    """A base parameter's name once its module may be wrapped in an adapter (qkv.bias -> qkv.base.bias)."""
    module, _, leaf = name.rpartition(".")
    return f"{module}.base.{leaf}" if module in lora_layers(model) else name
