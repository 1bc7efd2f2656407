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
path dequantizes and multiplies. Its fast path (CPU) hands the same 4-bit levels to PyTorch's int4
kernel, as `Int4Linear` does, with scale d and zero (the value of level 8) m + 8d; that kernel takes
its scales, zeros and activations in bf16, so its outputs differ from the readable path's by that
rounding (the tests bound it). Quantizing a float weight (`BlockLinear.from_weight`, the `q4_0` and
`q4_1` transforms) uses the gguf package's quantizers, which give llama.cpp's reference bytes.

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
from glasslm.transforms.quantize import (
    Int4Linear, Int8Linear, KernelWithInputGradient, int4_kernel_linear, int4_kernel_operands,
)
from glasslm.transforms.registry import Transform

BLOCK_SIZE = 32  # inputs per block, in every format here
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34}  # header + levels
LAYER_FORMATS = ("q4_0", "q4_1")  # the formats a BlockLinear holds (q8_0 has no fast kernel here yet)


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
    """A Linear whose weight is llama.cpp blocks (q4_0 or q4_1), used as they are."""

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
        self._kernel: tuple[Tensor, Tensor] | None = None  # the int4 kernel's layout, made on first use

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
        return layer

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> Float[Tensor, "d_out d_in"]:
        return dequantize_blocks(self.weight_blocks, self.qtype).to(dtype)

    def forward(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        if self.impl == "fast" and x.device.type == "cpu":
            if torch.is_grad_enabled() and x.requires_grad:
                return KernelWithInputGradient.apply(x, self)
            return self._kernel_forward(x)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight(x.dtype), bias)

    def _kernel_forward(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        return int4_kernel_linear(x, self._kernel_operands(), BLOCK_SIZE, self.d_out, self.bias)

    def _kernel_operands(self) -> tuple[Tensor, Tensor]:
        """The int4 kernel's operands: scale d and zero (the value of level 8) 0 or m + 8d; made once."""
        if self._kernel is None or self._kernel[0].device != self.weight_blocks.device:
            levels, d, m = block_fields(self.weight_blocks, self.qtype)
            zeros = torch.zeros_like(d) if m is None else m + 8 * d
            self._kernel = int4_kernel_operands(levels, d, zeros)
        return self._kernel

    def prepare_for_compile(self) -> None:
        """Pack the weight for the kernel now: a compiled graph reads the packed copy, never makes it."""
        self._kernel_operands()

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._kernel = None  # new weights: re-pack them for the kernel on the next call
        super()._load_from_state_dict(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}, qtype={self.qtype}, bias={self.bias is not None}, impl={self.impl}"


@dataclass(frozen=True)
class BlockOptions:
    """Which Linear layers take the block format: `layers` names them (as `model.named_modules()`
    does; a GGUF import lists the ones its file holds in this format), None means every Linear whose
    input width divides into blocks of 32, and a tied unembedding gets its own quantized copy."""

    layers: list[str] | None = None


def _block_targets(model: nn.Module, options: BlockOptions) -> list[str]:
    """The names of the float Linear layers to replace (every one named must be one)."""
    linears = {name for name, m in model.named_modules() if isinstance(m, Linear)}
    if options.layers is None:
        return sorted(name for name in linears if model.get_submodule(name).weight.shape[1] % BLOCK_SIZE == 0)
    quantized = {name for name, m in model.named_modules() if isinstance(m, (Int8Linear, Int4Linear, BlockLinear))}
    wrong = [name for name in options.layers if name not in linears]
    if wrong:
        what = "already quantized" if set(wrong) <= quantized else "not Linear layers of this model"
        raise ValueError(f"{', '.join(wrong[:4])} {'is' if len(wrong) == 1 else 'are'} {what}")
    return list(options.layers)


def _apply(qtype: str, model: nn.Module, options: BlockOptions, quantize: bool) -> None:
    """Replace the chosen Linears by `qtype` BlockLinears: quantized from their weights, or (on
    rebuild, for a checkpoint's weights to be assigned) empty."""
    impl = getattr(getattr(model, "config", None), "impl", "fast")
    for name in _block_targets(model, options):
        parent_name, _, child_name = name.rpartition(".")
        child = model.get_submodule(name)
        d_out, d_in = child.weight.shape
        layer = (BlockLinear.from_weight(child.weight, child.bias, qtype, impl) if quantize
                 else BlockLinear(d_in, d_out, qtype, child.bias is not None, impl).to(child.weight.device))
        setattr(model.get_submodule(parent_name) if parent_name else model, child_name, layer)
    tied = options.layers is None and getattr(model, "unembed", "absent") is None
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
