"""glasslm's C++ block kernels against their readable definition (qmatmul.py), closed-form bounds and
llama.cpp's own quantizers, dequantizers and dot products; every CPU path this machine runs."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from glasslm.kernels import build
from glasslm.kernels.qmatmul import (
    QuantizedMatrix, activation_error_bound, activation_rows, dequantize_rows, float_error_bound, kernel_ops,
    ONE_PASS_ROWS, lookup_rows, pack, pack_floats, panel_block_bytes, prefill_activations, qlinear,
    qmatmul, qmatmul_reference, quantize_block_rows, quantize_rows_reference, set_prefill_activations,
    summation_error_bound, unpack, unpack_levels,
)
from glasslm.transforms.ggml import FORMATS, block_matrix, quantize_blocks

pytestmark = pytest.mark.skipif(kernel_ops() is None, reason="glasslm's C++ kernels could not be built here")

PATHS = ["scalar", "avx2", "avx512"]


@pytest.fixture(params=PATHS)
def isa(request):
    """Each code path in turn (the ones above this CPU's are skipped)."""
    if request.param not in build.supported_isas():
        pytest.skip(f"this CPU has no {request.param}")
    with build.use_isa(request.param):
        yield request.param


def matrix_of(kind: str, d_out: int = 40, d_in: int = 512, seed: int = 0) -> QuantizedMatrix:
    """Random levels in each format the layers use, with scales and minimums of mixed signs and sizes
    (the K-quants: integer sub-scales of fp16 super-scales, over two super-blocks at d_in 512)."""
    g = torch.Generator().manual_seed(seed)
    bits = {"q8_0": 8, "int8": 8, "q5_0": 5, "q5_1": 5, "q5_k": 5, "q6_k": 6}.get(kind, 4)
    levels = torch.randint(0, 2**bits, (d_out, d_in), generator=g, dtype=torch.uint8)
    offset = {"q4_0": 8, "q8_0": 128, "int4": 8, "int8": 128, "q5_0": 16, "q6_k": 32}.get(kind, 0)
    row_sizes = torch.logspace(-3, 0, d_out)[:, None]
    if kind in ("q4_k", "q5_k", "q6_k"):
        group = 16 if kind == "q6_k" else 32
        if kind == "q6_k":
            scales = torch.randint(-128, 128, (d_out, d_in // group), generator=g, dtype=torch.int8)
        else:
            scales = torch.randint(0, 64, (d_out, d_in // group), generator=g, dtype=torch.uint8)
        supers = (torch.rand(d_out, d_in // 256, generator=g) * row_sizes / 60).half()
        mins = torch.randint(0, 64, scales.shape, generator=g, dtype=torch.uint8) if kind != "q6_k" else None
        super_mins = None if mins is None else -(torch.rand(d_out, d_in // 256, generator=g) * 0.1 / 60).half()
        return QuantizedMatrix(levels, scales, mins, bits, offset, group, None, supers, super_mins)
    group = {"int4": 64, "int8": d_in}.get(kind, 32)
    dtype = torch.bfloat16 if kind == "int4" else torch.float16
    scales = (torch.rand(d_out, d_in // group, generator=g) * row_sizes).to(dtype)
    mins = (torch.randn(d_out, d_in // group, generator=g) * 0.1).to(dtype) if kind in ("q4_1", "q5_1", "int4") else None
    if kind == "int8":
        scales = torch.ones_like(scales)
    row_scale = torch.rand(d_out, generator=g) + 0.01 if kind == "int8" else None
    return QuantizedMatrix(levels, scales, mins, bits, offset, group, row_scale)


KINDS = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "int4", "int8"]


def activations(rows: int, d_in: int = 512, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d_in, generator=g) * torch.logspace(-2, 1, d_in)[torch.randperm(d_in, generator=g)]
    x[0, 40:72] = 0.0  # a block of zeros: scale 0 must not divide by zero
    x[-1, 100] = 50.0  # an outlier widens its block's step
    return x


@pytest.mark.parametrize("kind", KINDS)
def test_pack_lays_out_every_level_and_unpack_restores_it(kind):
    matrix = matrix_of(kind, d_out=37)
    packed = pack(matrix)
    # 37 rows: three panels, the last cut short; as many bytes per weight as the levels' bits.
    assert packed.levels.shape == (3, 16, 16 * 32 * matrix.bits // 8) == (3, 16, panel_block_bytes(matrix.bits))
    assert torch.equal(unpack_levels(packed.levels, matrix.bits, 37), matrix.levels)
    # The first four inputs of row 1 sit in bytes 4..7 of block 0's first chunk (4 to 6 bits: the low
    # nibbles; their fifth bits in bit 0 of bytes 4..7 of the first plane, after the 256 nibble bytes).
    first = packed.levels[0, 0, 4:8]
    assert torch.equal(first if matrix.bits == 8 else first & 0x0F, matrix.levels[1, :4] & (0xFF if matrix.bits == 8 else 0x0F))
    if matrix.bits in (5, 6):
        assert torch.equal(packed.levels[0, 0, 260:264] & 1, (matrix.levels[1, :4] >> 4) & 1)


def test_activations_are_the_readable_rounding_bit_for_bit(isa):
    x = activations(5)
    x[3, :32] = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5] * 6 + [0.0, 127.0])  # exact halves: round to even
    reference = quantize_rows_reference(x)
    for got, want in zip(kernel_ops().quantize_rows(x), reference):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(reference[2], reference[0].float().reshape(10, -1, 32).sum(-1).to(torch.int32))
    q, d, _ = quantize_block_rows(x)
    assert q[3, :5].tolist() == [0, 2, 2, 0, -2]  # 0.5, 1.5, 2.5, -0.5, -2.5 at scale 1: half to even
    # The second pass rounds what the first left over in steps of dx / 256: x is then within half of that
    # step (a whole one where a leftover of exactly dx / 2 is cut to 127), plus the float32 rounding of
    # the leftover (x - xq * dx: two roundings, of 2^-24 of |x| at most).
    q2, d2, _ = quantize_rows_reference(x)
    assert torch.equal(q2[0::2], q) and torch.equal(d2[1::2], d / 256)
    gap = (x.double() - activation_rows(q2, d2)).abs().reshape(5, -1, 32)
    top = x.abs().reshape(5, -1, 32).amax(-1, keepdim=True).double()
    assert torch.all(gap <= d2[1::2, :, None].double() + 2**-23 * top) and gap.max() > 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 5, 9])  # tiles of 4 rows, and what is left over
def test_kernel_equals_the_readable_product_within_float_rounding(isa, kind, rows):
    matrix, x = matrix_of(kind), activations(rows)
    bias = torch.randn(40)
    reference = qmatmul_reference(*quantize_rows_reference(x), matrix, bias)
    got = qlinear(x, pack(matrix), bias)
    assert got.shape == (rows, 40) and got.dtype == torch.float32
    bound = float_error_bound(x, matrix)
    assert torch.all((got - reference).abs() <= bound)
    # The bound is tight enough to catch a real mistake: the weights one level off, or one pass left out.
    wrong = dataclasses.replace(matrix, offset=matrix.offset + 1)
    assert not torch.all((qmatmul_reference(*quantize_rows_reference(x), wrong, bias) - got).abs() <= bound)
    one_pass = qmatmul_reference(*quantize_block_rows(x), matrix, bias, passes=1)
    assert not torch.all((one_pass - got).abs() <= bound)
    # And against the float product: the activations' rounding, at most half a step per input.
    assert torch.all((got - F.linear(x, matrix.weight(), bias)).abs() <= activation_error_bound(x, matrix))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("passes", [2, 1])
def test_a_long_prefill_in_chunks_of_rows_gives_each_row_what_it_alone_gets(isa, kind, passes):
    """300 rows of 512 inputs go through in two chunks (256 KB of activations each: 256 rows, then
    44), their activations stored sixteen rows at a time, sixteen rows to a tile on AVX-512, twelve
    left over: each row's numbers are those it gets alone, with both passes or the first alone."""
    matrix, x = matrix_of(kind, d_out=40), activations(300)
    packed = pack(matrix)
    op = torch.ops.glasslm_kernels.qlinear.default
    together = op(x, *packed.operands(), None, passes)
    assert torch.equal(together, torch.cat([op(row[None], *packed.operands(), None, passes) for row in x]))


@pytest.mark.parametrize("kind", KINDS)
def test_int8_prefill_activations_multiply_the_first_pass_alone(isa, kind):
    """prefill_activations("int8"): a product of ONE_PASS_ROWS rows or more is the readable one-pass
    product (llama.cpp's rounding of the activations) to float rounding, not the two-pass one; fewer
    rows (a decoding step) keep both passes; the setting is undone on leaving the block."""
    matrix, x = matrix_of(kind), activations(ONE_PASS_ROWS + 9)  # (two tiles of 16 rows, and what is left)
    packed = pack(matrix)
    bound = float_error_bound(x, matrix)
    one_pass = qmatmul_reference(*quantize_block_rows(x), matrix, passes=1)
    with prefill_activations("int8"):
        prompt, step = qlinear(x, packed), qlinear(x[:4], packed)
    assert torch.all((prompt - one_pass).abs() <= bound)
    both = qlinear(x, packed)
    assert torch.all((both - qmatmul_reference(*quantize_rows_reference(x), matrix)).abs() <= bound)
    assert not torch.all((prompt - both).abs() <= bound)
    assert torch.equal(step, both[:4])
    # One pass is still the float product to its rounding of the activations: half a step d1 per input.
    half_steps = quantize_block_rows(x)[1].repeat_interleave(32, dim=1) / 2  # (rows, d_in)
    assert torch.all((prompt - F.linear(x, matrix.weight())).abs()
                     <= half_steps @ matrix.weight().abs().T * 1.0001 + bound)
    with pytest.raises(ValueError, match="int16"):
        set_prefill_activations("int4")


@pytest.mark.parametrize("kind", KINDS)
def test_every_path_gives_each_row_what_it_alone_gets(kind):
    matrix, x = matrix_of(kind, d_out=70), activations(6)
    packed = pack(matrix)
    outs = {}
    for name in build.supported_isas():
        with build.use_isa(name):
            outs[name] = qlinear(x, packed)
            assert torch.equal(torch.cat([qlinear(row[None], packed) for row in x]), outs[name])
    # The paths add in different orders, each within the float bound of the readable product.
    reference = qmatmul_reference(*quantize_rows_reference(x), matrix)
    for out in outs.values():
        assert torch.all((out - reference).abs() <= float_error_bound(x, matrix))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 5, 40])  # (40 rows: PyTorch's product, on slices of rows converted)
def test_float_weights_multiply_float_rows_to_float_rounding(isa, dtype, rows):
    """fp16 / bf16 / float32 weights (GGUF F16, BF16, F32) against float32 rows: the float product of
    the weights' exact values, within float32 summation rounding, not the product of rows rounded to
    16 bits."""
    g = torch.Generator().manual_seed(2)
    weight = (torch.randn(70, 512, generator=g) * torch.logspace(-3, 0, 70)[:, None]).to(dtype)
    x, bias = activations(rows), torch.randn(70, generator=g)
    packed = pack_floats(weight)
    assert packed.levels is weight and unpack(packed) is weight  # (the matrix itself: nothing copied)
    got = qlinear(x, packed, bias)
    exact = F.linear(x.double(), weight.double(), bias.double())
    bound = 2 * (512 + 8) * 2**-24 * (x.double().abs() @ weight.double().abs().T + bias.double().abs())
    assert torch.all((got.double() - exact).abs() <= bound)
    if dtype != torch.float32:  # rows rounded to 16 bits first would be ~100x (fp16) to ~1000x (bf16) further off
        rounded_rows = F.linear(x.to(dtype).double(), weight.double(), bias.double())
        assert (got.double() - exact).abs().max() < 0.05 * (rounded_rows - exact).abs().max()
    # The packed table's rows, looked up in place, are the weights' exact values.
    ids = torch.tensor([69, 0, 17, 17])
    assert torch.equal(lookup_rows(packed, ids), weight[ids].float())


# --- llama.cpp's own code, through the libraries llama-cpp-python ships ------------------------

@pytest.fixture(scope="module")
def ggml():
    """llama.cpp's ggml base and CPU libraries (quantizers, dequantizers, dot products)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    folder = Path(llama_cpp.__file__).parent / "lib"
    base, cpu = ctypes.CDLL(str(folder / "libggml-base.so")), ctypes.CDLL(str(folder / "libggml-cpu.so"))
    cpu.ggml_cpu_init()
    return base, cpu


def _floats(a: np.ndarray):
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


FORMAT_NAMES = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k"]


@pytest.mark.parametrize("qtype", FORMAT_NAMES)
def test_the_cpp_packer_lays_out_any_bytes_as_the_readable_pack_does(isa, qtype):
    """Every bit pattern a file may hold (random bytes: all levels, high bits and sub-scales), 37 rows
    (a last panel of 5): the C++ packer, which forms the packed bytes from the file's own without
    decoding a level at a time, lays out exactly what pack(block_matrix(...)) does, on each path (the
    K-quants' high bit planes are made with AVX2 where there is AVX2)."""
    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (37, 2 * FORMATS[qtype].bytes), dtype=torch.uint8, generator=g)
    packed, readable = kernel_ops().pack_ggml(blocks, qtype), pack(block_matrix(blocks, qtype))
    for got, want in zip(packed, (readable.levels, readable.scales, readable.mins, readable.super_scales,
                                  readable.super_mins)):  # (as bytes: a NaN scale is equal to no value)
        assert (got is None and want is None) or (
            got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_float_weight_rows_product_does_not_depend_on_the_rows_beside_it(isa, dtype):
    """Float weights are multiplied one dot product per (weight row, activation row), in the same order
    whatever tile the two fall in (1-4 activation rows; 4, 2 or 1 weight rows; the last panel's 6 rows),
    so each row of a product of up to 31 rows is bit for bit that row's product alone: a prompt's
    last rows and a decoding step give the same numbers. Each within float rounding of the float product."""
    g = torch.Generator().manual_seed(4)
    weight = (torch.randn(38, 96, generator=g) * 3).to(dtype)
    packed, x = pack_floats(weight), torch.randn(31, 96, generator=g)
    together = qlinear(x, packed)
    alone = torch.cat([qlinear(x[i:i + 1], packed) for i in range(31)])
    assert torch.equal(together, alone)
    for count in (2, 3, 4, 7):
        assert torch.equal(qlinear(x[:count], packed), together[:count])
    exact = x.double() @ weight.double().T
    assert torch.all((together.double() - exact).abs() <= 2 * 96 * 2**-24 * (x.double().abs() @ weight.double().abs().T))


def _ggml_name(qtype: str) -> str:
    return qtype.replace("_k", "_K")  # ggml spells the K-quants q4_K


def _bytes_of(a: np.ndarray):
    return a.ctypes.data_as(ctypes.c_void_p)


def ggml_quantize(base, weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """llama.cpp's own reference quantizer's bytes for `weight` (quantize_row_*_ref)."""
    fmt, (rows, d_in) = FORMATS[qtype], weight.shape
    out = np.zeros((rows, d_in // fmt.inputs * fmt.bytes), dtype=np.uint8)
    values = np.ascontiguousarray(weight.numpy())
    for r in range(rows):
        getattr(base, f"quantize_row_{_ggml_name(qtype)}_ref")(_floats(values[r]), _bytes_of(out[r]), ctypes.c_int64(d_in))
    return torch.from_numpy(out)


def ggml_dequantize(base, blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    fmt = FORMATS[qtype]
    rows, d_in = blocks.shape[0], blocks.shape[1] // fmt.bytes * fmt.inputs
    out = np.zeros((rows, d_in), dtype=np.float32)
    data = np.ascontiguousarray(blocks.numpy())
    for r in range(rows):
        getattr(base, f"dequantize_row_{_ggml_name(qtype)}")(_bytes_of(data[r]), _floats(out[r]), ctypes.c_int64(d_in))
    return torch.from_numpy(out)


def ggml_activations(base, x: torch.Tensor, kind: str):
    """llama.cpp's own int8 rows (q8_0; q8_1 with its fp16 d * sum; q8_K, a float32 d per 256 inputs),
    and as glasslm's one-pass activations in blocks of 32: (bytes, q, d, sums)."""
    rows, d_in = x.shape
    inputs, size, header = {"q8_0": (32, 34, 2), "q8_1": (32, 36, 4), "q8_K": (256, 292, 4)}[kind]
    out = np.zeros((rows, d_in // inputs * size), dtype=np.uint8)
    values = np.ascontiguousarray(x.numpy())
    for r in range(rows):
        getattr(base, f"quantize_row_{kind}_ref")(_floats(values[r]), _bytes_of(out[r]), ctypes.c_int64(d_in))
    blocks = torch.from_numpy(out).reshape(rows, -1, size)
    if kind == "q8_K":  # d (float32) | 256 x int8 | 16 x int16 sums: the same d for each of its 32-blocks
        d = blocks[..., :4].contiguous().view(torch.float32)[..., 0].repeat_interleave(8, dim=1)
        q = blocks[..., 4:260].contiguous().view(torch.int8)
    else:
        d = blocks[..., :2].contiguous().view(torch.float16)[..., 0].float()
        q = blocks[..., header:].contiguous().view(torch.int8)
    q = q.reshape(rows, d_in)
    return out, q, d, q.reshape(rows, -1, 32).sum(-1, dtype=torch.int32)


@pytest.mark.parametrize("qtype", FORMAT_NAMES)
def test_weights_are_llama_cpps_dequantized_blocks_bit_for_bit(ggml, qtype):
    """llama.cpp's quantizer writes the blocks; glasslm's reading of them (levels, scales, minimums,
    super-scales) is ggml's dequantizer bit for bit, and the C++ packer lays out the same bytes as pack()."""
    torch.manual_seed(0)
    weight = torch.randn(40, 512) * torch.logspace(-3, 1, 40)[:, None]
    weight[3] = weight[3].abs() + 0.5  # a minimum far from zero
    blocks = ggml_quantize(ggml[0], weight, qtype)
    if qtype in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0"):
        assert torch.equal(blocks, quantize_blocks(weight, qtype))  # the gguf package writes the same bytes
    matrix = block_matrix(blocks, qtype)
    assert torch.equal(matrix.weight(), ggml_dequantize(ggml[0], blocks, qtype))
    packed, readable = kernel_ops().pack_ggml(blocks, qtype), pack(matrix)
    for got, want in zip(packed, (readable.levels, readable.scales, readable.mins, readable.super_scales,
                                  readable.super_mins)):
        assert (got is None and want is None) or (got.dtype == want.dtype and torch.equal(got, want))


def _ggml_dot(cpu, name: str, weights: np.ndarray, act_bytes: np.ndarray, d_in: int) -> torch.Tensor:
    """Every row of weights against every row of activations through ggml's vec_dot_* (its SIMD path)."""
    out = np.zeros((act_bytes.shape[0], weights.shape[0]), dtype=np.float32)
    dot = getattr(cpu, f"ggml_vec_dot_{name}")
    for r in range(act_bytes.shape[0]):
        for o in range(weights.shape[0]):
            dot(ctypes.c_int(d_in), _floats(out[r, o:]), ctypes.c_size_t(0), _bytes_of(weights[o]), ctypes.c_size_t(0),
                _bytes_of(act_bytes[r]), ctypes.c_size_t(0), ctypes.c_int(1))
    return torch.from_numpy(out)


@pytest.mark.parametrize("qtype", FORMAT_NAMES)
def test_kernel_equals_llama_cpps_dot_products_on_its_own_activations(ggml, isa, qtype):
    """Given llama.cpp's int8 activations, our integer sums are its integer sums: the outputs differ
    only by float rounding (and q4_1's / q5_1's fp16-rounded d * sum, which llama.cpp uses for the
    minimum). The K-quants' activations are q8_K: one float scale per 256 inputs."""
    base, cpu = ggml
    torch.manual_seed(0)
    weight, x = torch.randn(40, 512) * 0.1, activations(3)
    blocks = ggml_quantize(base, weight, qtype)
    act_kind = {"q4_1": "q8_1", "q5_1": "q8_1"}.get(qtype, "q8_K" if qtype.endswith("_k") else "q8_0")
    act_bytes, q, d, sums = ggml_activations(base, x, act_kind)
    matrix = block_matrix(blocks, qtype)
    ours = qmatmul(q, d, sums, pack(matrix), passes=1)
    theirs = _ggml_dot(cpu, f"{_ggml_name(qtype)}_{act_kind}", np.ascontiguousarray(blocks.numpy()), act_bytes, 512)
    bound = summation_error_bound(dequantize_rows(q, d).abs(), matrix, passes=1)
    if matrix.mins is not None and matrix.super_mins is None:  # m * fp16(d * sum) against our m * d * sum
        block_terms = (d * sums.float()).abs()[:, None, :] * matrix.mins.float().abs()[None, :, :]
        bound = bound + (2**-11 * block_terms).sum(-1)
    error = (ours - theirs).abs()
    assert torch.all(error <= bound)
    assert error.max() < 1e-3 * theirs.abs().max()


# --- compiling, errors, and the machine without a compiler ------------------------------------

def test_a_compiled_function_keeps_the_kernel_call_in_one_graph():
    matrix = matrix_of("q4_1", d_out=48)
    packed, bias = pack(matrix), torch.randn(48)

    def step(x):
        return torch.relu(qlinear(x * 2, packed, bias)) + 1

    compiled = torch.compile(step, fullgraph=True)  # a graph break would raise
    x = activations(1)
    assert torch.equal(compiled(x), step(x))


def test_wrong_operands_get_a_clear_error():
    packed = pack(matrix_of("q4_0", d_out=16))
    with pytest.raises(RuntimeError, match="input width 64 is not the weight's 512"):
        qlinear(torch.randn(1, 64), packed)
    with pytest.raises(RuntimeError, match="a row's width must be a multiple of 32"):
        qlinear(torch.randn(1, 250), packed)
    with pytest.raises(RuntimeError, match="scales must be fp16 or bf16, got Float"):
        kernel_ops().qlinear(torch.randn(1, 512), packed.levels, packed.scales.float(), None, None, None, 4, 8, 32, 0, 16,
                             None, None)
    with pytest.raises(RuntimeError, match="sub-scales must be uint8 or int8"):  # super-scales need integer sub-scales
        kernel_ops().qlinear(torch.randn(1, 512), packed.levels, packed.scales, None, packed.scales, None, 4, 8, 32, 8, 16,
                             None, None)
    with pytest.raises(RuntimeError, match="a group is 16 inputs or whole blocks of 32, got 24"):
        kernel_ops().qlinear(torch.randn(1, 512), packed.levels, packed.scales, None, None, None, 4, 8, 24, 0, 16, None, None)
    with pytest.raises(ValueError, match="groups of whole blocks"):
        pack(QuantizedMatrix(torch.zeros(4, 48, dtype=torch.uint8), torch.ones(4, 1).half(), None, 4, 8, 48))


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_without_a_compiler_one_line_says_so_and_the_layers_run_pytorchs_kernels(tmp_path):
    code = ("import torch; from glasslm.transforms.ggml import BlockLinear; "
            "layer = BlockLinear.from_weight(torch.randn(16, 64), None, 'q4_1'); "
            "print(type(layer._kernel_operands()).__name__, tuple(layer(torch.randn(1, 64)).shape))")
    done = _python(code, CXX="/nonexistent/c++", TORCH_EXTENSIONS_DIR=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["tuple", "(1,", "16)"]  # PyTorch's int4 kernel's operands
    lines = [line for line in done.stderr.splitlines() if "glasslm" in line]
    assert len(lines) == 1 and "could not be built" in lines[0] and "GLASSLM_KERNELS=off" in lines[0]
    off = _python("from glasslm.kernels import build; print(build.load())", GLASSLM_KERNELS="off")
    assert off.stdout.strip() == "None" and off.stderr == ""
    wrong = _python("from glasslm.kernels import build; build.load()", GLASSLM_KERNELS="sse9")
    assert "GLASSLM_KERNELS='sse9': choose one of scalar, avx2, avx512 or off" in wrong.stderr
