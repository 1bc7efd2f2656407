"""A matrix kept as the product of two factors, M = A @ B, never formed unless asked (TransformerLens's
`FactoredMatrix`, with its names and semantics).

A head's OV circuit W_V @ W_O is (d_model, d_model) but has rank d_head: kept as its two factors,
its singular values, eigenvalues and norm come from d_head-sized problems. `glasslm.interp.params.OV`
and `QK` return one for every layer and head at once (leading dimensions broadcast).

* `AB` is the product (ldim, rdim); `BA` the reverse product (mdim, mdim), defined when ldim == rdim.
* `svd()` gives (U, S, V) with U @ diag(S) @ V.T == AB, S descending, U (ldim, k) and V (rdim, k)
  with orthonormal columns, k = min(ldim, mdim, rdim). It reduces each factor by QR and takes the
  SVD of the small (k x k) core between them.
* `eigenvalues` are BA's (AB has the same non-zero ones), complex.
* `norm()` is the Frobenius norm; `T` the transpose; `@` and `*` keep the product factored;
  indexing picks leading dimensions, rows (of A) and columns (of B).

Example:
    >>> import torch
    >>> torch.manual_seed(0) and None
    >>> A, B = torch.randn(6, 2), torch.randn(2, 6)
    >>> m = FactoredMatrix(A, B)
    >>> m.shape, m.mdim
    (torch.Size([6, 6]), 2)
    >>> U, S, V = m.svd()
    >>> torch.allclose(U @ torch.diag(S) @ V.T, A @ B, atol=1e-5)
    True
    >>> torch.allclose(m.norm(), torch.linalg.norm(A @ B), atol=1e-5)
    True
    >>> m[1:3].shape  # rows 1 and 2
    torch.Size([2, 6])
"""

from __future__ import annotations

from functools import cached_property

import torch
from jaxtyping import Complex, Float
from torch import Tensor


def _linalg(x: Tensor) -> Tensor:
    """torch.linalg has no 16-bit kernels: those go up to float32."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _index_keeping_dim(item: object) -> object:
    """An int picks one row or column but keeps its axis (a 1-row factor is still a matrix)."""
    if isinstance(item, int) and not isinstance(item, bool):
        return slice(item, item + 1 if item != -1 else None)
    return item


class FactoredMatrix:
    """M = A @ B with A (..., ldim, mdim) and B (..., mdim, rdim); leading dimensions broadcast."""

    def __init__(self, A: Float[Tensor, "... ldim mdim"], B: Float[Tensor, "... mdim rdim"]):
        if A.shape[-1] != B.shape[-2]:
            raise ValueError(f"the factors must share the inner dimension: A {tuple(A.shape)}, B {tuple(B.shape)}")
        try:
            leading = torch.broadcast_shapes(A.shape[:-2], B.shape[:-2])
        except RuntimeError:
            raise ValueError(f"the factors' leading dimensions do not broadcast: A {tuple(A.shape)}, "
                             f"B {tuple(B.shape)}") from None
        self.A = A.broadcast_to((*leading, *A.shape[-2:]))
        self.B = B.broadcast_to((*leading, *B.shape[-2:]))
        self.ldim, self.mdim, self.rdim = A.shape[-2], A.shape[-1], B.shape[-1]
        self.shape = torch.Size((*leading, self.ldim, self.rdim))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def AB(self) -> Float[Tensor, "... ldim rdim"]:
        """The product itself (ldim x rdim per leading index: the expensive one)."""
        return self.A @ self.B

    @property
    def BA(self) -> Float[Tensor, "... mdim mdim"]:
        """B @ A, the small reverse product; needs a square M (ldim == rdim)."""
        if self.ldim != self.rdim:
            raise ValueError(f"BA needs a square matrix, this one is {self.ldim} x {self.rdim}")
        return self.B @ self.A

    @property
    def T(self) -> "FactoredMatrix":
        return FactoredMatrix(self.B.transpose(-2, -1), self.A.transpose(-2, -1))

    @property
    def pair(self) -> tuple[Tensor, Tensor]:
        return self.A, self.B

    def __matmul__(self, other: "Tensor | FactoredMatrix") -> "Tensor | FactoredMatrix":
        """M @ other: a vector gives a vector; a matrix or factored matrix keeps the result factored."""
        if isinstance(other, FactoredMatrix):
            return (self @ other.A) @ other.B
        if other.dim() == 1:
            return (self.A @ (self.B @ other[:, None]))[..., 0]
        if other.shape[-2] != self.rdim:
            raise ValueError(f"cannot multiply {tuple(self.shape)} by {tuple(other.shape)}")
        # Keep the narrower inner dimension: fold `other` into B when that stays mdim wide.
        if self.rdim > self.mdim:
            return FactoredMatrix(self.A, self.B @ other)
        return FactoredMatrix(self.AB, other)

    def __rmatmul__(self, other: Tensor) -> "Tensor | FactoredMatrix":
        """other @ M, the mirror image of `__matmul__`."""
        if other.shape[-1] != self.ldim:
            raise ValueError(f"cannot multiply {tuple(other.shape)} by {tuple(self.shape)}")
        if other.dim() == 1:
            return ((other[None, :] @ self.A) @ self.B)[..., 0, :]
        if self.ldim > self.mdim:
            return FactoredMatrix(other @ self.A, self.B)
        return FactoredMatrix(other, self.AB)

    def __mul__(self, scalar: float | Tensor) -> "FactoredMatrix":
        if isinstance(scalar, Tensor) and scalar.numel() != 1:
            raise ValueError(f"* takes a scalar (use @ for products), got shape {tuple(scalar.shape)}")
        return FactoredMatrix(self.A * scalar, self.B)

    __rmul__ = __mul__

    @cached_property
    def _svd(self) -> tuple[Tensor, Tensor, Tensor]:
        # A = Qa Ra and B.T = Qb Rb (reduced QR), so AB = Qa (Ra Rb.T) Qb.T: the SVD of the small core
        # Ra Rb.T, its singular vectors carried back by Qa and Qb, is the SVD of AB.
        q_a, r_a = torch.linalg.qr(_linalg(self.A))
        q_b, r_b = torch.linalg.qr(_linalg(self.B).transpose(-2, -1))
        u_core, s, vh_core = torch.linalg.svd(r_a @ r_b.transpose(-2, -1), full_matrices=False)
        return q_a @ u_core, s, q_b @ vh_core.transpose(-2, -1)

    def svd(self) -> tuple[Float[Tensor, "... ldim k"], Float[Tensor, "... k"], Float[Tensor, "... rdim k"]]:
        """(U, S, V) with U @ diag(S) @ V.T == AB (V, not V.T, as TransformerLens returns it)."""
        return self._svd

    @property
    def U(self) -> Tensor:
        return self.svd()[0]

    @property
    def S(self) -> Tensor:
        return self.svd()[1]

    @property
    def V(self) -> Tensor:
        return self.svd()[2]

    @property
    def eigenvalues(self) -> Complex[Tensor, "... mdim"]:
        """The eigenvalues of BA: those of AB without its (ldim - mdim) zeros, since ABx = kx gives BA(Bx) = k(Bx)."""
        return torch.linalg.eigvals(_linalg(self.BA))

    def norm(self) -> Float[Tensor, "..."]:
        """The Frobenius norm: the root of the sum of squared singular values."""
        return self.S.pow(2).sum(-1).sqrt()

    def make_even(self) -> "FactoredMatrix":
        """The same matrix as (U sqrt(S)) @ (sqrt(S) V.T): both factors carry half of each singular value."""
        root = self.S.sqrt()
        return FactoredMatrix(self.U * root[..., None, :], root[..., :, None] * self.V.transpose(-2, -1))

    def collapse_l(self) -> Float[Tensor, "... k rdim"]:
        """S V.T: the matrix with its left orthogonal factor U dropped."""
        return self.S[..., :, None] * self.V.transpose(-2, -1)

    def collapse_r(self) -> Float[Tensor, "... ldim k"]:
        """U S: the matrix with its right orthogonal factor V dropped."""
        return self.U * self.S[..., None, :]

    def get_corner(self, k: int = 3) -> Tensor:
        """The top-left k x k block of AB (and of the first k of each leading dimension), formed cheaply."""
        corner = self.A[..., :k, :] @ self.B[..., :, :k]
        return corner[tuple(slice(0, k) for _ in range(corner.dim()))]

    def unsqueeze(self, dim: int) -> "FactoredMatrix":
        """A new leading dimension at `dim` (counted among the leading ones)."""
        return FactoredMatrix(self.A.unsqueeze(dim), self.B.unsqueeze(dim))

    def __getitem__(self, index: object) -> "FactoredMatrix":
        """Leading dimensions first, then rows and columns, as on AB; an int row or column keeps its axis."""
        items = index if isinstance(index, tuple) else (index,)
        if any(item is Ellipsis or item is None for item in items):
            raise IndexError("FactoredMatrix indexing takes ints, slices and index lists (no ... or None)")
        n_leading = self.ndim - 2
        if len(items) > self.ndim:
            raise IndexError(f"{len(items)} indices for a FactoredMatrix of {self.ndim} dimensions")
        leading = items[:n_leading]
        a, b = self.A[leading], self.B[leading]
        if len(items) > n_leading:  # a row index: A's rows
            a = a[(..., _index_keeping_dim(items[n_leading]), slice(None))]
        if len(items) > n_leading + 1:  # a column index: B's columns
            b = b[(..., _index_keeping_dim(items[n_leading + 1]))]
        return FactoredMatrix(a, b)

    def __repr__(self) -> str:
        return f"FactoredMatrix(shape={tuple(self.shape)}, mdim={self.mdim})"
