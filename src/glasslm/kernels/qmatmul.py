"""Matrix products with int8 activations and 4- or 8-bit block weights: the readable definition of
the C++ kernels beside this file (qmatmul.cpp), their packed weight layout, and the calls into them.

This is how llama.cpp multiplies its quantized weights, and why it is fast on a CPU: a decoding step
reads every weight once, so the bytes per weight set the speed, and the arithmetic must keep up with
the memory. Both operands are small integers, so the products run as integer dot products (VNNI's
vpdpbusd does 64 byte products per instruction) and only one float multiply-add per block of 32
inputs remains.

Activations. Each row of x is cut into blocks of 32 inputs; a block b keeps one float32 scale and
its inputs rounded to int8 (`quantize_block_rows`):

    dx_b = max_i |x_i| / 127        xq_i = round(x_i / dx_b)  in -127..127        s_b = sum_i xq_i

llama.cpp stops there, and its int8 activations move a small model's logits by up to ~1 (SmolLM2's,
of ~25: enough to change greedy answers where two tokens nearly tie). glasslm also rounds what that
left over, x - dx * xq (at most dx / 2 per input), to int8 with the step dx / 256: each input is then
dx / 256 * (256 * xq + xq2), a 16-bit integer kept as two bytes, good to 1/256 of a step (logits to
~0.005), for twice the integer products but not one more byte of weights, which is what decoding
waits for (`quantize_rows_reference` gives the two int8 rows of each row).

Weights. A `QuantizedMatrix` holds unsigned levels u of 4, 5, 6 or 8 bits (0..15, 0..31, 0..63,
or 0..255 for 8-bit weights stored as w + 128), a scale per group of inputs (one group being one or
more blocks, or half a block) and optionally a minimum, and stands for

    W[o, i] = ((u[o, i] - offset) * scale[o, g] + min[o, g]) * row_scale[o]        g = i // group_size

A group's scale and minimum are fp16 or bf16 numbers, or, in llama.cpp's K-quants, small integers
times an fp16 scale shared by a super-block of 256 inputs (`super_scales`, `super_mins`):

    scale[o, g] = sub_scale[o, g] * super_scale[o, i // 256]        (exact in float32)

That covers every format glasslm runs: llama.cpp's Q4_0 (offset 8), Q4_1 (offset 0, min m), Q5_0
(5 bits, offset 16), Q5_1 (5 bits, min m), Q8_0 (offset 128) with fp16 block scales; its K-quants
Q4_K and Q5_K (4 or 5 bits, 6-bit sub-scales and sub-minimums per 32 inputs, the minimums' super
scale -dmin) and Q6_K (6 bits, offset 32, int8 sub-scales per 16 inputs: two groups a block);
glasslm's int4 (offset 8, min = its bf16 zero, groups of 64) and int8 (offset 128, scale 1, its
float32 per-row scale as row_scale).

Product. Within a block both operands are integers, so

    y[o] = row_scale[o] * sum_b [ scale * dx_b * (sum_i u_i xq_i - offset * s_b) + min * dx_b * s_b ] + bias[o]

with the bracket computed exactly in int32 (for the two bytes, xq stands for 256 * xq + xq2 and dx
for dx / 256). `qmatmul_reference` is that sum written as a float
matmul of the dequantized operands; the kernels differ from it only in the order float32 adds
happen (`float_error_bound`), and from the float product x @ W.T by the activations' rounding,
at most half a step per input (`activation_error_bound`).

Float weights (fp16, bf16 or float32: a GGUF file's F16, BF16 and F32 tensors) are kept as the
(d_out, d_in) matrix they are, no levels, no scales, no panels (`pack_floats`), so a loader can hand a
layer a view of the mapped file and copy nothing. The kernels multiply float32 rows by the weights
converted to float32 in registers, one dot product per weight row and activation row, so the product
is the float one, to the order of float additions; from `FLOAT_BLAS_ROWS` rows on (a prompt) PyTorch's
BLAS product does it, on float32 copies of a slice of rows at a time.

Packed layout (`pack`). The kernels read 16 output rows at once: a panel. For each panel and block,
the 16 x 32 levels are stored as eight chunks k = 0..7 of 64 bytes, byte 4 * row + t of chunk k
holding input 4k + t of that row, so one 32-bit lane is four inputs of one row and one broadcast of
four activations meets all 16 rows. 4-bit levels put chunks k and k + 4 in the low and high nibbles
of the same 64 bytes (256 bytes per panel and block, as many as the GGUF file's nibbles). 5- and
6-bit levels keep their low four bits so and add one 64-byte plane per higher bit, bit k of its byte
4 * row + t being that bit of chunk k's byte (320 or 384 bytes: again the file's own count). Scales,
minimums and super-scales become (panels, groups, 16). Rows past d_out are zero.

Example:
    >>> import torch
    >>> matrix = QuantizedMatrix.from_float(torch.randn(40, 64), bits=8)
    >>> x = torch.randn(3, 64)
    >>> y = qmatmul_reference(*quantize_rows_reference(x), matrix)
    >>> bool(((y - x @ matrix.weight().T).abs() <= activation_error_bound(x, matrix)).all())
    True
    >>> ops = kernel_ops()
    >>> ops is None or bool(((qlinear(x, pack(matrix)) - y).abs() <= float_error_bound(x, matrix)).all())
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int, UInt8
from torch import Tensor

from glasslm.kernels import build

BLOCK = 32  # inputs per block
SUPER_BLOCK = 256  # inputs per super-block (llama.cpp's K-quants)
PANEL = 16  # output rows per panel
PASSES = 2  # int8 rows per activation row: its rounding, and the rounding of what that left over
SECOND_STEP = 1 / 256  # the second row's scale, relative to the first's


# --- activations --------------------------------------------------------------------------------

def quantize_block_rows(
    x: Float[Tensor, "... d_in"],
) -> tuple[Int[Tensor, "rows d_in"], Float[Tensor, "rows blocks"], Int[Tensor, "rows blocks"]]:
    """(xq int8, dx float32, s int32) of every row of x, in blocks of 32 (one pass; llama.cpp's rounding)."""
    d_in = x.shape[-1]
    if d_in % BLOCK:
        raise ValueError(f"rows are quantized in blocks of {BLOCK}; a width of {d_in} does not divide")
    blocks = x.detach().float().reshape(-1, d_in // BLOCK, BLOCK)  # (rows, blocks, 32)
    scale = blocks.abs().amax(dim=-1) / 127
    # Multiplying by the inverse (not dividing by the scale) is what the kernels do: same bits.
    inverse = torch.where(scale != 0, 1 / scale, torch.zeros_like(scale))
    levels = torch.round(blocks * inverse[..., None]).clamp(-127, 127)  # half to even
    return levels.to(torch.int8).reshape(-1, d_in), scale, levels.sum(dim=-1).to(torch.int32)


def quantize_rows_reference(
    x: Float[Tensor, "... d_in"],
) -> tuple[Int[Tensor, "passes_rows d_in"], Float[Tensor, "passes_rows blocks"], Int[Tensor, "passes_rows blocks"]]:
    """The kernels' activations, bit for bit: for row r of x, int8 rows 2r (x rounded) and 2r + 1
    (what that left over, x - xq * dx, rounded to steps of dx / 256)."""
    rows = x.detach().float().reshape(-1, x.shape[-1])
    q, d, s = quantize_block_rows(rows)
    left = (rows - dequantize_rows(q, d)).reshape(rows.shape[0], -1, BLOCK)  # at most d / 2 per input
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d)) * 256
    q2 = torch.round(left * inverse[..., None]).clamp(-127, 127)   # (only a tie at d / 2 exactly is cut)
    d2, s2 = d * SECOND_STEP, q2.sum(dim=-1).to(torch.int32)
    q2 = q2.to(torch.int8).reshape(rows.shape)
    return tuple(torch.stack(pair, dim=1).flatten(0, 1) for pair in ((q, q2), (d, d2), (s, s2)))


def dequantize_rows(q: Int[Tensor, "rows d_in"], d: Float[Tensor, "rows blocks"]) -> Float[Tensor, "rows d_in"]:
    """The float rows int8 blocks stand for: xq * dx per block."""
    rows, d_in = q.shape
    return (q.float().reshape(rows, -1, BLOCK) * d[..., None]).reshape(rows, d_in)


def activation_rows(q: Int[Tensor, "passes_rows d_in"], d: Float[Tensor, "passes_rows blocks"],
                    passes: int = PASSES, magnitude: bool = False) -> Float[Tensor, "rows d_in"]:
    """The rows of x the activations stand for (each the sum of its `passes` int8 rows), in float64:
    exact (a sum of two floats 2^8 apart in size fits float64's 53 bits). With `magnitude`, the sum of
    the passes' absolute values instead (what the kernels' float terms add up to, for error bounds)."""
    rows, d_in = q.shape
    values = q.double().reshape(rows, -1, BLOCK) * d.double()[..., None]
    values = values.abs() if magnitude else values
    return values.reshape(rows // passes, passes, d_in).sum(dim=1)


# --- weights ------------------------------------------------------------------------------------

@dataclass
class QuantizedMatrix:
    """W = ((levels - offset) * scale + min) * row_scale, per group of `group_size` inputs (readable form)."""

    levels: UInt8[Tensor, "d_out d_in"]        # unsigned: below 2**bits
    scales: Tensor                             # (d_out, d_in / group_size): fp16 or bf16, or integer sub-scales
    mins: Tensor | None                        # like scales, or None (0)
    bits: int                                  # 4, 5, 6 or 8
    offset: int
    group_size: int = BLOCK                    # 16, or a multiple of 32
    row_scale: Float[Tensor, "d_out"] | None = None
    super_scales: Tensor | None = None         # (d_out, d_in / super_size) fp16: scales are int8/uint8 multiples of these
    super_mins: Tensor | None = None           # the same for mins
    super_size: int = SUPER_BLOCK

    def group_values(self) -> tuple[Float[Tensor, "d_out groups"], Float[Tensor, "d_out groups"] | None]:
        """(scale, min) of every group as float32: a sub-scale times its super-scale is exact (an 8-bit
        integer times an fp16 number needs at most 19 of float32's 24 bits)."""
        def value(sub: Tensor | None, per_super: Tensor | None) -> Tensor | None:
            if sub is None or per_super is None:
                return None if sub is None else sub.float()
            return sub.float() * per_super.float().repeat_interleave(self.super_size // self.group_size, dim=1)

        return value(self.scales, self.super_scales), value(self.mins, self.super_mins)

    def weight(self) -> Float[Tensor, "d_out d_in"]:
        """The float32 matrix: every product and sum below is exact in float32 but the last rounding."""
        d_out, d_in = self.levels.shape
        scales, mins = self.group_values()
        q = (self.levels.float() - self.offset).reshape(d_out, -1, self.group_size)   # (d_out, groups, size)
        weight = q * scales[..., None]
        if mins is not None:
            weight = weight + mins[..., None]
        weight = weight.reshape(d_out, d_in)
        return weight if self.row_scale is None else weight * self.row_scale.float()[:, None]

    def magnitude(self) -> Float[Tensor, "d_out d_in"]:
        """|levels - offset| * |scale| + |min| (times |row_scale|): a bound on every term the
        kernels add for one weight, which can exceed |W| where scale and min nearly cancel."""
        d_out, d_in = self.levels.shape
        scales, mins = self.group_values()
        q = (self.levels.float() - self.offset).abs().reshape(d_out, -1, self.group_size)
        size = q * scales.abs()[..., None]
        if mins is not None:
            size = size + mins.abs()[..., None]
        size = size.reshape(d_out, d_in)
        return size if self.row_scale is None else size * self.row_scale.float().abs()[:, None]

    @classmethod
    def from_float(cls, weight: Float[Tensor, "d_out d_in"], bits: int = 4) -> QuantizedMatrix:
        """A symmetric block quantization of `weight` (fp16 scale per block of 32), for examples and tests."""
        top = 7 if bits == 4 else 127
        blocks = weight.detach().float().reshape(weight.shape[0], -1, BLOCK)
        scales = (blocks.abs().amax(dim=-1) / top).to(torch.float16)
        q = torch.round(blocks / scales.float().clamp_min(1e-30)[..., None]).clamp(-top, top)
        offset = 8 if bits == 4 else 128
        return cls((q + offset).to(torch.uint8).reshape(weight.shape), scales, None, bits, offset)


def qmatmul_reference(q: Int[Tensor, "passes_rows d_in"], d: Float[Tensor, "passes_rows blocks"],
                      sums: Int[Tensor, "passes_rows blocks"], matrix: QuantizedMatrix, bias: Tensor | None = None,
                      passes: int = PASSES) -> Float[Tensor, "rows d_out"]:
    """What the kernels compute, readably: the rows the int8 activations stand for times the matrix's
    floats, plus bias. (`sums` is implied by q; the kernels take it to correct for the offset in integers.)"""
    del sums
    return F.linear(activation_rows(q, d, passes).float(), matrix.weight(), None if bias is None else bias.float())


def summation_error_bound(rows: Float[Tensor, "rows d_in"], matrix: QuantizedMatrix,
                           passes: int = PASSES) -> Float[Tensor, "rows d_out"]:
    """How far two float32 evaluations of rows @ W.T that add in different orders (and, with two
    passes, add each row's two int8 rows apart) can be: each is within about (d_in + 8) * 2^-24 of
    the sum of the magnitudes of every term it adds up (the classic bound for recursive summation,
    with room for the few products per block and the one rounding of the activations' float sum)."""
    terms = rows.float().abs() @ matrix.magnitude().T  # (rows, d_out)
    return 2 * (rows.shape[-1] + 8 + passes) * 2**-24 * terms


def float_error_bound(x: Float[Tensor, "... d_in"], matrix: QuantizedMatrix) -> Float[Tensor, "rows d_out"]:
    """How far the kernels' product of x's int8 rows with `matrix` can be from `qmatmul_reference`'s."""
    q, d, _ = quantize_rows_reference(x)
    return summation_error_bound(activation_rows(q, d, magnitude=True), matrix)


def activation_error_bound(x: Float[Tensor, "... d_in"], matrix: QuantizedMatrix) -> Float[Tensor, "rows d_out"]:
    """The most the kernels' output can be from the float product x @ W.T (itself computed in
    float32): the activations stand for x to within |x - x~| per input (at most half the second
    pass's step, 1/512 of the first's), which moves each output by that times |W|, plus both sides'
    float32 rounding."""
    q, d, _ = quantize_rows_reference(x)
    rows = x.reshape(-1, x.shape[-1]).double()
    gap = (rows - activation_rows(q, d)).abs().float()  # (rows, d_in), computed exactly in float64
    weight = matrix.weight().abs()
    return gap @ weight.T + float_error_bound(x, matrix) + 2 * x.shape[-1] * 2**-24 * (rows.float().abs() @ weight.T)


# --- the packed layout --------------------------------------------------------------------------

@dataclass
class PackedMatrix:
    """A `QuantizedMatrix` in the kernels' layout (see the module docstring), plus its shape facts."""

    levels: Tensor                # uint8 (panels, blocks, chunk); float weights: (d_out, d_in) fp16/bf16/float32
    scales: Tensor | None         # (panels, groups, 16); None for float weights
    mins: Tensor | None
    bits: int
    offset: int
    group_size: int               # inputs per group: 16 or a multiple of 32
    d_out: int
    row_scale: Float[Tensor, "d_out"] | None
    super_scales: Tensor | None = None  # (panels, supers, 16) fp16, or None
    super_mins: Tensor | None = None
    super_groups: int = 0         # groups per super-scale (0: none)

    @property
    def device(self) -> torch.device:
        return self.levels.device

    def operands(self) -> tuple:
        """The weight operands in the order the C++ ops take them (after x, or q, d, sums, passes)."""
        return (self.levels, self.scales, self.mins, self.super_scales, self.super_mins, self.bits, self.offset,
                self.group_size, self.super_groups, self.d_out, self.row_scale)


def panel_block_bytes(bits: int) -> int:
    """Bytes of one panel's block: 16 rows x 32 levels, high bits in planes of their own."""
    return PANEL * BLOCK * bits // 8 if bits in (4, 8) else PANEL * BLOCK * 4 // 8 + 64 * (bits - 4)


def _pad_rows(t: Tensor) -> Tensor:
    return F.pad(t, (0, 0, 0, -t.shape[0] % PANEL))


def pack_levels(levels: UInt8[Tensor, "d_out d_in"], bits: int) -> UInt8[Tensor, "panels blocks chunk"]:
    """Levels in panels of 16 rows, input quads interleaved across the rows (module docstring)."""
    d_out, d_in = levels.shape
    u = _pad_rows(levels.to(torch.uint8))
    panels, blocks = u.shape[0] // PANEL, d_in // BLOCK
    # (panel, row, block, quad k, t) -> (panel, block, k, row, t): byte 4 * row + t of chunk k.
    chunks = u.reshape(panels, PANEL, blocks, 8, 4).permute(0, 2, 3, 1, 4).reshape(panels, blocks, 8, 4 * PANEL)
    if bits == 8:
        return chunks.reshape(panels, blocks, 8 * 4 * PANEL).contiguous()
    low = chunks & 0x0F
    nibbles = (low[:, :, :4] | (low[:, :, 4:] << 4)).reshape(panels, blocks, 4 * 4 * PANEL)
    shifts = torch.arange(8, dtype=torch.uint8)[:, None]  # bit k of a plane's byte is chunk k's
    planes = [(((chunks >> bit) & 1) << shifts).sum(dim=2, dtype=torch.uint8) for bit in range(4, bits)]
    return torch.cat([nibbles, *planes], dim=-1).contiguous()


def unpack_levels(packed: UInt8[Tensor, "panels blocks chunk"], bits: int, d_out: int) -> UInt8[Tensor, "d_out d_in"]:
    """The inverse of `pack_levels`."""
    panels, blocks, _ = packed.shape
    if bits == 8:
        chunks = packed.reshape(panels, blocks, 8, 4 * PANEL)
    else:
        nibbles = packed[..., :256].reshape(panels, blocks, 4, 4 * PANEL)
        chunks = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=2)   # chunks 0..3 low, 4..7 high
        shifts = torch.arange(8, dtype=torch.uint8)[:, None]
        for bit in range(4, bits):
            plane = packed[..., 256 + 64 * (bit - 4):256 + 64 * (bit - 3)][:, :, None]  # (panels, blocks, 1, 64)
            chunks = chunks | (((plane >> shifts) & 1) << bit)
    u = chunks.reshape(panels, blocks, 8, PANEL, 4).permute(0, 3, 1, 2, 4).reshape(panels * PANEL, blocks * BLOCK)
    return u[:d_out]


def _pack_scales(scales: Tensor) -> Tensor:
    """(d_out, groups) -> (panels, groups, 16)."""
    padded = _pad_rows(scales)
    return padded.reshape(-1, PANEL, padded.shape[1]).transpose(1, 2).contiguous()


def _check_packable(matrix: QuantizedMatrix) -> None:
    d_out, d_in = matrix.levels.shape
    if matrix.bits not in (4, 5, 6, 8):
        raise ValueError(f"the kernels take levels of 4, 5, 6 or 8 bits, not {matrix.bits}")
    whole = matrix.group_size == BLOCK // 2 or matrix.group_size % BLOCK == 0
    if d_in % BLOCK or not whole or d_in % matrix.group_size:
        raise ValueError(f"the kernels take rows of whole blocks of {BLOCK} and groups of whole blocks (or half "
                         f"blocks); got d_in {d_in}, groups of {matrix.group_size}")
    if matrix.super_scales is None:
        if matrix.scales.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"the kernels read fp16 or bf16 scales, not {matrix.scales.dtype}")
    elif (matrix.scales.dtype not in (torch.int8, torch.uint8) or matrix.super_scales.dtype != torch.float16
          or matrix.super_size % BLOCK or matrix.super_size % matrix.group_size or d_in % matrix.super_size):
        raise ValueError("sub-scales are int8 or uint8 multiples of fp16 super-scales, each over whole blocks")


def pack(matrix: QuantizedMatrix) -> PackedMatrix:
    """The kernels' operands for `matrix`, made once, at load (the levels' interleaving by the C++
    `pack_levels` where the kernels are built: the same bytes as `pack_levels` here, ~50x sooner)."""
    _check_packable(matrix)
    row_scale = None if matrix.row_scale is None else matrix.row_scale.float().contiguous()
    ops = kernel_ops() if matrix.levels.device.type == "cpu" else None
    levels = pack_levels(matrix.levels, matrix.bits) if ops is None else ops.pack_levels(matrix.levels, matrix.bits)
    mins = None if matrix.mins is None else _pack_scales(matrix.mins.to(matrix.scales.dtype))
    supers = [None if t is None else _pack_scales(t) for t in (matrix.super_scales, matrix.super_mins)]
    super_groups = 0 if matrix.super_scales is None else matrix.super_size // matrix.group_size
    return PackedMatrix(levels, _pack_scales(matrix.scales), mins, matrix.bits, matrix.offset, matrix.group_size,
                        matrix.levels.shape[0], row_scale, *supers, super_groups)


def _unpack_scales(packed: Tensor, d_out: int) -> Tensor:
    """(panels, groups, 16) -> (d_out, groups): the inverse of `_pack_scales`."""
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:d_out].contiguous()


def unpack(packed: PackedMatrix) -> QuantizedMatrix | Tensor:
    """The matrix `pack` (or `pack_floats`) was given, from the kernels' layout alone: a layer that keeps
    only its packed copy writes its weights back out this way (save, export), bit for bit."""
    if packed.bits in FLOAT_BITS.values():
        return packed.levels  # (the matrix itself)
    supers = [None if t is None else _unpack_scales(t, packed.d_out) for t in (packed.super_scales, packed.super_mins)]
    return QuantizedMatrix(unpack_levels(packed.levels, packed.bits, packed.d_out),
                           _unpack_scales(packed.scales, packed.d_out),
                           None if packed.mins is None else _unpack_scales(packed.mins, packed.d_out),
                           packed.bits, packed.offset, packed.group_size, packed.row_scale, *supers,
                           packed.super_groups * packed.group_size or SUPER_BLOCK)


def packed_rows(packed: PackedMatrix, ids: Int[Tensor, "n"]) -> Float[Tensor, "n d_in"]:
    """Rows `ids` of the matrix a packed one stands for, as float32, exactly (an embedding table kept
    packed): the readable lookup unpacks just the panels holding them; the kernels' `lookup_rows`
    reads the same values in place."""
    if packed.bits in FLOAT_BITS.values():
        return packed.levels[ids.reshape(-1).long()].float()
    panels = (ids.reshape(-1) // PANEL).long()
    wanted = panels.unique()                                          # sorted panel numbers
    def panel_rows(t: Tensor | None) -> Tensor | None:
        return None if t is None else t[wanted]
    row_scale = None if packed.row_scale is None else _pad_rows(packed.row_scale[:, None]).reshape(-1, PANEL)[wanted].reshape(-1)
    sub = dataclasses.replace(packed, levels=packed.levels[wanted], scales=panel_rows(packed.scales),
                              mins=panel_rows(packed.mins), super_scales=panel_rows(packed.super_scales),
                              super_mins=panel_rows(packed.super_mins), d_out=len(wanted) * PANEL, row_scale=row_scale)
    matrix = unpack(sub)
    table = matrix.float() if isinstance(matrix, Tensor) else matrix.weight()  # (len(wanted) * 16, d_in)
    return table[torch.searchsorted(wanted, panels) * PANEL + ids.reshape(-1) % PANEL]


FLOAT_BITS = {torch.float16: 16, torch.bfloat16: 16, torch.float32: 32}  # float weights the kernels take


def pack_floats(weight: Tensor) -> PackedMatrix:
    """Float weights (fp16, bf16 or float32, (d_out, d_in)) as the kernels read them: the matrix
    itself, not copied where it is contiguous (a view of a mapped file stays one); no scales. The
    kernels multiply float32 rows by the weights' exact float32 values: the readable definition is
    F.linear(x, weight.float()).

    >>> weight = torch.ones(20, 64, dtype=torch.bfloat16)
    >>> pack_floats(weight).levels is weight
    True
    """
    d_out, d_in = weight.shape
    if weight.dtype not in FLOAT_BITS or d_in % BLOCK:
        raise ValueError(f"the kernels take fp16, bf16 or float32 weights in rows of whole blocks of {BLOCK}; got "
                         f"{weight.dtype} rows of {d_in}")
    return PackedMatrix(weight.contiguous(), None, None, FLOAT_BITS[weight.dtype], 0, d_in, d_out, None)


# --- the calls ----------------------------------------------------------------------------------

@functools.cache
def kernel_ops() -> Any | None:
    """`torch.ops.glasslm_kernels` with shapes for the compiler (fake kernels), or None without the extension."""
    ops = build.load()
    if ops is not None:
        _register_fakes()
    return ops


def _register_fakes() -> None:
    """Output shapes without computing, so `torch.compile` keeps each call as one node of one graph."""
    @torch.library.register_fake("glasslm_kernels::qlinear")
    def _qlinear(x, levels, scales, mins, super_scales, super_mins, bits, offset, group_size, super_groups, d_out,
                 row_scale, bias, passes=PASSES):
        return x.new_empty((*x.shape[:-1], d_out))

    @torch.library.register_fake("glasslm_kernels::qmatmul")
    def _qmatmul(q, d, sums, passes, levels, scales, mins, super_scales, super_mins, bits, offset, group_size,
                 super_groups, d_out, row_scale, bias):
        return q.new_empty((q.shape[0] // passes, d_out), dtype=torch.float32)

    @torch.library.register_fake("glasslm_kernels::lookup_rows")
    def _lookup_rows(ids, levels, scales, mins, super_scales, super_mins, bits, offset, group_size, super_groups,
                         d_out, row_scale):
        width = levels.shape[1] if bits in FLOAT_BITS.values() else levels.shape[1] * BLOCK
        return levels.new_empty((ids.shape[0], width), dtype=torch.float32)

    @torch.library.register_fake("glasslm_kernels::quantize_rows")
    def _quantize_rows(x):
        rows, width = x.numel() // x.shape[-1] * PASSES, x.shape[-1]
        return (x.new_empty((rows, width), dtype=torch.int8), x.new_empty((rows, width // BLOCK)),
                x.new_empty((rows, width // BLOCK), dtype=torch.int32))


_QLINEAR: list[Any] = []  # the op's overload, looked up once: a decoding step makes ~150 calls


FLOAT_BLAS_ROWS = 32  # rows from which float weights go through PyTorch's matrix product
FLOAT_SLICE = 1 << 20  # weights a slice of 16-bit ones has, as float32 (4 MiB), for that product
ONE_PASS_ROWS = 32  # rows from which `prefill_activations("int8")` multiplies the first pass alone
PREFILL_ACTIVATIONS = {"int16": PASSES, "int8": 1}  # a long prompt's activations: int8 passes multiplied
_PREFILL_PASSES = [PASSES]


def set_prefill_activations(kind: str) -> str:
    """How products of `ONE_PASS_ROWS` rows or more (a prompt's prefill) round their activations, for
    this process; returns the previous setting. "int16" (the default): both passes, x within
    |block max| / 2^16 of itself, the same numbers as a decoding step's. "int8": the first pass alone,
    x ~ d1 * q1 with d1 = |block max| / 127, as llama.cpp rounds its activations: half the integer
    products (a K-quant prompt ~1.3-2x faster), each input up to |block max| / 254 off.

    >>> previous = set_prefill_activations("int8"); set_prefill_activations(previous)
    'int8'
    """
    if kind not in PREFILL_ACTIVATIONS:
        raise ValueError(f"prefill activations are one of {sorted(PREFILL_ACTIVATIONS)}, not {kind!r}")
    previous = next(name for name, passes in PREFILL_ACTIVATIONS.items() if passes == _PREFILL_PASSES[0])
    _PREFILL_PASSES[0] = PREFILL_ACTIVATIONS[kind]
    return previous


@contextlib.contextmanager
def prefill_activations(kind: str) -> Iterator[None]:
    """`set_prefill_activations(kind)` inside a `with` block."""
    previous = set_prefill_activations(kind)
    try:
        yield
    finally:
        set_prefill_activations(previous)


def _float_product(rows: Float[Tensor, "... d_in"], packed: PackedMatrix) -> Float[Tensor, "... d_out"]:
    """Many rows times float weights: PyTorch's BLAS product (its tiles of rows and columns beat the
    kernels' dot products on a prompt), float32 weights as they are, 16-bit ones converted a slice of
    rows at a time (exact: every fp16 and bf16 number is a float32 one), so no float32 copy of the
    whole matrix is made. The same float product, to summation order."""
    weight = packed.levels
    if weight.dtype == torch.float32:
        return F.linear(rows, weight)
    step = max(PANEL, FLOAT_SLICE // weight.shape[1])
    out = rows.new_empty((*rows.shape[:-1], packed.d_out))
    for start in range(0, packed.d_out, step):
        out[..., start:start + step] = F.linear(rows, weight[start:start + step].float())
    return out


def qlinear(x: Float[Tensor, "... d_in"], packed: PackedMatrix, bias: Tensor | None = None) -> Float[Tensor, "... d_out"]:
    """x @ W.T + bias through the kernels (x rounded to int8 blocks on the way in), in x's dtype."""
    if packed.bits in FLOAT_BITS.values() and x.numel() >= FLOAT_BLAS_ROWS * x.shape[-1]:
        y = _float_product(x.float(), packed)
        y = y if bias is None else y + bias.float()
        return y if x.dtype == torch.float32 else y.to(x.dtype)
    if not _QLINEAR:
        # (A compiled graph calls the op itself: the loader is a Python function it need not trace.)
        if not torch.compiler.is_compiling():
            if kernel_ops() is None:
                raise RuntimeError("the C++ kernels are not loaded (see glasslm.kernels.build)")
            _QLINEAR.append(torch.ops.glasslm_kernels.qlinear.default)
        op = torch.ops.glasslm_kernels.qlinear.default
    else:
        op = _QLINEAR[0]
    rows = x if x.dtype == torch.float32 else x.float()
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    passes = _PREFILL_PASSES[0] if x.numel() >= ONE_PASS_ROWS * x.shape[-1] else PASSES
    y = op(rows, *packed.operands(), bias, passes)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def lookup_rows(packed: PackedMatrix, ids: Int[Tensor, "n"]) -> Float[Tensor, "n d_in"]:
    """`packed_rows` through the kernels (row by row in place, no panel unpacked)."""
    if kernel_ops() is None:
        raise RuntimeError("the C++ kernels are not loaded (see glasslm.kernels.build)")
    return torch.ops.glasslm_kernels.lookup_rows.default(ids.reshape(-1).long(), *packed.operands())


def qmatmul(q: Tensor, d: Tensor, sums: Tensor, packed: PackedMatrix, bias: Tensor | None = None,
            passes: int = PASSES) -> Tensor:
    """The kernels' product of rows already in int8 blocks (`passes` int8 rows per row: 1 for
    llama.cpp's own) with `packed`: (rows, d_out) float32."""
    ops = kernel_ops()
    if ops is None:
        raise RuntimeError("the C++ kernels are not loaded (see glasslm.kernels.build)")
    return ops.qmatmul(q, d, sums, passes, *packed.operands(), bias)
