"""llama.cpp's block formats as glasslm layers: a GGUF file's weights kept as it holds them.

ggml quantizes each row of a weight in blocks of consecutive inputs. A block is a small header and
the levels q; the K-quants group eight or sixteen smaller groups into a super-block of 256 inputs,
whose groups' scales are 6- or 8-bit integers times the super-block's fp16 scale d:

    q4_0:  d | 16 bytes of nibbles                         W = (q - 8) * d             q in 0..15
    q4_1:  d | m | 16 bytes of nibbles                     W = q * d + m               q in 0..15
    q5_0:  d | 4 bytes of 5th bits | 16 bytes of nibbles   W = (q - 16) * d            q in 0..31
    q5_1:  d | m | 4 bytes of 5th bits | nibbles           W = q * d + m               q in 0..31
    q8_0:  d | 32 bytes, int8                              W = q * d                   q in -127..127
    q4_k:  d | dmin | 12 bytes: 8 x (6-bit sc, 6-bit m) | 128 bytes of nibbles
                                          per 32 inputs:   W = q * (d * sc) - dmin * m     q in 0..15
    q5_k:  as q4_k, with 32 bytes of 5th bits                                          q in 0..31
    q6_k:  128 bytes of low nibbles | 64 bytes of 2-bit highs | 16 x int8 sc | d
                                          per 16 inputs:   W = (q - 32) * (d * sc)     q in 0..63

(d, m, dmin fp16.) In a small 4- or 5-bit block, byte j holds input j in its low nibble and input
j + 16 in its high one, and bit j of the 32-bit 5th-bit word input j's fifth bit; the K-quants
spread their nibbles and high bits over a super-block in their own orders (`_k_levels`, `_q6_k_levels`).
`block_matrix` reads any of them as the kernels' `QuantizedMatrix` (levels, per-group scales and
minimums, the K-quants' super-scales), and `dequantize_blocks` is the readable reference: bit for bit
what ggml's `dequantize_row_*` (and the gguf package's numpy copy of it) gives, since every product
of levels and scales is exact in float32 and each weight is rounded at most once (adding m).

`BlockLinear` holds a weight as those bytes, (d_out, n_blocks * block_bytes) uint8, so a model read
from a GGUF file computes with the file's own numbers: no second rounding on the way in (as
dequantizing and re-quantizing with `int4` would be), the same bytes on the way out. Its readable
path dequantizes and multiplies. Its fast path (CPU) is glasslm's own kernel (glasslm.kernels.qmatmul),
which does what llama.cpp does with these blocks: the activations rounded to int8 in blocks of 32,
integer dot products with the file's levels, one float multiply-add per group; the same levels and
scales, re-laid in panels of 16 rows when the layer is loaded (F16, BF16 and F32 weights are multiplied
as they are: a GGUF import hands the layer a view of the mapped file and copies nothing). Its outputs differ from the
readable path's by the activations' rounding (`glasslm.kernels.qmatmul.activation_error_bound`,
which the tests hold it to). Where the kernels cannot be built, 4-bit small blocks run PyTorch's int4
kernel (bf16 activations, scale d and zero m + 8d) and the rest a float copy of the weight.
Quantizing a float weight (`BlockLinear.from_weight`, the `q4_0`, `q4_1`, `q5_0`, `q5_1` and `q8_0`
transforms) uses the gguf package's quantizers, which give llama.cpp's reference bytes; the
K-quants come from llama.cpp's quantizer and are read as they are.

Example:
    >>> import torch
    >>> weight = torch.randn(4, 64)
    >>> layer = BlockLinear.from_weight(weight, None, "q4_1")
    >>> tuple(layer.weight_blocks.shape), layer.weight_blocks.dtype   # 2 blocks of 20 bytes per row
    ((4, 40), torch.uint8)
    >>> bool((layer.dequantized_weight() - weight).abs().max() < (weight.amax() - weight.amin()) / 15)
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int, UInt8
from torch import Tensor, nn

from glasslm.core.layers import Linear
from glasslm.kernels.qmatmul import (
    PackedMatrix, QuantizedMatrix, kernel_ops, lookup_rows, pack_floats, packed_rows, qlinear, unpack,
)
from glasslm.transforms.quantize import (
    Int4Linear, Int8Linear, KernelWithInputGradient, int4_kernel_linear, int4_kernel_operands,
)
from glasslm.transforms.registry import Transform

BLOCK_SIZE = 32  # inputs per block of activations (and of weights, but for the K-quants' super-blocks)


@dataclass(frozen=True)
class BlockFormat:
    """One of llama.cpp's formats: a file block's inputs and bytes, and its levels' bits and offset."""

    inputs: int       # per block of the file: 32, or a K-quant's super-block of 256
    bytes: int
    bits: int
    offset: int       # the level that stands for 0 (before any minimum)
    group_size: int   # inputs sharing a scale (and minimum)


FORMATS = {
    "q4_0": BlockFormat(32, 18, 4, 8, 32), "q4_1": BlockFormat(32, 20, 4, 0, 32),
    "q5_0": BlockFormat(32, 22, 5, 16, 32), "q5_1": BlockFormat(32, 24, 5, 0, 32),
    "q8_0": BlockFormat(32, 34, 8, 128, 32),
    "q4_k": BlockFormat(256, 144, 4, 0, 32), "q5_k": BlockFormat(256, 176, 5, 0, 32),
    "q6_k": BlockFormat(256, 210, 6, 32, 16),
    # Floats: each weight its own two bytes (fp16, or bf16: float32's top half), or four (float32).
    "f16": BlockFormat(1, 2, 16, 0, 1), "bf16": BlockFormat(1, 2, 16, 0, 1), "f32": BlockFormat(1, 4, 32, 0, 1),
}
LAYER_FORMATS = tuple(FORMATS)  # the formats a BlockLinear holds
FLOAT_TYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
QUANTIZABLE = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "f16", "bf16", "f32")  # those glasslm can also write
UNEMBED = "unembed"  # the layer name that, in BlockOptions.layers, means a tied unembedding of its own
EMBED = "embed"  # ... and the token table kept in the format too (a BlockEmbedding)


def _fp16_field(blocks: Tensor, start: int) -> Tensor:
    """The fp16 header field at byte `start` of every block, as fp16: (rows, n_blocks)."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16)[..., 0]


def _nibbles(bytes_: Tensor) -> Tensor:
    """16 bytes -> 32 levels: the low nibbles are inputs 0..15, the high ones 16..31."""
    return torch.cat((bytes_ & 0x0F, bytes_ >> 4), dim=-1)


def _bits(words: Tensor, count: int) -> Tensor:
    """Bit i of each little-endian word (its bytes along the last dimension), for i < count: (..., count)."""
    value = sum(words[..., j].long() << (8 * j) for j in range(words.shape[-1]))
    return (value[..., None] >> torch.arange(count)) & 1


def _small_fields(blocks: Tensor, qtype: str) -> tuple[Tensor, Tensor, Tensor | None]:
    """(levels (rows, n_blocks, 32), d, m or None) of q4_0 / q4_1 / q5_0 / q5_1 / q8_0 blocks."""
    d = _fp16_field(blocks, 0)
    if qtype == "q8_0":
        return blocks[..., 2:] ^ 0x80, d, None   # int8 q as q + 128
    m = _fp16_field(blocks, 2) if qtype in ("q4_1", "q5_1") else None
    start = 2 if m is None else 4
    if qtype in ("q4_0", "q4_1"):
        return _nibbles(blocks[..., start:]), d, m
    fifth = _bits(blocks[..., start:start + 4], 32).to(torch.uint8)   # (rows, n_blocks, 32)
    return _nibbles(blocks[..., start + 4:]) | (fifth << 4), d, m


def _k_scales(packed: Tensor) -> tuple[Tensor, Tensor]:
    """The 8 six-bit sub-scales and sub-minimums of a Q4_K / Q5_K super-block from its 12 bytes:
    groups 0..3 in the low six bits of bytes 0..3 (scales) and 4..7 (minimums), groups 4..7 in the
    nibbles of bytes 8..11 with their top two bits in the spare bits of bytes 0..7."""
    q = packed.long()
    low_scales, low_mins = q[..., 0:4] & 63, q[..., 4:8] & 63
    high_scales = (q[..., 8:12] & 0x0F) | ((q[..., 0:4] >> 6) << 4)
    high_mins = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    return torch.cat((low_scales, high_scales), -1).to(torch.uint8), torch.cat((low_mins, high_mins), -1).to(torch.uint8)


def _k_levels(qs: Tensor, fifth: Tensor | None) -> Tensor:
    """Q4_K / Q5_K levels of a super-block (..., 256): group 2p reads the low nibbles of bytes
    32p..32p+31, group 2p + 1 their high nibbles; with Q5_K, bit j of byte l of the 32 high-bit bytes
    is the fifth bit of input l of group j."""
    pairs = qs.unflatten(-1, (4, 32))                                    # (..., 4, 32)
    levels = torch.stack((pairs & 0x0F, pairs >> 4), dim=-2).flatten(-3)  # (..., 256): groups 0..7
    if fifth is not None:
        bit = (fifth[..., None, :].long() >> torch.arange(8)[:, None]) & 1  # (..., 8 groups, 32)
        levels = levels | (bit.flatten(-2) << 4).to(torch.uint8)
    return levels


def _q6_k_levels(ql: Tensor, qh: Tensor) -> Tensor:
    """Q6_K levels of a super-block (..., 256). Each half of 128 inputs reads 64 bytes of nibbles and
    32 bytes of 2-bit highs: input 32j + l takes the low (j = 0, 1) or high (j = 2, 3) nibble of byte
    l (j even) or l + 32 (j odd) and bits 2j, 2j + 1 of high byte l."""
    halves = []
    for n in range(2):
        low, high = ql[..., 64 * n:64 * n + 64].long(), qh[..., 32 * n:32 * n + 32].long()
        nibble = [low[..., :32] & 0xF, low[..., 32:] & 0xF, low[..., :32] >> 4, low[..., 32:] >> 4]
        halves += [nibble[j] | (((high >> (2 * j)) & 3) << 4) for j in range(4)]
    return torch.cat(halves, dim=-1).to(torch.uint8)


def _super_fields(blocks: Tensor, qtype: str) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor | None]:
    """(levels (rows, n_supers, 256), sub-scales, sub-minimums or None, d, -dmin or None) of K-quant blocks."""
    if qtype == "q6_k":
        levels = _q6_k_levels(blocks[..., :128], blocks[..., 128:192])
        return levels, blocks[..., 192:208].contiguous().view(torch.int8), None, _fp16_field(blocks, 208), None
    scales, mins = _k_scales(blocks[..., 4:16])
    fifth = blocks[..., 16:48] if qtype == "q5_k" else None
    levels = _k_levels(blocks[..., 48:] if fifth is not None else blocks[..., 16:], fifth)
    return levels, scales, mins, _fp16_field(blocks, 0), -_fp16_field(blocks, 2)


def block_matrix(weight_blocks: UInt8[Tensor, "rows row_bytes"], qtype: str) -> QuantizedMatrix:
    """The blocks as the kernels' readable `QuantizedMatrix`: unsigned levels (q8_0's int8 as q + 128),
    the fp16 scales d and minimums m, or the K-quants' integer sub-scales with d (and -dmin) as
    super-scales, exactly as stored."""
    if qtype not in FORMATS or qtype in FLOAT_TYPES:
        raise ValueError(f"{qtype!r} is not a block format; glasslm reads {', '.join(set(FORMATS) - set(FLOAT_TYPES))}")
    fmt = FORMATS[qtype]
    rows, row_bytes = weight_blocks.shape
    if row_bytes % fmt.bytes:
        raise ValueError(f"a {qtype} row has a multiple of {fmt.bytes} bytes, got {row_bytes}")
    blocks = weight_blocks.reshape(rows, row_bytes // fmt.bytes, fmt.bytes)   # (rows, n_blocks, block_bytes)
    if fmt.inputs == BLOCK_SIZE:
        levels, d, m = _small_fields(blocks, qtype)
        return QuantizedMatrix(levels.reshape(rows, -1), d, m, fmt.bits, fmt.offset)
    levels, scales, mins, d, neg_dmin = _super_fields(blocks, qtype)
    return QuantizedMatrix(levels.reshape(rows, -1), scales.reshape(rows, -1),
                           None if mins is None else mins.reshape(rows, -1), fmt.bits, fmt.offset, fmt.group_size,
                           super_scales=d, super_mins=neg_dmin)


# --- writing blocks back (the exact inverse of block_matrix) -------------------------------------

def _fp16_bytes(values: Tensor) -> Tensor:
    """fp16 numbers as their two little-endian bytes each: (..., 2)."""
    return values.to(torch.float16).reshape(-1).view(torch.uint8).reshape(*values.shape, 2)


def _join_nibbles(levels: Tensor) -> Tensor:
    """32 levels -> 16 bytes: input j in the low nibble of byte j, input j + 16 in its high one."""
    return (levels[..., :16] & 0x0F) | ((levels[..., 16:] & 0x0F) << 4)


def _bit_bytes(bits: Tensor) -> Tensor:
    """(..., 8k) bits -> (..., k) bytes, bit i of byte j being bits[8j + i]."""
    weights = 2 ** torch.arange(8, dtype=torch.int64)
    return (bits.long().unflatten(-1, (-1, 8)) * weights).sum(-1).to(torch.uint8)


def _small_bytes(matrix: QuantizedMatrix, qtype: str, rows: int) -> Tensor:
    levels = matrix.levels.reshape(rows, -1, BLOCK_SIZE)                       # (rows, n_blocks, 32)
    header = [_fp16_bytes(matrix.scales)] + ([] if matrix.mins is None else [_fp16_bytes(matrix.mins)])
    if qtype == "q8_0":
        body = [levels ^ 0x80]
    elif qtype in ("q4_0", "q4_1"):
        body = [_join_nibbles(levels)]
    else:  # q5_0, q5_1: the fifth bits as a little-endian 32-bit word, then the nibbles
        body = [_bit_bytes(levels >> 4), _join_nibbles(levels)]
    return torch.cat(header + body, dim=-1)


def _k_scale_bytes(scales: Tensor, mins: Tensor) -> Tensor:
    """The 12 bytes of 8 six-bit sub-scales and sub-minimums (the inverse of _k_scales)."""
    sc, m = scales.long(), mins.long()
    low = torch.cat(((sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6), (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6)), -1)
    high = (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)
    return torch.cat((low, high), -1).to(torch.uint8)


def _super_bytes(matrix: QuantizedMatrix, qtype: str, rows: int) -> Tensor:
    levels = matrix.levels.reshape(rows, -1, 256)                              # (rows, n_supers, 256)
    scales = matrix.scales.reshape(rows, levels.shape[1], -1)
    if qtype == "q6_k":  # the inverse of _q6_k_levels: each half's four quarters of 32 inputs
        quarters = levels.unflatten(-1, (2, 4, 32)).long()                      # (rows, n, half, quarter j, 32)
        low = quarters & 0x0F
        ql = torch.cat((low[..., 0, :] | (low[..., 2, :] << 4), low[..., 1, :] | (low[..., 3, :] << 4)), -1)
        qh = sum((quarters[..., j, :] >> 4) << (2 * j) for j in range(4))
        return torch.cat((ql.flatten(-2).to(torch.uint8), qh.flatten(-2).to(torch.uint8), scales.view(torch.uint8),
                          _fp16_bytes(matrix.super_scales)), -1)
    groups = levels.unflatten(-1, (4, 2, 32))                                 # (rows, n, pair p, 2, 32)
    qs = ((groups[..., 0, :] & 0x0F) | ((groups[..., 1, :] & 0x0F) << 4)).flatten(-2)
    mins = matrix.mins.reshape(rows, levels.shape[1], -1)
    head = [_fp16_bytes(matrix.super_scales), _fp16_bytes(-matrix.super_mins), _k_scale_bytes(scales, mins)]
    if qtype == "q5_k":  # bit j of byte l: the fifth bit of input l of group j
        fifth = (levels.unflatten(-1, (8, 32)).long() >> 4) << torch.arange(8)[:, None]
        head.append(fifth.sum(-2).to(torch.uint8))
    return torch.cat(head + [qs], dim=-1)


def encode_blocks(matrix: QuantizedMatrix, qtype: str) -> UInt8[Tensor, "rows row_bytes"]:
    """The file's bytes for a matrix of `qtype` (the inverse of `block_matrix`: every bit comes back)."""
    rows = matrix.levels.shape[0]
    fmt = FORMATS[qtype]
    blocks = _small_bytes(matrix, qtype, rows) if fmt.inputs == BLOCK_SIZE else _super_bytes(matrix, qtype, rows)
    return blocks.reshape(rows, -1).contiguous()


def block_fields(
    weight_blocks: UInt8[Tensor, "rows row_bytes"], qtype: str
) -> tuple[Tensor, Float[Tensor, "rows n_blocks"], Float[Tensor, "rows n_blocks"] | None]:
    """(levels q (rows, n_blocks * 32), d, m or None) of a small-block matrix (q4_0, q4_1, q5_0, q5_1, q8_0):
    q unsigned 0..15 or 0..31 (in input order) for the 4- and 5-bit formats, int8 for q8_0."""
    if FORMATS.get(qtype, FORMATS["q4_k"]).inputs != BLOCK_SIZE:
        raise ValueError(f"block_fields reads {', '.join(QUANTIZABLE)}, not {qtype!r}")
    matrix = block_matrix(weight_blocks, qtype)
    levels = (matrix.levels ^ 0x80).view(torch.int8) if qtype == "q8_0" else matrix.levels
    return levels, matrix.scales.float(), None if matrix.mins is None else matrix.mins.float()


def dequantize_blocks(weight_blocks: UInt8[Tensor, "rows row_bytes"], qtype: str) -> Float[Tensor, "rows d_in"]:
    """The float32 matrix a block-quantized (or 16-bit) one stands for, exactly as ggml computes it."""
    if qtype in FLOAT_TYPES:
        return float_weight(weight_blocks, qtype).float()
    return block_matrix(weight_blocks, qtype).weight()


def float_weight(weight_blocks: UInt8[Tensor, "rows row_bytes"], qtype: str) -> Tensor:
    """An f16, bf16 or f32 tensor's bytes as the (rows, d_in) fp16, bf16 or float32 matrix they are."""
    return weight_blocks.contiguous().view(FLOAT_TYPES[qtype])


def quantize_blocks(weight: Float[Tensor, "rows d_in"], qtype: str) -> UInt8[Tensor, "rows row_bytes"]:
    """`weight` in a block format, byte for byte what llama.cpp's reference quantizer writes (the
    gguf package's quantizers, which reproduce it)."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    if qtype in FLOAT_TYPES:  # rounded to nearest (even), as llama.cpp's converter writes them
        return weight.detach().cpu().to(FLOAT_TYPES[qtype]).contiguous().view(torch.uint8)
    if qtype not in QUANTIZABLE:
        raise ValueError(f"glasslm cannot write {qtype} blocks (llama.cpp's quantizer makes them); it writes "
                         f"{', '.join(QUANTIZABLE)}")
    if weight.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"block formats quantize rows in blocks of {BLOCK_SIZE}; a row of {weight.shape[-1]} "
                         "inputs does not divide")
    rows = weight.detach().float().cpu().numpy().astype(np.float32)
    return torch.from_numpy(quants.quantize(rows, GGMLQuantizationType[qtype.upper()]).copy())


def packs_as_loaded(qtype: str, d_in: int, device: torch.device | str, impl: str = "fast") -> bool:
    """Whether a BlockLinear of `qtype` on `device` takes its bytes into the kernels' layout as they
    arrive: re-laid out, keeping no reference to them (the block formats: a loader may hand it a
    read-only view of a file), or used as they are (float weights: `keeps_as_loaded`)."""
    packs = impl == "fast" and torch.device(device).type == "cpu" and kernel_ops() is not None
    return packs and (qtype not in FLOAT_TYPES or d_in % BLOCK_SIZE == 0)


def keeps_as_loaded(qtype: str, d_in: int, device: torch.device | str, impl: str = "fast") -> bool:
    """Whether such a layer multiplies the very bytes it is given, and keeps them (float weights, which
    the kernels read as the file lays them out): a loader may hand it a view of a mapped file that
    lives as long as the layer, and so copy nothing."""
    return qtype in FLOAT_TYPES and packs_as_loaded(qtype, d_in, device, impl)


class BlockLinear(nn.Module):
    """A Linear whose weight is llama.cpp blocks (any of FORMATS), used as they are.

    On a CPU with the kernels built, the layer keeps one copy of its weight: the kernels' packed
    layout, made when the bytes arrive. `weight_blocks` (the file's bytes) is then written back from
    it when asked for (`blocks()`: saving, export, the readable path), bit for bit; without the
    kernels, or on another device, the bytes are kept as they came."""

    def __init__(self, d_in: int, d_out: int, qtype: str, bias: bool = True, impl: str = "fast"):
        super().__init__()
        if qtype not in FORMATS:
            raise ValueError(f"a BlockLinear holds {', '.join(FORMATS)}, not {qtype!r}")
        inputs = FORMATS[qtype].inputs
        if d_in % inputs:
            raise ValueError(f"{qtype} quantizes rows in blocks of {inputs}; d_in {d_in} does not divide")
        self.d_in, self.d_out, self.qtype, self.impl = d_in, d_out, qtype, impl
        self.row_bytes = d_in // inputs * FORMATS[qtype].bytes
        # A buffer (saved, moved with the module) read through the `weight_blocks` property below.
        self._buffers["weight_blocks"] = torch.zeros(d_out, self.row_bytes, dtype=torch.uint8)
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None
        # The kernels' layout of the weight (or, without the C++ kernels, PyTorch's int4 kernel's
        # operands, or the float weight): made when weights arrive; the packed one stands for the bytes.
        self._kernel: PackedMatrix | tuple[Tensor, Tensor] | Tensor | None = None

    @classmethod
    def from_weight(cls, weight: Tensor, bias: Tensor | None, qtype: str, impl: str = "fast") -> "BlockLinear":
        return cls.from_blocks(quantize_blocks(weight, qtype), bias, qtype, impl)

    @classmethod
    def from_blocks(cls, weight_blocks: Tensor, bias: Tensor | None, qtype: str, impl: str = "fast") -> "BlockLinear":
        d_out, row_bytes = weight_blocks.shape
        layer = cls(row_bytes // FORMATS[qtype].bytes * FORMATS[qtype].inputs, d_out, qtype, bias=False, impl=impl)
        layer.weight_blocks = weight_blocks.to(torch.uint8)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        layer.prepare_for_compile()  # (only for the fast path on a CPU)
        return layer

    @property
    def weight_blocks(self) -> UInt8[Tensor, "d_out row_bytes"]:
        """The weight as the file's bytes (`blocks()`)."""
        return self.blocks()

    def blocks(self) -> UInt8[Tensor, "d_out row_bytes"]:
        """The weight as the file's bytes: kept, or written back from the packed copy (exactly)."""
        kept = self._buffers.get("weight_blocks")
        if kept is not None:
            return kept
        packed = unpack(self._kernel)
        return packed.view(torch.uint8) if self.qtype in FLOAT_TYPES else encode_blocks(packed, self.qtype)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> Float[Tensor, "d_out d_in"]:
        return dequantize_blocks(self.blocks(), self.qtype).to(dtype)

    def forward(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        kernel = self._kernel
        if isinstance(kernel, PackedMatrix) and self.impl == "fast" and x.is_cpu and not (
                torch.is_grad_enabled() and x.requires_grad):
            return qlinear(x, kernel, self.bias)  # the decoding step's call: no more Python than this
        if self.impl == "fast" and x.device.type == "cpu":
            if torch.is_grad_enabled() and x.requires_grad:
                return KernelWithInputGradient.apply(x, self)
            return self._kernel_forward(x)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight(x.dtype), bias)

    def kernel_matrix(self) -> PackedMatrix | None:
        """The packed matrix `forward` multiplies a float32 CPU row by (None: it takes another path)."""
        if self.impl != "fast" or self._device().type != "cpu":
            return None
        kernel = self._kernel_operands()
        return kernel if isinstance(kernel, PackedMatrix) else None

    def quantized_matrix(self) -> QuantizedMatrix:
        """The blocks as the kernels' readable `QuantizedMatrix` (`block_matrix`)."""
        return block_matrix(self.blocks(), self.qtype)

    def _device(self) -> torch.device:
        kept = self._buffers.get("weight_blocks")
        return kept.device if kept is not None else self._kernel.device

    def _kernel_forward(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        kernel = self._kernel_operands()
        if isinstance(kernel, PackedMatrix):
            return qlinear(x, kernel, self.bias)
        if isinstance(kernel, Tensor):  # all but q4_0 / q4_1 without the C++ kernels: the float weight
            return F.linear(x, kernel.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        return int4_kernel_linear(x, kernel, BLOCK_SIZE, self.d_out, self.bias)

    def _kernel_operands(self) -> PackedMatrix | tuple[Tensor, Tensor] | Tensor:
        """What the fast path multiplies with, made once per set of weights: the C++ kernels' packed
        matrix (after which the bytes are dropped: the packed copy stands for them), else PyTorch's int4
        kernel's operands for q4_0 / q4_1 (scale d and zero, the value of level 8, m + 8d), else the
        float weight."""
        kernel = self._kernel
        if kernel is not None:
            return kernel
        ops, blocks = kernel_ops(), self.weight_blocks
        fmt = FORMATS[self.qtype]
        on_cpu = ops is not None and blocks.device.type == "cpu"
        if self.qtype in FLOAT_TYPES:  # float weights: the matrix itself (no copy), else the float weight
            kernel = (pack_floats(float_weight(blocks, self.qtype)) if on_cpu and self.d_in % BLOCK_SIZE == 0
                      else self.dequantized_weight())
        elif on_cpu:
            # The C++ packer reads the blocks directly: pack(self.quantized_matrix()), byte for byte.
            levels, scales, mins, supers, super_mins = ops.pack_ggml(blocks, self.qtype)
            kernel = PackedMatrix(levels, scales, mins, fmt.bits, fmt.offset, fmt.group_size, self.d_out, None,
                                  supers, super_mins, 0 if supers is None else 256 // fmt.group_size)
        elif self.qtype in ("q4_0", "q4_1"):
            levels, d, m = block_fields(blocks, self.qtype)
            kernel = int4_kernel_operands(levels, d, torch.zeros_like(d) if m is None else m + 8 * d)
        else:
            kernel = self.dequantized_weight()
        self._kernel = kernel
        if isinstance(kernel, PackedMatrix):
            self._buffers["weight_blocks"] = None  # one copy of the weight: the packed one
        return kernel

    def prepare_for_compile(self) -> None:
        """Lay the weight out for the kernel now (at load, so the first token does not wait for it,
        and outside a compiled graph, which reads the packed copy and never makes it)."""
        if self.impl == "fast" and self._device().type == "cpu":
            self._kernel_operands()

    def _restore_blocks(self) -> None:
        """Gives the bytes a buffer again (before they move or are replaced), dropping the packed copy."""
        if self._buffers.get("weight_blocks") is None:
            self._buffers["weight_blocks"] = self.blocks()
        self._kernel = None

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._buffers.get("weight_blocks") is None:
            destination[prefix + "weight_blocks"] = self.blocks()

    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: dict, *args: Any, **kwargs: Any) -> None:
        if prefix + "weight_blocks" not in state_dict:  # (a load of other tensors passing through)
            return super()._load_from_state_dict(state_dict, prefix, local_metadata, *args, **kwargs)
        if self._buffers.get("weight_blocks") is None:  # a place for the new bytes (replaced when assigning)
            device = "meta" if local_metadata.get("assign_to_params_buffers") else self._kernel.device
            self._buffers["weight_blocks"] = torch.empty(self.d_out, self.row_bytes, dtype=torch.uint8, device=device)
        self._kernel = None  # new weights: re-pack them for the kernel
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args, **kwargs)
        self.prepare_for_compile()

    def _apply(self, fn: Any, recurse: bool = True) -> "BlockLinear":
        kernel = self._kernel
        if isinstance(kernel, PackedMatrix) and self._buffers.get("weight_blocks") is None:
            # A dtype change (model.to(torch.float32), .double()) passes integer bytes by: if it would
            # leave them where they are, the packed copy stands (only the bias follows it).
            if fn(torch.empty(0, dtype=torch.uint8, device=kernel.device)).device == kernel.device:
                return super()._apply(fn, recurse)
        had_copy = kernel is not None
        self._restore_blocks()  # .to(device) makes new buffers: re-pack them
        super()._apply(fn, recurse)
        if had_copy:
            self.prepare_for_compile()
        return self

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}, qtype={self.qtype}, bias={self.bias is not None}, impl={self.impl}"


class BlockEmbedding(nn.Module):
    """Token id -> a row of a table kept in a block format (or 16 bits), dequantized exactly when it is
    looked up: a GGUF file's token_embd as the file holds it (SmolLM2's: 30 MB of q8_0 rather than
    113 MB of float32; Llama 3.2 1B's: 1 GB less). `table` is a BlockLinear of (vocab, d_model) rows;
    `tied`: it is the model's own unembedding, kept out of this module's state (one copy serves both)."""

    def __init__(self, table: BlockLinear, tied: bool = False):
        super().__init__()
        self.tied = tied
        if tied:
            object.__setattr__(self, "_tied_table", table)  # (not a submodule: model.unembed owns it)
        else:
            self.table = table

    def rows(self) -> BlockLinear:
        return self._tied_table if self.tied else self.table

    @property
    def device(self) -> torch.device:
        return self.rows()._device()

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def weight(self) -> Float[Tensor, "vocab d_model"]:
        """The whole table as float32, for code that reads all of it (export, analysis); a lookup reads
        only its rows."""
        return self.rows().dequantized_weight()

    def forward(self, tokens: Int[Tensor, "..."]) -> Float[Tensor, "... d_model"]:
        table = self.rows()
        kernel = table.kernel_matrix()
        ids = tokens.reshape(-1)
        if kernel is not None:
            rows = lookup_rows(kernel, ids)                # the kernels read the rows in place
        elif isinstance(table._kernel, PackedMatrix):
            rows = packed_rows(table._kernel, ids)         # readable: just their panels unpacked
        else:
            rows = dequantize_blocks(table.blocks()[ids], table.qtype)
        return rows.reshape(*tokens.shape, -1)

    def extra_repr(self) -> str:
        table = self.rows()
        return f"vocab={table.d_out}, d_model={table.d_in}, qtype={table.qtype}, tied={self.tied}"


@dataclass(frozen=True)
class BlockOptions:
    """Which Linear layers take the block format: `layers` names them (as `model.named_modules()`
    does; a GGUF import lists the ones its file holds in this format; "unembed" in a model whose
    unembedding is the embedding's transpose means a quantized copy of it; "embed" means the token
    table too, a `BlockEmbedding`: the unembedding's own blocks where both are listed and the model is
    tied), None means every Linear whose input width divides into blocks of 32, and a tied
    unembedding too (the embedding stays float)."""

    layers: list[str] | None = None


def _block_targets(model: nn.Module, options: BlockOptions, inputs: int) -> list[str]:
    """The names of the float Linear layers to replace (every one named must be one; without names,
    those whose rows divide into the format's blocks of `inputs`)."""
    linears = {name for name, m in model.named_modules() if isinstance(m, Linear)}
    if options.layers is None:
        return sorted(name for name in linears if model.get_submodule(name).weight.shape[1] % inputs == 0)
    if EMBED in options.layers:
        linears.add(EMBED)  # (made by _apply_to_embedding)
    quantized = {name for name, m in model.named_modules() if isinstance(m, (Int8Linear, Int4Linear, BlockLinear))}
    if _tied(model):
        linears.add(UNEMBED)
    wrong = [name for name in options.layers if name not in linears]
    if wrong:
        what = "already quantized" if set(wrong) <= quantized else "not Linear layers of this model"
        raise ValueError(f"{', '.join(wrong[:4])} {'is' if len(wrong) == 1 else 'are'} {what}")
    return list(options.layers)


def _tied(model: nn.Module) -> bool:
    """Whether the model's unembedding is its embedding's transpose (no matrix of its own yet)."""
    return getattr(model, "unembed", "absent") is None


def _apply(qtype: str, model: nn.Module, options: BlockOptions, quantize: bool) -> None:
    """Replace the chosen Linears by `qtype` BlockLinears: quantized from their weights, or (on
    rebuild, for a checkpoint's weights to be assigned) empty."""
    if quantize and qtype not in QUANTIZABLE:
        raise ValueError(f"glasslm reads {qtype} blocks but cannot write them: llama.cpp's quantizer makes them "
                         f"(llama-quantize); glasslm quantizes to {', '.join(QUANTIZABLE)}")
    impl = getattr(getattr(model, "config", None), "impl", "fast")
    tied = _tied(model) and (options.layers is None or UNEMBED in options.layers)
    inputs = FORMATS[qtype].inputs
    for name in _block_targets(model, options, inputs):
        if name == EMBED or (name == UNEMBED and tied):
            continue  # made from the embedding below
        parent_name, _, child_name = name.rpartition(".")
        child = model.get_submodule(name)
        d_out, d_in = child.weight.shape
        if quantize:
            layer = BlockLinear.from_weight(child.weight, child.bias, qtype, impl)
        else:
            with torch.device(child.weight.device):  # (a checkpoint's empty model: meta, no bytes zeroed)
                layer = BlockLinear(d_in, d_out, qtype, child.bias is not None, impl)
        setattr(model.get_submodule(parent_name) if parent_name else model, child_name, layer)
    if tied and model.embed.weight.shape[1] % inputs == 0:
        embed = model.embed.weight
        with torch.device(embed.device):
            model.unembed = (BlockLinear.from_weight(embed, None, qtype, impl) if quantize
                             else BlockLinear(embed.shape[1], embed.shape[0], qtype, False, impl))
    if options.layers is not None and EMBED in options.layers:
        if _tied(model):
            raise ValueError("a tied model's token table takes a block format with its unembedding: list 'unembed' too")
        _apply_to_embedding(qtype, model, shared=tied, quantize=quantize, impl=impl)


def _apply_to_embedding(qtype: str, model: nn.Module, shared: bool, quantize: bool, impl: str) -> None:
    """The token table as a BlockEmbedding: of the unembedding's blocks (`shared`), or of its own."""
    if shared:
        model.embed = BlockEmbedding(model.unembed, tied=True)
        return
    weight = model.embed.weight
    with torch.device(weight.device):
        table = (BlockLinear.from_weight(weight, None, qtype, impl) if quantize
                 else BlockLinear(weight.shape[1], weight.shape[0], qtype, False, impl))
    model.embed = BlockEmbedding(table)


def _block_transform(qtype: str, summary: str) -> Transform:
    # The K-quants are read from files, not made: not among the quantizations a command offers.
    kind = "quantization" if qtype in QUANTIZABLE else "read-only quantization"
    return Transform(qtype, lambda model, options: _apply(qtype, model, options, quantize=True), options=BlockOptions,
                     rebuild=lambda model, options: _apply(qtype, model, options, quantize=False),
                     kind=kind, summary=summary)


Q4_0 = _block_transform("q4_0", "llama.cpp's Q4_0 blocks: 32 weights share an fp16 scale (4.5 bits per weight)")
Q4_1 = _block_transform("q4_1", "llama.cpp's Q4_1 blocks: 32 weights share an fp16 scale and minimum (5 bits per weight)")
Q5_0 = _block_transform("q5_0", "llama.cpp's Q5_0 blocks: 32 five-bit weights share an fp16 scale (5.5 bits per weight)")
Q5_1 = _block_transform("q5_1", "llama.cpp's Q5_1 blocks: 32 five-bit weights share an fp16 scale and minimum (6 bits per weight)")
Q8_0 = _block_transform("q8_0", "llama.cpp's Q8_0 blocks: 32 int8 weights share an fp16 scale (8.5 bits per weight)")
Q4_K = _block_transform("q4_k", "llama.cpp's Q4_K super-blocks of 256 (4.5 bits per weight; read from GGUF files, not written)")
Q5_K = _block_transform("q5_k", "llama.cpp's Q5_K super-blocks of 256 (5.5 bits per weight; read from GGUF files, not written)")
Q6_K = _block_transform("q6_k", "llama.cpp's Q6_K super-blocks of 256 (6.56 bits per weight; read from GGUF files, not written)")
F16 = _block_transform("f16", "fp16 weights, float32 activations: the weights converted in registers (16 bits per weight)")
BF16 = _block_transform("bf16", "bf16 weights, float32 activations: the weights converted in registers (16 bits per weight)")
F32 = _block_transform("f32", "float32 weights, multiplied as they are (32 bits per weight: a GGUF file's F32 matrices)")
