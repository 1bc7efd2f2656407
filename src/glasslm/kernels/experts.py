"""A mixture of experts' feed-forward for a decoding step's rows: the readable definition of the C++
`Experts` (experts.cpp) and the call into it.

Each row x goes only through the experts its router chose (ids e_j, weights w_j, j < k):

    y = sum_j w_j * down_{e_j}( silu(gate_{e_j} x) * up_{e_j} x )

the terms added from zero in increasing expert id, as `glasslm.core.moe.MoE.experts_grouped` adds
them. `experts_reference` is that sum with float matrices. The kernel takes each expert's three
matrices as packed ones (`glasslm.kernels.qmatmul.PackedMatrix`: a GGUF file's Q4_K, Q8_0, ... blocks,
or float matrices as they are) and multiplies each by x's rows rounded to int8 blocks (float ones by
the float rows), as every product does: it differs from the reference by that rounding and the order of float32 additions within a
product. Only the chosen experts' matrices are read.

Example:
    >>> import torch
    >>> from glasslm.kernels.qmatmul import QuantizedMatrix, kernel_ops, pack
    >>> n, d_model, d_expert = 4, 64, 32
    >>> mats = [[QuantizedMatrix.from_float(torch.randn(rows, cols), bits=8) for _ in range(n)]
    ...         for rows, cols in ((d_expert, d_model), (d_expert, d_model), (d_model, d_expert))]
    >>> x, ids, w = torch.randn(2, d_model), torch.tensor([[3, 1], [0, 3]]), torch.tensor([[0.7, 0.3], [0.6, 0.4]])
    >>> want = experts_reference(x, ids, w, *[torch.stack([m.weight() for m in ms]) for ms in mats])
    >>> if kernel_ops() is not None:
    ...     got = native_experts(*[[pack(m) for m in ms] for ms in mats])(x, ids, w)
    ...     assert (got - want).abs().max() < 0.05 * want.abs().max()
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from glasslm.kernels.qmatmul import PackedMatrix, kernel_ops

GATE, UP, DOWN = 0, 1, 2  # experts.cpp's numbering of the projections


def experts_reference(x: Float[Tensor, "rows d_model"], experts: Int[Tensor, "rows k"], weights: Float[Tensor, "rows k"],
                      gate: Float[Tensor, "n d_expert d_model"], up: Float[Tensor, "n d_expert d_model"],
                      down: Float[Tensor, "n d_model d_expert"]) -> Float[Tensor, "rows d_model"]:
    """The definition, a row and a chosen expert at a time, in increasing expert id."""
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float32)
    for r in range(x.shape[0]):
        order = torch.argsort(experts[r], stable=True)
        for j in order.tolist():
            e = int(experts[r, j])
            row = x[r:r + 1].float()
            y = F.linear(F.silu(F.linear(row, gate[e].float())) * F.linear(row, up[e].float()), down[e].float())[0]
            out[r] = out[r] + y * weights[r, j].float()
    return out


def native_experts(gate: list[PackedMatrix], up: list[PackedMatrix], down: list[PackedMatrix]) -> Any:
    """A C++ `glasslm_kernels.Experts` holding each expert's packed matrices; call it as
    `experts(x (rows, d_model) float32, ids (rows, k) int64, weights (rows, k) float32)`."""
    if kernel_ops() is None:
        raise RuntimeError("the C++ kernels are not loaded (see glasslm.kernels.build)")
    if not len(gate) == len(up) == len(down) > 0:
        raise ValueError(f"every expert needs a gate, up and down matrix; got {len(gate)}, {len(up)}, {len(down)}")
    native = torch.classes.glasslm_kernels.Experts()
    for projection, matrices in ((GATE, gate), (UP, up), (DOWN, down)):
        for e, matrix in enumerate(matrices):
            native.add(projection, e, *matrix.operands())
    return _Call(native)


class _Call:
    """The class's `forward`, looked up once (a decoding step calls it once per MoE layer)."""

    def __init__(self, native: Any):
        self.native, self.forward = native, native.forward

    def __call__(self, x: Float[Tensor, "rows d_model"], experts: Int[Tensor, "rows k"],
                 weights: Float[Tensor, "rows k"]) -> Float[Tensor, "rows d_model"]:
        return self.forward(x, experts, weights)
