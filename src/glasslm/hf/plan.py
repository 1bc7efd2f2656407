"""The weight-name plan engine: one table per family, read left to right on import, right to left
on export, so the two directions can never disagree about a name or a layout.

A table maps each glasslm tensor name to (the HF tensors it is made of, to_ours(*hf) -> ours,
to_hf(ours) -> hf tensors). Keeping the HF names explicit lets import report missing and
unexpected tensors by name. The tables themselves live with their families (`glasslm.hf.families`).
Several of ours may be cut from one HF tensor (Phi-3's `gate_up_proj` is [gate | up]): each entry
reads the whole tensor and takes its rows, and export stacks the parts' rows in table order.

Example:
    >>> table = WeightTable({"embed.weight": (("wte.weight",), *SAME)})
    >>> hf = hf_tensors(table, {"embed.weight": torch.ones(2, 3)})
    >>> list(hf), torch.equal(ours_makers(table, hf.__getitem__)["embed.weight"](), torch.ones(2, 3))
    (['wte.weight'], True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

Plan = dict[str, tuple[tuple[str, ...], Callable[..., Tensor], Callable[[Tensor], tuple[Tensor, ...]]]]
SAME = (lambda t: t, lambda t: (t,))


@dataclasses.dataclass(frozen=True)
class WeightTable:
    """A family's table for one config, plus the HF biases this config has no tensor for.

    An HF format may always carry biases (GPT-2) that a glasslm config lacks: import accepts them
    when they are zero, export writes zeros there when asked (`zero_biases`).
    """

    entries: Plan
    absent_biases: frozenset[str] = frozenset()

    def hf_names(self) -> set[str]:
        """Every HF tensor the table reads on import (and writes on export)."""
        return {hf_name for hf_names, _, _ in self.entries.values() for hf_name in hf_names}


def ours_makers(table: WeightTable, read: Callable[[str], Tensor]) -> dict[str, Callable[[], Tensor]]:
    """Left to right: for each of our tensors, a function that reads and converts its HF tensors."""
    return {ours: (lambda hf_names=hf_names, to_ours=to_ours: to_ours(*map(read, hf_names)))
            for ours, (hf_names, to_ours, _) in table.entries.items()}


def hf_tensors(table: WeightTable, ours: dict[str, Tensor], zero_biases: bool = False) -> dict[str, Tensor]:
    """Right to left: our tensors under HF names and layouts (zeros for the absent biases if asked)."""
    parts: dict[str, list[Tensor]] = {}
    for name, (hf_names, _, to_hf) in table.entries.items():
        for hf_name, tensor in zip(hf_names, to_hf(ours[name])):
            parts.setdefault(hf_name, []).append(tensor)
    out = {hf_name: rows[0] if len(rows) == 1 else torch.cat(rows) for hf_name, rows in parts.items()}
    for hf_bias in sorted(table.absent_biases) if zero_biases else ():
        # A bias has one entry per output feature: the last axis of its weight (GPT-2's Conv1D is
        # (d_in, d_out)), or the norm's size.
        weight = out[hf_bias.removesuffix("bias") + "weight"]
        out[hf_bias] = torch.zeros(weight.shape[-1], dtype=weight.dtype, device=weight.device)
    return out
