"""The small steps of a one-token decoding step, each one call: the readable definition of the C++
kernels beside this file (decode.cpp) and the calls into them.

Why they exist. A decoding step of a small model (SmolLM2-135M: 30 layers of width 576) spends less
than half its time in the matrix products; the rest is ~40 tensor operators per layer, each a few
microseconds of dispatch on a vector of a few hundred floats: an RMSNorm is a pow, a mean, an add,
an rsqrt, two multiplies and casts; rotary, the cache write and attention over the cache are two dozen
more. Each group below is one C++ call instead, computing the same numbers up to the order of float
additions:

    rms_norm(x, w)                 x / sqrt(mean(x^2) + eps) * w        (`rms_norm_reference`)
    add_rms_norm(x, r, w)          x += r; rms_norm(x, w)                (the residual add, then the next norm)
    layer_norm(x, w, b)            (x - mean) / sqrt(var + eps) * w + b  (`layer_norm_reference`)
    add_layer_norm(x, r, w, b)     x += r; layer_norm(x, w, b)
    gelu_tanh(x)                   F.gelu(x, approximate="tanh")         (GPT-2's activation)
    silu_mul(gate, up)             F.silu(gate) * up                     (SwiGLU's)
    decode_attention(qkv, ...)     one new query per row: rotary, cache write, attention over the
                                   filled slots              (`decode_attention_reference`)

`glasslm.generation.fast` composes them, with the model's own linear layers, into a decoding step.

Example:
    >>> import torch
    >>> x, w = torch.randn(2, 8), torch.randn(8)
    >>> ops = decode_ops()
    >>> ops is None or torch.allclose(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), atol=1e-6)
    True
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from glasslm.core.attention import scaled_dot_product_attention
from glasslm.kernels.qmatmul import kernel_ops


# --- the readable definitions -------------------------------------------------------------------

def rms_norm_reference(x: Float[Tensor, "... d"], weight: Float[Tensor, "d"], eps: float,
                       unit_offset: bool = False) -> Float[Tensor, "... d"]:
    """x / sqrt(mean(x^2) + eps), times weight (or 1 + weight), in float32: core.layers.RMSNorm's maths."""
    normed = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return normed * (1.0 + weight if unit_offset else weight)


def layer_norm_reference(x: Float[Tensor, "... d"], weight: Float[Tensor, "d"], bias: Float[Tensor, "d"] | None,
                         eps: float) -> Float[Tensor, "... d"]:
    """(x - mean) / sqrt(var + eps) * weight (+ bias), the variance biased: core.layers.LayerNorm's maths."""
    mean = x.mean(dim=-1, keepdim=True)
    out = (x - mean) * torch.rsqrt(x.var(dim=-1, keepdim=True, unbiased=False) + eps) * weight
    return out if bias is None else out + bias


def rotate_pairs(x: Float[Tensor, "... d_head"], cos: Float[Tensor, "... half"],
                 sin: Float[Tensor, "... half"]) -> Float[Tensor, "... d_head"]:
    """Adjacent pairs (x[2i], x[2i+1]) of the first 2 * half features turned by the angles cos, sin
    (core.positions.RotaryPositions' rotation); the features past them pass unchanged."""
    dims = 2 * cos.shape[-1]
    pairs = x[..., :dims].unflatten(-1, (-1, 2))
    first, second = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((first * cos - second * sin, first * sin + second * cos), dim=-1).flatten(-2)
    return torch.cat([rotated, x[..., dims:]], dim=-1)


def decode_attention_reference(
    qkv: Float[Tensor, "batch width"], keys: Float[Tensor, "batch kv_heads slots d_head"],
    values: Float[Tensor, "batch kv_heads slots d_head"], slot: int, positions: Int[Tensor, "batch"],
    cos: Float[Tensor, "context half"] | None, sin: Float[Tensor, "context half"] | None, heads: int, kv_heads: int,
    scale: float, key_mask: Bool[Tensor, "batch slots"] | None = None, window: int = 0,
) -> Float[Tensor, "batch heads_d_head"]:
    """One new token per row: q, k, v split by head, q and k rotated by the row's position, k and v
    written into cache slot `slot`, and each query head attending over slots [0, slot] that
    `key_mask` leaves (and, with a sliding `window`, the last `window` of them): (batch, heads * d_head)."""
    batch, width = qkv.shape
    d_head = width // (heads + 2 * kv_heads)
    q, k, v = qkv.view(batch, heads + 2 * kv_heads, d_head).split([heads, kv_heads, kv_heads], dim=1)
    if cos is not None:
        c, s = cos[positions][:, None], sin[positions][:, None]  # (batch, 1, half): one angle row per batch row
        q, k = rotate_pairs(q, c, s), rotate_pairs(k, c, s)
    keys[:, :, slot], values[:, :, slot] = k, v
    seen = torch.ones(batch, slot + 1, dtype=torch.bool) if key_mask is None else key_mask[:, :slot + 1].clone()
    if window > 0:
        seen[:, :max(0, slot + 1 - window)] = False
    group = heads // kv_heads  # each kv head serves `group` consecutive query heads
    k_all = keys[:, :, :slot + 1].repeat_interleave(group, dim=1)
    v_all = values[:, :, :slot + 1].repeat_interleave(group, dim=1)
    z = scaled_dot_product_attention(q[:, :, None], k_all, v_all, seen[:, None, None], scale=scale)
    return z.reshape(batch, heads * d_head)


# --- the calls ----------------------------------------------------------------------------------

@functools.cache
def decode_ops() -> Any | None:
    """`torch.ops.glasslm_kernels` with these ops' fake kernels registered, or None without the extension."""
    ops = kernel_ops()
    if ops is not None:
        _register_fakes()
    return ops


def _register_fakes() -> None:
    """Output shapes without computing, so a compiled graph keeps each call as one node."""
    @torch.library.register_fake("glasslm_kernels::rms_norm")
    def _rms_norm(x, weight, eps, unit_offset):
        return torch.empty_like(x)

    @torch.library.register_fake("glasslm_kernels::add_rms_norm")
    def _add_rms_norm(x, residual, weight, eps, unit_offset):
        return torch.empty_like(x)

    @torch.library.register_fake("glasslm_kernels::layer_norm")
    def _layer_norm(x, weight, bias, eps):
        return torch.empty_like(x)

    @torch.library.register_fake("glasslm_kernels::add_layer_norm")
    def _add_layer_norm(x, residual, weight, bias, eps):
        return torch.empty_like(x)

    @torch.library.register_fake("glasslm_kernels::gelu_tanh")
    def _gelu_tanh(x):
        return torch.empty_like(x)

    @torch.library.register_fake("glasslm_kernels::silu_mul")
    def _silu_mul(gate, up):
        return torch.empty_like(gate)

    @torch.library.register_fake("glasslm_kernels::decode_attention")
    def _decode_attention(qkv, keys, values, slot, positions, cos, sin, heads, kv_heads, rotary_dims, scale,
                          key_mask, window):
        return qkv.new_empty((qkv.shape[0], heads * keys.shape[-1]))


def rms_norm(x: Float[Tensor, "... d"], weight: Float[Tensor, "d"], eps: float,
             unit_offset: bool = False) -> Float[Tensor, "... d"]:
    """`rms_norm_reference` in one C++ call (float32, contiguous x)."""
    return torch.ops.glasslm_kernels.rms_norm.default(x, weight, eps, unit_offset)


def add_rms_norm(x: Float[Tensor, "... d"], residual: Float[Tensor, "... d"], weight: Float[Tensor, "d"], eps: float,
                 unit_offset: bool = False) -> Float[Tensor, "... d"]:
    """x += residual (in place), then `rms_norm(x, weight)`, in one C++ call."""
    return torch.ops.glasslm_kernels.add_rms_norm.default(x, residual, weight, eps, unit_offset)


def layer_norm(x: Float[Tensor, "... d"], weight: Float[Tensor, "d"], bias: Tensor | None,
               eps: float) -> Float[Tensor, "... d"]:
    """`layer_norm_reference` in one C++ call (float32, contiguous x)."""
    return torch.ops.glasslm_kernels.layer_norm.default(x, weight, bias, eps)


def add_layer_norm(x: Float[Tensor, "... d"], residual: Float[Tensor, "... d"], weight: Float[Tensor, "d"],
                   bias: Tensor | None, eps: float) -> Float[Tensor, "... d"]:
    """x += residual (in place), then `layer_norm(x, weight, bias)`, in one C++ call."""
    return torch.ops.glasslm_kernels.add_layer_norm.default(x, residual, weight, bias, eps)


def gelu_tanh(x: Float[Tensor, "... d"]) -> Float[Tensor, "... d"]:
    """`F.gelu(x, approximate="tanh")` in one C++ call (float32, contiguous x)."""
    return torch.ops.glasslm_kernels.gelu_tanh.default(x)


def silu_mul(gate: Float[Tensor, "... d"], up: Float[Tensor, "... d"]) -> Float[Tensor, "... d"]:
    """`F.silu(gate) * up` in one C++ call (float32, contiguous, one shape)."""
    return torch.ops.glasslm_kernels.silu_mul.default(gate, up)


def decode_attention(
    qkv: Float[Tensor, "batch width"], keys: Float[Tensor, "batch kv_heads slots d_head"],
    values: Float[Tensor, "batch kv_heads slots d_head"], slot: int, positions: Int[Tensor, "batch"],
    cos: Tensor | None, sin: Tensor | None, heads: int, kv_heads: int, scale: float,
    key_mask: Bool[Tensor, "batch slots"] | None = None, window: int = 0,
) -> Float[Tensor, "batch heads_d_head"]:
    """`decode_attention_reference` in one C++ call (float32 operands; the cache's slot `slot` is written)."""
    rotary_dims = 0 if cos is None else 2 * cos.shape[-1]
    return torch.ops.glasslm_kernels.decode_attention.default(
        qkv, keys, values, slot, positions, cos, sin, heads, kv_heads, rotary_dims, scale, key_mask, window)
