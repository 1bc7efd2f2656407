"""The decoding step's C++ kernels (kernels/decode.cpp) against their readable definitions
(kernels/decode.py), and those against the readable core's own modules, on every path the CPU has."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from glasslm.core.attention import scaled_dot_product_attention
from glasslm.core.layers import LayerNorm, RMSNorm
from glasslm.core.positions import RotaryPositions
from glasslm.kernels import build
from glasslm.kernels.decode import (
    add_layer_norm, add_rms_norm, decode_attention, decode_attention_reference, decode_ops, gelu_tanh, layer_norm,
    layer_norm_reference, rms_norm, rms_norm_reference, silu_mul,
)

pytestmark = pytest.mark.skipif(decode_ops() is None, reason="the C++ kernels are not built here")
PATHS = build.supported_isas() if decode_ops() is not None else []


def float_tolerance(terms: torch.Tensor, n: int) -> float:
    """Two float32 sums of n terms in different orders differ by at most ~2 n 2^-24 of the terms' magnitudes."""
    return 2 * (n + 8) * 2**-24 * float(terms.abs().max())


@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_equals_the_readable_core_norm(unit_offset):
    torch.manual_seed(0)
    norm = RMSNorm(96, eps=1e-5, impl="readable", unit_offset=unit_offset)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 1, 96) * 4
    expected = norm(x).detach()
    torch.testing.assert_close(rms_norm_reference(x, norm.weight.detach(), 1e-5, unit_offset), expected)
    torch.testing.assert_close(rms_norm(x, norm.weight.detach(), 1e-5, unit_offset), expected, rtol=4e-7, atol=0)


@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_equals_the_readable_core_norm(bias):
    torch.manual_seed(2)
    norm = LayerNorm(96, eps=1e-5, bias=bias, impl="readable")
    with torch.no_grad():
        for parameter in norm.parameters():
            parameter.normal_()
    x = torch.randn(3, 1, 96) * 4 + 3  # a mean far from zero, as a residual stream has
    expected = norm(x).detach()
    b = norm.bias.detach() if bias else None
    torch.testing.assert_close(layer_norm_reference(x, norm.weight.detach(), b, 1e-5), expected)
    scale = float(expected.abs().max())  # (x - mean) * inverse * w + b: a few roundings of the largest output
    torch.testing.assert_close(layer_norm(x, norm.weight.detach(), b, 1e-5), expected, rtol=0, atol=8 * 2**-24 * scale)
    torch.testing.assert_close(F.layer_norm(x, (96,), norm.weight.detach(), b, 1e-5), expected, rtol=0,
                               atol=8 * 2**-24 * scale)


def test_add_layer_norm_adds_in_place_then_normalises():
    torch.manual_seed(4)
    x, residual, weight, bias = torch.randn(2, 1, 64), torch.randn(2, 1, 64), torch.randn(64), torch.randn(64)
    total = x + residual
    out = add_layer_norm(x, residual, weight, bias, 1e-5)
    assert torch.equal(x, total)
    torch.testing.assert_close(out, layer_norm_reference(total, weight, bias, 1e-5), rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="bias has 3 features, x has 64"):
        layer_norm(total, weight, torch.zeros(3), 1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_activations_equal_torchs_own(path):
    """GELU's tanh form and SiLU(gate) * up against torch's functions, over the whole float range a
    step meets (large negative and positive inputs included, a width that is no multiple of 16)."""
    torch.manual_seed(5)
    x = torch.cat([torch.randn(3, 1000) * 4, torch.linspace(-120, 120, 3 * 37).reshape(3, 37)], dim=1)
    up, before = torch.randn_like(x), x.clone()
    with build.use_isa(path):
        got_gelu, got_silu = gelu_tanh(x), silu_mul(x, up)
    want_gelu, want_silu = F.gelu(x, approximate="tanh"), F.silu(x) * up
    # a few float32 steps of each value, and of 1 where tanh's 1 - 2 / (e^2u + 1) cancels near zero
    torch.testing.assert_close(got_gelu, want_gelu, rtol=8 * 2**-24, atol=4 * 2**-24)
    torch.testing.assert_close(got_silu, want_silu, rtol=8 * 2**-24, atol=2**-126)
    assert torch.equal(x, before)  # the ops return new tensors


def test_add_rms_norm_adds_in_place_then_normalises():
    torch.manual_seed(1)
    x, residual, weight = torch.randn(2, 1, 64), torch.randn(2, 1, 64), torch.randn(64)
    total = x + residual
    out = add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(x, total)  # the stream itself now holds the sum
    torch.testing.assert_close(out, rms_norm_reference(total, weight, 1e-6), rtol=4e-7, atol=0)


def test_the_readable_attention_definition_is_the_core_rotary_and_attention():
    """decode_attention_reference (written for the kernels) against RotaryPositions and the core's
    scaled_dot_product_attention over a cache built by hand, as CausalSelfAttention decodes."""
    torch.manual_seed(2)
    heads, kv_heads, d_head, slot = 4, 2, 16, 6
    rotary = RotaryPositions(32, d_head, theta=500.0)
    qkv = torch.randn(1, (heads + 2 * kv_heads) * d_head)
    keys, values = torch.randn(1, kv_heads, 10, d_head), torch.randn(1, kv_heads, 10, d_head)
    position = torch.tensor([slot])
    q, k, v = qkv.view(1, -1, 1, d_head).split([heads, kv_heads, kv_heads], dim=1)  # (1, heads, 1, d_head)
    k_rot = rotary(k, position)
    expected_keys = torch.cat([keys[:, :, :slot], k_rot, keys[:, :, slot + 1:]], dim=2)
    all_keys = torch.cat([keys[:, :, :slot], k_rot], dim=2).repeat_interleave(2, dim=1)
    all_values = torch.cat([values[:, :, :slot], v], dim=2).repeat_interleave(2, dim=1)
    expected = scaled_dot_product_attention(rotary(q, position), all_keys, all_values).reshape(1, -1)
    got = decode_attention_reference(qkv, keys, values, slot, position, rotary.cos, rotary.sin, heads, kv_heads,
                                     1 / math.sqrt(d_head))
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(keys, expected_keys)


CASES = {  # heads, kv_heads, d_head, rotary dims (0: none), batch, masked, window
    "grouped heads, rotary": (8, 2, 64, 64, 1, False, 0),
    "partial rotary, two rows, padding": (4, 4, 32, 16, 2, True, 0),
    "sliding window, padding": (6, 3, 48, 48, 3, True, 5),
    "no rotary, odd width": (3, 1, 20, 0, 2, False, 0),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES)
def test_decode_attention_equals_its_readable_definition(case, path):
    heads, kv_heads, d_head, rotary_dims, batch, masked, window = CASES[case]
    generator = torch.Generator().manual_seed(len(case))
    slots, slot = 40, 29
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * d_head, generator=generator) * 2
    keys, values = (torch.randn(batch, kv_heads, slots, d_head, generator=generator) for _ in range(2))
    angles = torch.rand(64, max(rotary_dims, 2) // 2, generator=generator) * 6
    cos, sin = (torch.cos(angles), torch.sin(angles)) if rotary_dims else (None, None)
    positions = torch.randint(0, 64, (batch,), generator=generator)
    mask = None
    if masked:  # left padding of a different length in each row (slot itself always real)
        pads = torch.randint(0, slot, (batch,), generator=generator)
        mask = torch.arange(slots)[None, :] >= pads[:, None]
    ref_keys, ref_values = keys.clone(), values.clone()
    expected = decode_attention_reference(qkv, ref_keys, ref_values, slot, positions, cos, sin, heads, kv_heads,
                                          0.3, mask, window)
    with build.use_isa(path):
        got = decode_attention(qkv, keys, values, slot, positions, cos, sin, heads, kv_heads, 0.3, mask, window)
    assert torch.equal(values, ref_values)
    torch.testing.assert_close(keys, ref_keys, rtol=0, atol=float_tolerance(qkv, 2))
    torch.testing.assert_close(got, expected, rtol=0, atol=float_tolerance(values, slots) * 4)


def test_a_full_cache_and_bad_operands_are_clear_errors():
    qkv, cache = torch.randn(1, 3 * 16), torch.zeros(1, 1, 4, 16)
    position = torch.tensor([0])
    with pytest.raises(RuntimeError, match="KV cache is full"):
        decode_attention(qkv, cache, cache.clone(), 4, position, None, None, 1, 1, 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        decode_attention(qkv.double(), cache, cache.clone(), 0, position, None, None, 1, 1, 1.0)
    with pytest.raises(RuntimeError, match="positions"):
        decode_attention(qkv, cache, cache.clone(), 0, torch.tensor([0, 1]), None, None, 1, 1, 1.0)


def test_the_ops_schemas_and_fake_kernels_hold_for_the_compiler():
    """torch.library.opcheck: the declared mutations (the cache, the stream) and the fake kernels'
    shapes agree with what the C++ ops do, so a compiled graph can hold them."""
    torch.manual_seed(3)
    x, weight = torch.randn(2, 1, 32), torch.randn(32)
    torch.library.opcheck(torch.ops.glasslm_kernels.rms_norm.default, (x, weight, 1e-5, False))
    torch.library.opcheck(torch.ops.glasslm_kernels.add_rms_norm.default, (x.clone(), x, weight, 1e-5, True))
    torch.library.opcheck(torch.ops.glasslm_kernels.layer_norm.default, (x, weight, torch.randn(32), 1e-5))
    torch.library.opcheck(torch.ops.glasslm_kernels.gelu_tanh.default, (x,))
    torch.library.opcheck(torch.ops.glasslm_kernels.silu_mul.default, (x, x * 2))
    torch.library.opcheck(torch.ops.glasslm_kernels.add_layer_norm.default, (x.clone(), x, weight, None, 1e-5))
    cos, sin = torch.rand(16, 4), torch.rand(16, 4)
    args = (torch.randn(2, 4 * 8), torch.randn(2, 1, 6, 8), torch.randn(2, 1, 6, 8), 3, torch.tensor([3, 1]),
            cos, sin, 2, 1, 8, 0.5, torch.ones(2, 6, dtype=torch.bool), 0)
    torch.library.opcheck(torch.ops.glasslm_kernels.decode_attention.default, args)
