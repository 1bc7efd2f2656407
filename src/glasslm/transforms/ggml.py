"""llama.cpp's block formats (Q4_0, Q4_1, Q8_0) as glasslm layers: a GGUF file's weights kept as it holds them.

ggml quantizes each row of a weight in blocks of 32 consecutive inputs. A block is a small header
and the 32 levels q:

    q4_0:  d (fp16) | 16 bytes of nibbles              W = (q - 8) * d       q in 0..15
    q4_1:  d (fp16) | m (fp16) | 16 bytes of nibbles   W = q * d + m         q in 0..15
    q8_0:  d (fp16) | 32 bytes, int8                   W = q * d             q in -127..127

In a 4-bit block, byte j holds input j in its low nibble and input j + 16 in its high one.
`dequantize_blocks` is the readable reference: bit for bit what ggml's `dequantize_row_*` (and the
gguf package's numpy copy of it) gives, since every product q * d is exact in float32 and each
weight is rounded at most once (the + m of q4_1).

`BlockLinear` holds a weight as those bytes, (d_out, n_blocks * block_bytes) uint8, so a model read
from a GGUF file computes with the file's own numbers: no second rounding on the way in (as
dequantizing and re-quantizing with `int4` would be), the same bytes on the way out. Its readable
path dequantizes and multiplies. Its fast path (CPU) is glasslm's own kernel (glasslm.kernels.qmatmul),
which does what llama.cpp does with these blocks: the activations rounded to int8 in blocks of 32,
integer dot products with the file's levels, one float multiply-add per block; the same levels and
fp16 scales, re-laid in panels of 16 rows when the layer is loaded. Its outputs differ from the
readable path's by the activations' rounding (`glasslm.kernels.qmatmul.activation_error_bound`,
which the tests hold it to). Where the kernels cannot be built, 4-bit layers run PyTorch's int4
kernel (bf16 activations, scale d and zero m + 8d) and q8_0 layers a float copy of the weight.
Quantizing a float weight (`BlockLinear.from_weight`, the `q4_0`, `q4_1` and `q8_0` transforms) uses
the gguf package's quantizers, which give llama.cpp's reference bytes.

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
from jaxtyping import Float, UInt8
from torch import Tensor, nn

from glasslm.core.layers import Linear
from glasslm.kernels.qmatmul import PackedMatrix, QuantizedMatrix, kernel_ops, qlinear
from glasslm.transforms.quantize import (
    Int4Linear, Int8Linear, KernelWithInputGradient, int4_kernel_linear, int4_kernel_operands,
)
from glasslm.transforms.registry import Transform

BLOCK_SIZE = 32  # inputs per block, in every format here
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34}  # header + levels
LAYER_FORMATS = ("q4_0", "q4_1", "q8_0")  # the formats a BlockLinear holds
OFFSETS = {"q4_0": 8, "q4_1": 0, "q8_0": 128}  # the level that stands for 0 (see block_matrix)
UNEMBED = "unembed"  # the layer name that, in BlockOptions.layers, means a tied unembedding of its own


def _fp16_field(blocks: Tensor, start: int) -> Tensor:
    """The fp16 header field at byte `start` of every block, as float32: (rows, n_blocks)."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16)[..., 0].float()


def block_fields(
    weight_blocks: UInt8[Tensor, "rows row_bytes"], qtype: str
) -> tuple[Tensor, Float[Tensor, "rows n_blocks"], Float[Tensor, "rows n_blocks"] | None]:
    """(levels q (rows, n_blocks * 32), d, m or None) of a block-quantized matrix.

    q is uint8 0..15 for the 4-bit formats (in input order), int8 for q8_0.
    """
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"unknown block format {qtype!r}; glasslm reads {', '.join(BLOCK_BYTES)}")
    rows, row_bytes = weight_blocks.shape
    size = BLOCK_BYTES[qtype]
    if row_bytes % size:
        raise ValueError(f"a {qtype} row has a multiple of {size} bytes, got {row_bytes}")
    blocks = weight_blocks.reshape(rows, row_bytes // size, size)   # (rows, n_blocks, block_bytes)
    d = _fp16_field(blocks, 0)
    if qtype == "q8_0":
        return blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, -1), d, None
    header = 4 if qtype == "q4_1" else 2
    nibbles = blocks[..., header:]                                   # (rows, n_blocks, 16)
    levels = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1)       # low nibbles are inputs 0..15
    m = _fp16_field(blocks, 2) if qtype == "q4_1" else None
    return levels.reshape(rows, -1), d, m


def dequantize_blocks(weight_blocks: UInt8[Tensor, "rows row_bytes"], qtype: str) -> Float[Tensor, "rows d_in"]:
    """The float32 matrix a block-quantized one stands for, exactly as ggml computes it."""
    levels, d, m = block_fields(weight_blocks, qtype)
    rows = levels.shape[0]
    q = levels.float().reshape(rows, -1, BLOCK_SIZE)                  # (rows, n_blocks, 32)
    if qtype == "q4_0":
        q = q - 8
    weight = q * d[..., None]
    if m is not None:
        weight = weight + m[..., None]
    return weight.reshape(rows, -1)


def block_matrix(weight_blocks: UInt8[Tensor, "rows row_bytes"], qtype: str) -> QuantizedMatrix:
    """The blocks as the kernels' `QuantizedMatrix`: unsigned levels (q8_0's int8 as q + 128, offset
    128; q4_0's offset 8), the fp16 scales d and q4_1's minimums m, exactly as stored."""
    levels, d, m = block_fields(weight_blocks, qtype)
    if qtype == "q8_0":
        levels = levels.view(torch.uint8) ^ 0x80  # two's complement q -> q + 128
    return QuantizedMatrix(levels, d.half(), None if m is None else m.half(), 8 if qtype == "q8_0" else 4, OFFSETS[qtype])


def quantize_blocks(weight: Float[Tensor, "rows d_in"], qtype: str) -> UInt8[Tensor, "rows row_bytes"]:
    """`weight` in a block format, byte for byte what llama.cpp's reference quantizer writes (the
    gguf package's quantizers, which reproduce it)."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    if weight.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"block formats quantize rows in blocks of {BLOCK_SIZE}; a row of {weight.shape[-1]} "
                         "inputs does not divide")
    rows = weight.detach().float().cpu().numpy().astype(np.float32)
    return torch.from_numpy(quants.quantize(rows, GGMLQuantizationType[qtype.upper()]).copy())


class BlockLinear(nn.Module):
    """A Linear whose weight is llama.cpp blocks (q4_0, q4_1 or q8_0), used as they are."""

    def __init__(self, d_in: int, d_out: int, qtype: str, bias: bool = True, impl: str = "fast"):
        super().__init__()
        if qtype not in LAYER_FORMATS:
            raise ValueError(f"a BlockLinear holds {' or '.join(LAYER_FORMATS)}, not {qtype!r}")
        if d_in % BLOCK_SIZE:
            raise ValueError(f"{qtype} quantizes rows in blocks of {BLOCK_SIZE}; d_in {d_in} does not divide")
        self.d_in, self.d_out, self.qtype, self.impl = d_in, d_out, qtype, impl
        row_bytes = d_in // BLOCK_SIZE * BLOCK_BYTES[qtype]
        self.register_buffer("weight_blocks", torch.zeros(d_out, row_bytes, dtype=torch.uint8))
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None
        # The kernels' layout of the weight (or, without the C++ kernels, PyTorch's int4 kernel's
        # operands, or q8_0's float weight): made when weights arrive, never saved.
        self._kernel: PackedMatrix | tuple[Tensor, Tensor] | Tensor | None = None

    @classmethod
    def from_weight(cls, weight: Tensor, bias: Tensor | None, qtype: str, impl: str = "fast") -> "BlockLinear":
        return cls.from_blocks(quantize_blocks(weight, qtype), bias, qtype, impl)

    @classmethod
    def from_blocks(cls, weight_blocks: Tensor, bias: Tensor | None, qtype: str, impl: str = "fast") -> "BlockLinear":
        d_out, row_bytes = weight_blocks.shape
        layer = cls(row_bytes // BLOCK_BYTES[qtype] * BLOCK_SIZE, d_out, qtype, bias=False, impl=impl)
        layer.weight_blocks = weight_blocks.to(torch.uint8)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        layer.prepare_for_compile()  # (only for the fast path on a CPU)
        return layer

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> Float[Tensor, "d_out d_in"]:
        return dequantize_blocks(self.weight_blocks, self.qtype).to(dtype)

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
        if self.impl != "fast" or self.weight_blocks.device.type != "cpu":
            return None
        kernel = self._kernel_operands()
        return kernel if isinstance(kernel, PackedMatrix) else None

    def quantized_matrix(self) -> QuantizedMatrix:
        """The blocks as the kernels' readable `QuantizedMatrix` (`block_matrix`)."""
        return block_matrix(self.weight_blocks, self.qtype)

    def _kernel_forward(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        kernel = self._kernel_operands()
        if isinstance(kernel, PackedMatrix):
            return qlinear(x, kernel, self.bias)
        if isinstance(kernel, Tensor):  # q8_0 without the C++ kernels: its float weight
            return F.linear(x, kernel.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        return int4_kernel_linear(x, kernel, BLOCK_SIZE, self.d_out, self.bias)

    def _kernel_operands(self) -> PackedMatrix | tuple[Tensor, Tensor] | Tensor:
        """What the fast path multiplies with, made once per set of weights: the C++ kernels' packed
        matrix, else PyTorch's int4 kernel's operands (scale d and zero, the value of level 8, m + 8d),
        else (q8_0) the float weight."""
        kernel = self._kernel
        device = None if kernel is None else (kernel.device if not isinstance(kernel, tuple) else kernel[0].device)
        if kernel is None or device != self.weight_blocks.device:
            ops = kernel_ops()
            if ops is not None and self.weight_blocks.device.type == "cpu":
                # The C++ packer reads the blocks directly: pack(self.quantized_matrix()), byte for byte.
                levels, scales, mins = ops.pack_ggml(self.weight_blocks, self.qtype)
                kernel = PackedMatrix(levels, scales, mins, 8 if self.qtype == "q8_0" else 4,
                                      OFFSETS[self.qtype], 1, self.d_out, None)
            elif self.qtype == "q8_0":
                kernel = self.dequantized_weight()
            else:
                levels, d, m = block_fields(self.weight_blocks, self.qtype)
                kernel = int4_kernel_operands(levels, d, torch.zeros_like(d) if m is None else m + 8 * d)
            self._kernel = kernel
        return kernel

    def prepare_for_compile(self) -> None:
        """Lay the weight out for the kernel now (at load, so the first token does not wait for it,
        and outside a compiled graph, which reads the packed copy and never makes it)."""
        if self.impl == "fast" and self.weight_blocks.device.type == "cpu" and not self.weight_blocks.is_meta:
            self._kernel_operands()

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._kernel = None  # new weights: re-pack them for the kernel
        super()._load_from_state_dict(*args, **kwargs)
        self.prepare_for_compile()

    def _apply(self, fn: Any, recurse: bool = True) -> "BlockLinear":
        had_copy, self._kernel = self._kernel is not None, None  # .to(device) makes new buffers: re-pack them
        super()._apply(fn, recurse)
        if had_copy:
            self.prepare_for_compile()
        return self

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}, qtype={self.qtype}, bias={self.bias is not None}, impl={self.impl}"


@dataclass(frozen=True)
class BlockOptions:
    """Which Linear layers take the block format: `layers` names them (as `model.named_modules()`
    does; a GGUF import lists the ones its file holds in this format; "unembed" in a model whose
    unembedding is the embedding's transpose means a quantized copy of it), None means every Linear
    whose input width divides into blocks of 32, and a tied unembedding too."""

    layers: list[str] | None = None


def _block_targets(model: nn.Module, options: BlockOptions) -> list[str]:
    """The names of the float Linear layers to replace (every one named must be one)."""
    linears = {name for name, m in model.named_modules() if isinstance(m, Linear)}
    if options.layers is None:
        return sorted(name for name in linears if model.get_submodule(name).weight.shape[1] % BLOCK_SIZE == 0)
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
    impl = getattr(getattr(model, "config", None), "impl", "fast")
    tied = _tied(model) and (options.layers is None or UNEMBED in options.layers)
    for name in _block_targets(model, options):
        if name == UNEMBED and tied:
            continue  # made from the embedding below
        parent_name, _, child_name = name.rpartition(".")
        child = model.get_submodule(name)
        d_out, d_in = child.weight.shape
        layer = (BlockLinear.from_weight(child.weight, child.bias, qtype, impl) if quantize
                 else BlockLinear(d_in, d_out, qtype, child.bias is not None, impl).to(child.weight.device))
        setattr(model.get_submodule(parent_name) if parent_name else model, child_name, layer)
    if tied and model.embed.weight.shape[1] % BLOCK_SIZE == 0:
        embed = model.embed.weight
        model.unembed = (BlockLinear.from_weight(embed, None, qtype, impl) if quantize
                         else BlockLinear(embed.shape[1], embed.shape[0], qtype, False, impl).to(embed.device))


def _block_transform(qtype: str, summary: str) -> Transform:
    return Transform(qtype, lambda model, options: _apply(qtype, model, options, quantize=True), options=BlockOptions,
                     rebuild=lambda model, options: _apply(qtype, model, options, quantize=False),
                     kind="quantization", summary=summary)


Q4_0 = _block_transform("q4_0", "llama.cpp's Q4_0 blocks: 32 weights share an fp16 scale (4.5 bits per weight)")
Q4_1 = _block_transform("q4_1", "llama.cpp's Q4_1 blocks: 32 weights share an fp16 scale and minimum (5 bits per weight)")
Q8_0 = _block_transform("q8_0", "llama.cpp's Q8_0 blocks: 32 int8 weights share an fp16 scale (8.5 bits per weight)")
