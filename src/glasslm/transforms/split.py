"""A Linear split by output rows into parts, each a Linear of its own: `row_split`.

Why. glasslm fuses a block's query, key and value projections into one Linear (`attn.qkv`), but a
GGUF file keeps them as three tensors, and llama.cpp's mixed quantizations (Q4_K_M, Q5_K_M, ...)
give them different formats: SmolLM2's Q4_K_M stores attn_q and attn_k as Q5_0 and attn_v as Q8_0.
Kept as they are, those rows cannot be one block matrix. `row_split` makes the fused layer a
`RowSplitLinear` whose parts are plain Linears of the given row counts (q | k | v), so each part can
then take its own block format (the block transforms name it `blocks.0.attn.qkv.parts.2`).
The output is the parts' outputs side by side: the same numbers as the fused layer.

Example:
    >>> import torch
    >>> from glasslm.core.layers import Linear
    >>> fused = Linear(8, 6)
    >>> split = RowSplitLinear.from_linear(fused, [4, 2])
    >>> x = torch.randn(3, 8)
    >>> torch.allclose(split(x), fused(x), atol=1e-6)  # (two products may add in another order than one)
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from jaxtyping import Float
from torch import Tensor, nn

from glasslm.core.layers import Linear
from glasslm.transforms.registry import Transform


class RowSplitLinear(nn.Module):
    """y = [part_0(x), part_1(x), ...]: a Linear of d_out = sum(sizes) rows kept as parts of `sizes` rows."""

    def __init__(self, d_in: int, sizes: list[int], bias: bool = True):
        super().__init__()
        if not sizes or min(sizes) < 1:
            raise ValueError(f"a row split needs parts of at least one row, got {sizes}")
        self.d_in, self.d_out, self.sizes = d_in, sum(sizes), list(sizes)
        self.parts = nn.ModuleList(Linear(d_in, rows, bias=bias) for rows in sizes)

    @classmethod
    def from_linear(cls, linear: nn.Module, sizes: list[int]) -> "RowSplitLinear":
        """`linear`'s rows as parts of `sizes` rows (its weights copied; they must add up to its d_out)."""
        d_out, d_in = linear.weight.shape
        if sum(sizes) != d_out:
            raise ValueError(f"parts of {sizes} rows do not add up to the layer's {d_out}")
        with torch.device(linear.weight.device):  # (a checkpoint's empty model: meta, nothing initialised)
            split = cls(d_in, sizes, bias=linear.bias is not None).to(linear.weight.dtype)
        with torch.no_grad():
            for part, weight in zip(split.parts, linear.weight.split(sizes)):
                part.weight.copy_(weight)
            for part, bias in zip(split.parts, [] if linear.bias is None else linear.bias.split(sizes)):
                part.bias.copy_(bias)
        return split

    @property
    def weight(self) -> Float[Tensor, "d_out d_in"]:
        """The fused weight (float parts' weights, or quantized parts' dequantized ones) stacked."""
        return torch.cat([_float_weight(part) for part in self.parts])

    @property
    def bias(self) -> Float[Tensor, "d_out"] | None:
        biases = [part.bias for part in self.parts]
        return None if any(b is None for b in biases) else torch.cat(biases)

    def forward(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, sizes={self.sizes}"


def _float_weight(part: nn.Module) -> Tensor:
    return part.dequantized_weight() if hasattr(part, "dequantized_weight") else part.weight


@dataclass(frozen=True)
class RowSplitOptions:
    """`layers`: layer name (as `model.named_modules()` gives it) -> the row counts of its parts."""

    layers: dict[str, list[int]] = field(default_factory=dict)


def _split(model: nn.Module, options: RowSplitOptions) -> None:
    for name, sizes in options.layers.items():
        parent_name, _, child_name = name.rpartition(".")
        child = model.get_submodule(name)
        if not isinstance(child, Linear):
            raise ValueError(f"{name} is not a Linear layer of this model; row_split splits Linear layers")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child_name, RowSplitLinear.from_linear(child, list(sizes)))


ROW_SPLIT = Transform("row_split", _split, options=RowSplitOptions, kind="structure",
                      summary="a fused Linear kept as parts of given row counts (each may take its own block format)")
