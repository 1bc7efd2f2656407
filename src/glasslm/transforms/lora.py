"""LoRA: low-rank adapters on a frozen model (Hu et al., 2021), and QLoRA's quantized base.

An adapted linear map computes

    y = base(x) + (alpha / rank) * B (A dropout(x))

with A (rank, d_in) drawn Kaiming-uniform and B (d_out, rank) zero, as in the paper: the adapted
model starts exactly equal to the base. Only A and B train. The base may be a float `Linear` or
an int8/int4 layer (QLoRA): gradients reach earlier layers through the dequantized base weight.

glasslm keeps q, k and v in one fused matrix (`attn.qkv`); adapting "q" and "v" there adds an
adapter on those row blocks only, so the model behaves as three separately adapted projections.

Merging writes (alpha / rank) B A into the base weight (a float base only); un-merging puts back
the exact weight that was there before.

Example:
    >>> import torch
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.presets import get_preset
    >>> model = TransformerLM(get_preset("llama-tiny", n_layers=1)).eval()
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> before = model(ids)
    >>> add_lora(model, LoRAConfig(rank=4, sites=("q", "v", "mlp_down")))
    >>> torch.equal(model(ids), before)  # B starts at zero
    True
    >>> sorted({name.split(".")[-2] for name, p in model.named_parameters() if p.requires_grad})
    ['lora_a', 'lora_b']
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

from glasslm.core.layers import Linear
from glasslm.transforms.registry import Transform

Site = Literal["q", "k", "v", "attn_out", "mlp_up", "mlp_gate", "mlp_down", "unembed"]
SITES: tuple[str, ...] = Site.__args__  # type: ignore[attr-defined]
# Where each site lives in a glasslm model: the module's name ends with this.
_MODULE_OF = {"attn_out": "attn.out", "mlp_up": "mlp.up", "mlp_gate": "mlp.gate", "mlp_down": "mlp.down",
              "unembed": "unembed"}
_QKV = ("q", "k", "v")


@dataclass(frozen=True)
class LoRAConfig:
    """Which linear maps get adapters, and their size."""

    rank: int = 8  # r: the adapters' inner width
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input while training
    sites: tuple[str, ...] = ("q", "v")  # any of q, k, v, attn_out, mlp_up, mlp_gate, mlp_down, unembed

    def __post_init__(self) -> None:
        object.__setattr__(self, "sites", tuple(self.sites))  # JSON gives back a list
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        unknown = [s for s in self.sites if s not in SITES]
        if unknown or not self.sites:
            raise ValueError(f"unknown LoRA site(s) {unknown}; choose from {', '.join(SITES)}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class LoRALinear(nn.Module):
    """`base` plus one low-rank adapter per adapted block of output rows.

    `row_blocks` lists the [start, end) output rows each adapter adds to: one block covering every
    row for an ordinary site; q, k and/or v's blocks for the fused qkv matrix.
    """

    def __init__(self, base: nn.Module, d_in: int, row_blocks: list[tuple[int, int]], config: LoRAConfig):
        super().__init__()
        self.base, self.d_in, self.row_blocks = base, d_in, row_blocks
        self.scaling, self.dropout = config.scaling, config.dropout
        self.d_out = _d_out(base)
        self.lora_a = nn.ParameterList(nn.Parameter(torch.empty(config.rank, d_in)) for _ in row_blocks)
        self.lora_b = nn.ParameterList(nn.Parameter(torch.zeros(end - start, config.rank)) for start, end in row_blocks)
        for a in self.lora_a:  # nn.Linear's own init, as the paper's reference code uses
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        self._unmerged_weight: Tensor | None = None

    @property
    def merged(self) -> bool:
        return self._unmerged_weight is not None

    def forward(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        y = self.base(x)  # a quantized base is differentiable in x (glasslm.transforms.quantize)
        if self.merged:
            return y
        adapter_in = F.dropout(x, self.dropout, self.training)                      # (..., d_in)
        updates = [(adapter_in @ a.T) @ b.T * self.scaling for a, b in zip(self.lora_a, self.lora_b)]
        if self.row_blocks == [(0, self.d_out)]:
            return y + updates[0]                                                     # (..., d_out)
        pieces, cursor = [], 0
        for (start, end), update in zip(self.row_blocks, updates):                  # each (..., end - start)
            pieces += [y[..., cursor:start], y[..., start:end] + update]
            cursor = end
        return torch.cat(pieces + [y[..., cursor:]], dim=-1)                          # (..., d_out)

    def delta_weight(self) -> Float[Tensor, "d_out d_in"]:
        """(alpha / rank) B A, placed in the adapted rows (zero elsewhere)."""
        delta = self.lora_a[0].new_zeros(self.d_out, self.d_in)
        for (start, end), a, b in zip(self.row_blocks, self.lora_a, self.lora_b):
            delta[start:end] = (b @ a) * self.scaling
        return delta

    @torch.no_grad()
    def merge(self) -> None:
        if not isinstance(self.base, Linear):
            raise ValueError("only a float base merges; dequantize the model first (QLoRA keeps its adapters)")
        if not self.merged:
            self._unmerged_weight = self.base.weight.detach().clone()
            self.base.weight += self.delta_weight().to(self.base.weight.dtype)

    @torch.no_grad()
    def unmerge(self) -> None:
        if self.merged:
            self.base.weight.copy_(self._unmerged_weight)
            self._unmerged_weight = None

    def extra_repr(self) -> str:
        return f"rank={self.lora_a[0].shape[0]}, scaling={self.scaling:g}, row_blocks={self.row_blocks}"


def _d_out(module: nn.Module) -> int:
    return module.weight.shape[0] if isinstance(module, Linear) else module.d_out


def _d_in(module: nn.Module) -> int:
    return module.weight.shape[1] if isinstance(module, Linear) else module.d_in


def _qkv_blocks(attn: nn.Module, sites: tuple[str, ...]) -> list[tuple[int, int]]:
    """The output rows of q, k and v in the fused matrix, for the sites asked for."""
    q_rows, kv_rows = attn.n_heads * attn.d_head, attn.n_kv_heads * attn.d_head
    bounds = {"q": (0, q_rows), "k": (q_rows, q_rows + kv_rows), "v": (q_rows + kv_rows, q_rows + 2 * kv_rows)}
    return [bounds[s] for s in _QKV if s in sites]


def lora_targets(model: nn.Module, config: LoRAConfig) -> dict[str, list[tuple[int, int]]]:
    """Module name -> the output-row blocks to adapt, for every site `config` names in `model`."""
    targets: dict[str, list[tuple[int, int]]] = {}
    for name, module in model.named_modules():
        if name.endswith("attn") and hasattr(module, "qkv") and any(s in config.sites for s in _QKV):
            targets[f"{name}.qkv"] = _qkv_blocks(module, config.sites)
        for site, suffix in _MODULE_OF.items():
            if site in config.sites and (name == suffix or name.endswith("." + suffix)):
                targets[name] = [(0, _d_out(module))]
    if "unembed" in config.sites and getattr(model, "unembed", "absent") is None:
        raise ValueError("this model's unembedding is tied to the token embedding; adapt it after untying, "
                         "or leave 'unembed' out of the sites")
    return targets


def add_lora(model: nn.Module, config: LoRAConfig) -> None:
    """Freeze every parameter of `model` and wrap each targeted linear map in a `LoRALinear`, in place."""
    targets = lora_targets(model, config)
    if not targets:
        raise ValueError(f"no LoRA sites {config.sites} found in this model")
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("this model already has LoRA adapters")
    for p in model.parameters():
        p.requires_grad_(False)
    for name, row_blocks in targets.items():
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, child_name)
        weight = base.weight if isinstance(base, Linear) else next(iter(base.buffers()))
        adapter = LoRALinear(base, _d_in(base), row_blocks, config).to(weight.device)
        setattr(parent, child_name, adapter)


LORA = Transform("lora", add_lora, options=LoRAConfig, kind="adapter",
                 summary="low-rank adapters W + (alpha/r) B A on chosen sites; the base is frozen")


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Only the adapters' tensors (what a LoRA checkpoint stores)."""
    return {name: p.detach() for name, p in model.named_parameters() if ".lora_a." in name or ".lora_b." in name}


def load_lora_state_dict(model: nn.Module, weights: dict[str, Tensor], source: str = "adapters") -> None:
    """Copy adapter tensors (as `lora_state_dict` gives them) into `model`'s adapters, naming any
    missing, unexpected or mis-shaped one; the base weights are left as they are."""
    expected = lora_state_dict(model)
    missing, unexpected = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{source}: the adapters do not match the model's: missing {missing}, unexpected {unexpected}")
    for name, tensor in weights.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(f"{source}: adapter {name} has shape {tuple(tensor.shape)}, "
                             f"the model's is {tuple(expected[name].shape)}")
    model.load_state_dict(weights, strict=False)


def merge_lora(model: nn.Module) -> None:
    """Write every adapter into its base weight; the model then computes the same without adapters."""
    for layer in lora_layers(model).values():
        layer.merge()


def unmerge_lora(model: nn.Module) -> None:
    """Undo `merge_lora` exactly: each base weight is the one it was before merging."""
    for layer in lora_layers(model).values():
        layer.unmerge()


def remove_lora(model: nn.Module, merge: bool = True) -> None:
    """Replace each `LoRALinear` by its base (merged first unless `merge=False`): a plain model again."""
    for name, layer in lora_layers(model).items():
        if merge:
            layer.merge()
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child_name, layer.base)
