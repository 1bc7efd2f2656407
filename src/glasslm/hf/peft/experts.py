"""Adapters on a mixture of experts' stacked weights as peft writes them (peft >= 0.17's `target_parameters`).

transformers 5 holds a layer's experts as two fused parameters, `model.layers.{i}.mlp.experts.gate_up_proj`
(n_experts, 2 d_expert, d_model: each expert's [gate | up] rows) and `...experts.down_proj` (n_experts,
d_model, d_expert), for Mixtral, Qwen3-MoE and OLMoE alike. peft adapts each with a `ParamWrapper`; two
on one module nest, the one on gate_up_proj inside (its tensors under `experts.base_layer.`), the one on
down_proj outside (under `experts.`). Its A is (n_experts * rank, d_in), expert e's rows e*rank ...
(e+1)*rank; its B is (d_out, rank * n_experts), expert e's columns e, e + n_experts, ... (the rank
index outer). glasslm's `LoRAExperts` holds A (n_experts, rank, d_in) and B (n_experts, d_out, rank).

Example:
    >>> import torch
    >>> a, b = torch.randn(4, 2, 8), torch.randn(4, 6, 2)    # 4 experts, rank 2, 8 -> 6
    >>> peft_a, peft_b = to_peft(a, b)
    >>> peft_a.shape, peft_b.shape
    (torch.Size([8, 8]), torch.Size([6, 8]))
    >>> all(torch.equal(x, y) for x, y in zip(from_peft(peft_a, peft_b, 4), (a, b)))
    True
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from glasslm.hf.peft.files import BASE_LAYER, PeftAdapter, PeftAdapterError
from glasslm.transforms.lora import LoRAExperts

PARAMETERS = {"gate_up": "gate_up_proj", "down": "down_proj"}  # glasslm's expert group -> transformers' parameter
_MODULE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts((?:\.base_layer)*)$")


def to_peft(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """(peft's A (n * rank, d_in), B (d_out, rank * n)) from ours, A (n, rank, d_in) and B (n, d_out, rank)."""
    n, rank, d_in = a.shape
    return a.reshape(n * rank, d_in), b.permute(1, 2, 0).reshape(b.shape[1], rank * n)


def from_peft(a: Tensor, b: Tensor, n_experts: int) -> tuple[Tensor, Tensor]:
    """The inverse of `to_peft`: ours, A (n, rank, d_in) and B (n, d_out, rank)."""
    rank = a.shape[0] // n_experts
    return a.reshape(n_experts, rank, a.shape[1]), b.reshape(b.shape[0], rank, n_experts).permute(2, 0, 1)


def hf_module(layer_name: str, group: str, groups: tuple[str, ...]) -> str:
    """The module peft saves group `group`'s adapter under, for glasslm's MoE at `layer_name` (blocks.{i}.mlp)."""
    layer = int(layer_name.split(".")[1])
    nested = [g for g in PARAMETERS if g in groups]  # gate_up inside, down outside
    return f"model.layers.{layer}.mlp.experts" + BASE_LAYER * (len(nested) - 1 - nested.index(group))


def export_tensors(name: str, layer: LoRAExperts) -> dict[str, Tensor]:
    """peft's tensors (without its prefix) for one adapted mixture of experts."""
    out = {}
    for group, a, b in zip(layer.groups, layer.lora_a, layer.lora_b):
        peft_a, peft_b = to_peft(a.detach(), b.detach())
        module = hf_module(name, group, layer.groups)
        out[f"{module}.lora_A.weight"], out[f"{module}.lora_B.weight"] = peft_a, peft_b
    return out


def target_parameters(groups: tuple[str, ...]) -> list[str]:
    """adapter_config.json's target_parameters for these groups."""
    return [f"mlp.experts.{PARAMETERS[g]}" for g in PARAMETERS if g in groups]


def take_expert_adapters(adapter: PeftAdapter) -> dict[str, dict[str, tuple[Tensor, Tensor, float]]]:
    """Remove the expert adapters from `adapter.modules`: {blocks.{i}.mlp: {group: (A, B, peft's scaling)}},
    A and B still in peft's layout; an adapter on other parameters, or nested otherwise, is refused."""
    wanted = adapter.config.get("target_parameters") or []
    # peft matches each entry to the end of a parameter's name ("down_proj" is its own rewrite of target_modules)
    of = {entry: [g for g, p in PARAMETERS.items() if f".mlp.experts.{p}".endswith("." + entry)] for entry in wanted}
    groups = tuple(g for g in PARAMETERS if any(g in found for found in of.values()))
    unknown = sorted(entry for entry, found in of.items() if not found)
    if unknown:
        raise PeftAdapterError(f"{adapter.source}: target_parameters {unknown}: glasslm adapts the experts' "
                               f"{', '.join(target_parameters(('gate_up', 'down')))} only")
    found: dict[str, dict[str, tuple[Tensor, Tensor, float]]] = {}
    for module in [m for m in adapter.modules if _MODULE.match(m)]:
        if not groups:
            raise PeftAdapterError(f"{adapter.source}: {module} is adapted but the config names no target_parameters")
        layer, depth = _MODULE.match(module).groups()
        nested = [g for g in PARAMETERS if g in groups]
        position = len(nested) - 1 - depth.count(BASE_LAYER)
        if position < 0:
            raise PeftAdapterError(f"{adapter.source}: {module} is nested deeper than its target_parameters allow")
        tensors = adapter.modules.pop(module)
        if tensors.magnitude is not None or tensors.embedding:
            raise PeftAdapterError(f"{adapter.source}: {module} has DoRA or embedding tensors; peft's expert "
                                   "adapters have neither")
        found.setdefault(f"blocks.{layer}.mlp", {})[nested[position]] = (tensors.a, tensors.b, _scaling(adapter, module))
    return found


def _scaling(adapter: PeftAdapter, module: str) -> float:
    if adapter.config.get("rank_pattern") or adapter.config.get("alpha_pattern"):
        raise PeftAdapterError(f"{adapter.source}: rank_pattern / alpha_pattern beside target_parameters "
                               "(expert adapters of their own rank) are not supported")
    rank, alpha = int(adapter.config.get("r", 8)), float(adapter.config.get("lora_alpha", 8))
    return alpha / (rank ** 0.5 if adapter.config.get("use_rslora") else rank)


@torch.no_grad()
def fill(layer: LoRAExperts, found: dict[str, tuple[Tensor, Tensor, float]], n_experts: int, source: str) -> None:
    """Set `layer`'s adapters from peft's (a group peft does not adapt adds nothing: B zero); a rank below
    glasslm's is zero-padded, a scaling other than glasslm's folded into B."""
    for group, a, b in zip(layer.groups, layer.lora_a, layer.lora_b):
        a.zero_()
        b.zero_()
        if group not in found:
            continue
        peft_a, peft_b, scaling = found[group]
        ours_a, ours_b = from_peft(peft_a, peft_b, n_experts)
        if ours_a.shape[2] != a.shape[2] or ours_b.shape[1] != b.shape[1] or ours_a.shape[1] > a.shape[1]:
            raise PeftAdapterError(f"{source}: the {PARAMETERS[group]} adapter's A {tuple(peft_a.shape)} and B "
                                   f"{tuple(peft_b.shape)} do not fit {n_experts} experts of this model")
        rank = ours_a.shape[1]
        a[:, :rank] = ours_a
        b[:, :, :rank] = ours_b * (scaling / layer.scaling)
