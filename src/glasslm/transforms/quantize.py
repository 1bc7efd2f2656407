"""Weight-only int8 and int4 quantization for decoding: a quarter or an eighth of fp32's bytes per weight.

Decoding one token reads every weight once and does little arithmetic with each, so its speed is
set by memory bandwidth: GPT-2 small is ~500 MB of fp32 weights, ~125 MB in int8. Each output
channel (a row of a Linear's weight) keeps one scale:

    scale[o] = max_i |W[o, i]| / 127        W_int8[o, i] = round(W[o, i] / scale[o])   in [-127, 127]
    y = x @ (scale[:, None] * W_int8).T + bias

Activations stay in floating point (weight-only), so only the rounding of the weights costs quality:
the tests hold perplexity within 1% of fp32 and greedy tokens mostly identical.

Two paths behind one module, as everywhere in glasslm: `readable` dequantizes the weight and does
an ordinary matmul (any device, any dtype); `fast` calls PyTorch's CPU kernel that reads the int8
weight directly (`aten._weight_int8pack_mm`, the kernel gpt-fast uses on CPU). That kernel takes
bfloat16 activations here, so the fast path rounds `x` to bf16 on the way in.

One-row inputs (a batch-1 decoding step) take a third path, what llama.cpp does for q8_0: the
activation row is itself quantized to 8 bits on the fly (one scale and zero point for the row) and
the product runs as int8 x uint8 dot products with int32 sums (fbgemm's dynamic quantized linear,
VNNI instructions where the CPU has them). That kernel converts nothing to floating point inside
its loop, so it runs 2-3x faster than the bf16 kernel, which is compute-bound at batch 1
(benchmarks/bench_llamacpp.py). Rounding the activations costs at most half an activation step per
input, times the row's absolute weights: `dynamic_int8_error_bound` states it and the tests hold
the kernel to it. Rows of prefill and batches keep the weight-only kernel, so each row's rounding
never depends on other rows.

int4 (`Int4Linear`, gpt-fast's scheme) stores 16 levels per weight, so one scale per row would be
too coarse: each group of `group_size` consecutive inputs of a row gets its own scale and zero point,

    W[o, i] ≈ (q[o, i] - 8) * scale[o, g] + zero[o, g]      q in 0..15,  g = i // group_size

and two 4-bit values share a byte. Its fast path is PyTorch's CPU kernel
`aten._weight_int4pack_mm_for_cpu` (bf16 activations, scales and zeros in bf16, which is how they are
stored); rows whose input width is not a multiple of 32 use the readable path.

Example:
    >>> import torch
    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.transforms import apply_transform
    >>> model = TransformerLM(get_preset("llama-tiny")).eval()
    >>> tokens = torch.randint(0, 512, (1, 8))
    >>> reference = model(tokens)
    >>> apply_transform(model, "int8")  # the registered transform: recorded, so checkpoints reload it
    >>> (model(tokens) - reference).abs().max().item() < 0.05
    True
"""

from __future__ import annotations

import functools
import itertools
import math
import warnings
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from glasslm.core.layers import Linear
from glasslm.kernels.qmatmul import PackedMatrix, QuantizedMatrix, kernel_ops, pack, qlinear
from glasslm.runtime import cpu_flags
from glasslm.transforms.registry import Transform

# torch 2.13's CPU kernel returns garbage, or crashes, when d_in is not a multiple of 32 (seen with
# d_in 40, 56, 100, 344; every multiple of 32 tried was right): such layers take the readable path.
_KERNEL_D_IN_MULTIPLE = 32


# fbgemm's packed weight is a TorchScript object, which a compiled decoding step (`torch.compile`)
# cannot take into its graph: every layer would break the graph in two. So compiled code reaches
# the same kernel through this op, which finds the packed weight by number and which the compiler
# keeps as one opaque call. Eager calls go straight to fbgemm.
_PACKED_BY_NUMBER: dict[int, Any] = {}
_PACKED_NUMBERS = itertools.count()
_OPS = torch.library.Library("glasslm", "DEF")
_OPS.define("int8_dynamic_linear(Tensor x, int packed, int d_out, bool reduce_range) -> Tensor")


def _int8_dynamic_linear(x: Tensor, packed: int, d_out: int, reduce_range: bool) -> Tensor:
    """(1, d_in) fp32 -> (1, d_out) fp32 through the fbgemm weight numbered `packed`."""
    return torch.ops.quantized.linear_dynamic(x, _PACKED_BY_NUMBER[packed], reduce_range)


def _int8_dynamic_linear_shape(x: Tensor, packed: int, d_out: int, reduce_range: bool) -> Tensor:
    return x.new_empty(x.shape[0], d_out)


_OPS.impl("int8_dynamic_linear", _int8_dynamic_linear, "CPU")
torch.library.register_fake("glasslm::int8_dynamic_linear", _int8_dynamic_linear_shape, lib=_OPS)


def int8_per_channel(weight: Float[Tensor, "d_out d_in"]) -> tuple[Tensor, Float[Tensor, "d_out"]]:
    """(int8 weight, float32 scale per output channel), symmetric, so that W ≈ scale[:, None] * W_int8."""
    weight = weight.detach().float()
    # An all-zero row gets scale 1 (its int8 row is zero either way) instead of a division by zero.
    scales = weight.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    quantized = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return quantized, scales


@functools.cache
def dynamic_int8_available() -> bool:
    """True where PyTorch has fbgemm's dynamic quantized linear (x86 CPUs). Cached: asked once per
    layer per token, and torch builds the engine list anew each time (~3 µs)."""
    return bool({"fbgemm", "x86"} & set(torch.backends.quantized.supported_engines))


def dynamic_int8_reduce_range() -> bool:
    """Whether activations must use 7 bits instead of 8: without VNNI, fbgemm sums pairs of u8 x s8
    products in int16 (vpmaddubsw), which 8-bit activations can saturate; VNNI sums in int32."""
    return not cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"}


def dynamic_int8_error_bound(
    x: Float[Tensor, "1 d_in"], weight: Float[Tensor, "d_out d_in"], reduce_range: bool,
) -> Float[Tensor, "d_out"]:
    """The most that rounding the row `x` to 8 bits can move each output of `x @ weight.T`.

    The row's range (always including 0, so zero is exact) is cut into 255 steps (127 with
    `reduce_range`); each input moves by at most half a step, and output o by at most that times
    sum_i |weight[o, i]|.
    """
    levels = 127 if reduce_range else 255
    step = (x.max().clamp(min=0) - x.min().clamp(max=0)) / levels
    return step / 2 * weight.abs().sum(dim=1)


class KernelWithInputGradient(torch.autograd.Function):
    """A quantized layer's fast kernel forward; backward to the input through its dequantized weight.

    The int8/int4 kernels have no derivative, and the quantized weights are frozen, so the only
    gradient needed is the input's: what QLoRA needs to reach adapters in earlier layers.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, layer: nn.Module) -> Tensor:
        ctx.layer = layer
        with torch.no_grad():
            return layer._kernel_forward(x)

    @staticmethod
    def backward(ctx: Any, grad_y: Tensor) -> tuple[Tensor, None]:
        return grad_y @ ctx.layer.dequantized_weight(grad_y.dtype), None   # (..., d_out) @ (d_out, d_in)


class Int8Linear(nn.Module):
    """A Linear whose weight is stored as int8 with one float scale per output channel."""

    def __init__(self, d_in: int, d_out: int, bias: bool = True, impl: str = "fast"):
        super().__init__()
        self.d_in, self.d_out, self.impl = d_in, d_out, impl
        self.register_buffer("weight_int8", torch.zeros(d_out, d_in, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(d_out))
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None

    @classmethod
    def from_weight(cls, weight: Tensor, bias: Tensor | None, impl: str = "fast") -> "Int8Linear":
        d_out, d_in = weight.shape
        layer = cls(d_in, d_out, bias=False, impl=impl).to(weight.device)
        layer.weight_int8, layer.scales = (t.to(weight.device) for t in int8_per_channel(weight))
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        if impl == "fast":
            layer.prepare_for_compile()
        return layer

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> Float[Tensor, "d_out d_in"]:
        return self.weight_int8.to(dtype) * self.scales[:, None].to(dtype)

    def forward(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        if self.impl == "fast" and x.device.type == "cpu" and self.d_in % _KERNEL_D_IN_MULTIPLE == 0:
            if torch.is_grad_enabled() and x.requires_grad:
                return KernelWithInputGradient.apply(x, self)
            return self._kernel_forward(x)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight(x.dtype), bias)

    def _kernel_forward(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        packed = self._packed_matrix()
        if packed is not None:  # glasslm's own kernel: int8 activations in blocks of 32, every row
            return qlinear(x, packed, self.bias)
        compiling = torch.compiler.is_compiling()
        if x.numel() == self.d_in and (self._packed_number is not None if compiling else dynamic_int8_available()):
            # One row: int8 activations and int8 dot products, (1, d_in) -> (1, d_out) in fp32, the
            # bias added inside the kernel (it is packed with the weight).
            row = x.reshape(1, self.d_in).float()
            if compiling:
                y = torch.ops.glasslm.int8_dynamic_linear(row, self._packed_number, self.d_out, self._reduce_range)
            else:
                packed, reduce_range = self._dynamic_packed()
                y = torch.ops.quantized.linear_dynamic(row, packed, reduce_range)
            return y.to(x.dtype).reshape(*x.shape[:-1], self.d_out)
        if not compiling and (self.weight_int8.data_ptr() % 64 or not self.weight_int8.is_contiguous()):
            # Tensors read from a safetensors file can start anywhere in it; the kernel's vector
            # loads need the allocator's 64-byte alignment (an unaligned weight crashed it).
            self.weight_int8 = self.weight_int8.contiguous().clone()
        # The kernel wants 2-D bf16 input and scales of the same dtype: (rows, d_in) -> (rows, d_out).
        rows = x.reshape(-1, self.d_in).to(torch.bfloat16)
        y = torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self._bf16_scales())
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.d_out)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def _dynamic_packed(self) -> tuple[Any, bool]:
        """fbgemm's packed copy of the int8 weight, its scales and the float32 bias, made on first
        use (kept beside `weight_int8`, which stays the saved form and feeds the other paths), and
        whether this CPU needs 7-bit activations (`dynamic_int8_reduce_range`)."""
        packed = getattr(self, "_packed", None)
        if packed is None:
            zero_points = torch.zeros(self.d_out, dtype=torch.long)
            with warnings.catch_warnings():
                # torch 2.13 marks quantized tensors deprecated; this one lives only inside the packing.
                warnings.simplefilter("ignore", UserWarning)
                weight = torch._make_per_channel_quantized_tensor(
                    self.weight_int8.cpu(), self.scales.double().cpu(), zero_points, 0)
                # (The CPU check is made here, once, not per call: a compiled step cannot read /proc.)
                bias = None if self.bias is None else self.bias.detach().float().cpu()
                packed = self._packed = torch.ops.quantized.linear_prepack(weight, bias), dynamic_int8_reduce_range()
        return packed

    _packed_number: int | None = None  # set by `prepare_for_compile`
    _reduce_range = False
    _matrix: PackedMatrix | None = None  # the C++ kernels' layout (glasslm.kernels), made when weights arrive

    def _packed_matrix(self) -> PackedMatrix | None:
        """The weight in glasslm's kernels' layout (made once): levels w + 128 with the per-channel
        scale as the row scale; None without the C++ kernels or off the CPU."""
        if self._matrix is None or self._matrix.device != self.weight_int8.device:
            if kernel_ops() is None or self.weight_int8.device.type != "cpu":
                return None
            self._matrix = pack(self.quantized_matrix())
        return self._matrix

    def kernel_matrix(self) -> PackedMatrix | None:
        """The packed matrix `forward` multiplies a float32 CPU row by (None: it takes another path)."""
        if self.impl != "fast" or self.d_in % _KERNEL_D_IN_MULTIPLE:
            return None
        return self._packed_matrix()

    def quantized_matrix(self) -> QuantizedMatrix:
        """The weight as the kernels' readable `QuantizedMatrix`: levels w + 128 (offset 128), block
        scale 1, the per-channel scale as the row scale."""
        levels = self.weight_int8.view(torch.uint8) ^ 0x80  # two's complement w -> w + 128
        ones = torch.ones(self.d_out, 1, dtype=torch.float16, device=levels.device)
        return QuantizedMatrix(levels, ones, None, 8, 128, self.d_in, self.scales)

    def prepare_for_compile(self) -> None:
        """Make, outside the compiled graph, what the kernels would otherwise make on first use (at
        load, so the first token does not wait for it)."""
        if self.d_in % _KERNEL_D_IN_MULTIPLE or self.weight_int8.is_meta:
            return
        if self._packed_matrix() is not None:
            return
        self._bf16_scales()
        if not self.weight_int8.is_contiguous() or self.weight_int8.data_ptr() % 64:
            self.weight_int8 = self.weight_int8.contiguous().clone()
        if dynamic_int8_available() and self._packed_number is None:
            packed, self._reduce_range = self._dynamic_packed()
            number = self._packed_number = next(_PACKED_NUMBERS)
            _PACKED_BY_NUMBER[number] = packed
            weakref.finalize(self, _PACKED_BY_NUMBER.pop, number, None)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._forget_kernel_copies()
        super()._load_from_state_dict(*args, **kwargs)
        if self.impl == "fast":
            self.prepare_for_compile()

    def _apply(self, fn: Any, recurse: bool = True) -> "Int8Linear":
        # .to(dtype or device) makes new buffers: the kernels' copies of the old ones are stale.
        had_copies = self._matrix is not None or self._packed_number is not None
        self._forget_kernel_copies()
        super()._apply(fn, recurse)
        if had_copies and self.weight_int8.device.type == "cpu":
            self.prepare_for_compile()
        return self

    def _forget_kernel_copies(self) -> None:
        # New weights: re-pack them (a compiled step sees a new number and retraces).
        _PACKED_BY_NUMBER.pop(self._packed_number, None)
        self._packed = self._scales_bf16 = self._packed_number = self._matrix = None

    def _bf16_scales(self) -> Tensor:
        # Cached: converting d_out scales on every call would be a small but needless copy per layer.
        cached = getattr(self, "_scales_bf16", None)
        if cached is None or cached.device != self.scales.device:
            cached = self._scales_bf16 = self.scales.to(torch.bfloat16)
        return cached

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}, bias={self.bias is not None}, impl={self.impl}"


def int4_group_size(d_in: int, preferred: int = 64) -> int:
    """The group width for a row of `d_in` inputs: `preferred` where it divides d_in, else the
    largest power of two that does (the kernel takes 32 to 256; narrower groups run readable)."""
    return math.gcd(d_in, preferred)


def int4_groupwise(weight: Float[Tensor, "d_out d_in"], group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """(q in 0..15 as uint8 (d_out, d_in), scales, zeros (d_out, d_in / group_size) in bfloat16).

    Each group's range [min, max] is cut into 15 equal steps; `zero` is the value of level 8. Scale
    and zero are rounded to bf16 first and q computed against the rounded values, so the stored
    numbers are exactly the ones every path dequantizes with.
    """
    d_out, d_in = weight.shape
    groups = weight.detach().float().reshape(d_out, d_in // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15).clamp(min=1e-8).to(torch.bfloat16)
    zeros = (low + 8 * scales.float()).to(torch.bfloat16)
    levels = torch.round((groups - zeros.float()[..., None]) / scales.float()[..., None]) + 8
    return levels.clamp(0, 15).to(torch.uint8).reshape(d_out, d_in), scales, zeros


def pack_nibbles(q: Tensor) -> Tensor:
    """(rows, cols) values 0..15 -> (rows, cols / 2) bytes: column 2j in the low nibble, 2j+1 high."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """The inverse of `pack_nibbles`: (rows, cols / 2) bytes -> (rows, cols) values 0..15."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def int4_kernel_operands(
    levels: Int[Tensor, "d_out d_in"], scales: Float[Tensor, "d_out groups"], zeros: Float[Tensor, "d_out groups"]
) -> tuple[Tensor, Tensor]:
    """PyTorch's int4 CPU kernel's operands for W = (q - 8) * scale + zero, per group of inputs:
    the levels q (0..15) in the kernel's own packed layout, and (groups, d_out, 2) scales and zeros
    in bf16 (the kernel's only fast dtype). The kernel needs d_out in multiples of 16: the extra
    rows are zero, and `int4_kernel_linear` cuts them from its output."""
    padded = -levels.shape[0] % 16
    q = F.pad(levels.to(torch.int32), (0, 0, 0, padded))
    scales, zeros = (F.pad(t, (0, 0, 0, padded)) for t in (scales, zeros))
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_and_zeros = torch.stack((scales, zeros), dim=-1).transpose(0, 1).to(torch.bfloat16)
    return weight, scales_and_zeros.contiguous()


def int4_kernel_linear(x: Float[Tensor, "... d_in"], operands: tuple[Tensor, Tensor], group_size: int, d_out: int,
                       bias: Tensor | None) -> Float[Tensor, "... d_out"]:
    """x @ W.T + bias through PyTorch's int4 CPU kernel (`operands` from `int4_kernel_operands`);
    the kernel takes 2-D bf16 rows, so x is rounded to bf16 on the way in."""
    weight, scales_and_zeros = operands
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, weight, group_size, scales_and_zeros)
    if y.shape[1] != d_out:
        y = y[:, :d_out]  # drop the padding rows
    y = y.to(x.dtype).reshape(*x.shape[:-1], d_out)
    return y if bias is None else y + bias.to(x.dtype)


class Int4Linear(nn.Module):
    """A Linear whose weight is stored as 4-bit levels with a bf16 scale and zero per group of inputs."""

    def __init__(self, d_in: int, d_out: int, bias: bool = True, impl: str = "fast"):
        super().__init__()
        if d_in % 2:
            raise ValueError(f"int4 packs two weights per byte; d_in {d_in} is odd")
        self.d_in, self.d_out, self.impl = d_in, d_out, impl
        self.group_size = int4_group_size(d_in)
        groups = d_in // self.group_size
        self.register_buffer("weight_int4", torch.zeros(d_out, d_in // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.ones(d_out, groups, dtype=torch.bfloat16))
        self.register_buffer("zeros", torch.zeros(d_out, groups, dtype=torch.bfloat16))
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None
        self._kernel: PackedMatrix | tuple[Tensor, Tensor] | None = None  # the kernel's layout, made when weights arrive

    @classmethod
    def from_weight(cls, weight: Tensor, bias: Tensor | None, impl: str = "fast") -> "Int4Linear":
        d_out, d_in = weight.shape
        layer = cls(d_in, d_out, bias=False, impl=impl).to(weight.device)
        q, layer.scales, layer.zeros = int4_groupwise(weight, layer.group_size)
        layer.weight_int4 = pack_nibbles(q)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        if impl == "fast":
            layer.prepare_for_compile()
        return layer

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> Float[Tensor, "d_out d_in"]:
        q = unpack_nibbles(self.weight_int4).float().unflatten(-1, (-1, self.group_size))  # (d_out, groups, size)
        weight = (q - 8) * self.scales.float()[..., None] + self.zeros.float()[..., None]
        return weight.flatten(-2).to(dtype)

    def forward(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        if self.impl == "fast" and x.device.type == "cpu" and self.group_size % 32 == 0:
            if torch.is_grad_enabled() and x.requires_grad:
                return KernelWithInputGradient.apply(x, self)
            return self._kernel_forward(x)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight(x.dtype), bias)

    def _kernel_forward(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        kernel = self._kernel_operands()
        if isinstance(kernel, PackedMatrix):  # glasslm's own kernel: int8 activations in blocks of 32
            return qlinear(x, kernel, self.bias)
        return int4_kernel_linear(x, kernel, self.group_size, self.d_out, self.bias)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._kernel = None  # new weights: re-pack them for the kernel
        super()._load_from_state_dict(*args, **kwargs)
        if self.impl == "fast":
            self.prepare_for_compile()

    def _apply(self, fn: Any, recurse: bool = True) -> "Int4Linear":
        had_copy, self._kernel = self._kernel is not None, None  # .to(dtype or device): new buffers to re-pack
        super()._apply(fn, recurse)
        if had_copy:
            self.prepare_for_compile()
        return self

    def prepare_for_compile(self) -> None:
        """Pack the weight for the kernel now (at load, so the first token does not wait for it; a
        compiled graph reads the packed copy, never makes it)."""
        if self.group_size % 32 == 0 and not self.weight_int4.is_meta:
            self._kernel_operands()

    def _kernel_operands(self) -> PackedMatrix | tuple[Tensor, Tensor]:
        """The kernel's operands, made once: glasslm's kernels' layout (levels, bf16 scales, the
        zeros as minimums, offset 8), else PyTorch's int4 kernel's (`int4_kernel_operands`)."""
        kernel = self._kernel
        device = None if kernel is None else (kernel.device if isinstance(kernel, PackedMatrix) else kernel[0].device)
        if kernel is None or device != self.weight_int4.device:
            if kernel_ops() is not None and self.weight_int4.device.type == "cpu":
                kernel = pack(self.quantized_matrix())
            else:
                kernel = int4_kernel_operands(unpack_nibbles(self.weight_int4), self.scales, self.zeros)
            self._kernel = kernel
        return kernel

    def kernel_matrix(self) -> PackedMatrix | None:
        """The packed matrix `forward` multiplies a float32 CPU row by (None: it takes another path)."""
        if self.impl != "fast" or self.group_size % 32 or self.weight_int4.device.type != "cpu":
            return None
        kernel = self._kernel_operands()
        return kernel if isinstance(kernel, PackedMatrix) else None

    def quantized_matrix(self) -> QuantizedMatrix:
        """The weight as the kernels' readable `QuantizedMatrix`: levels 0..15, offset 8, the bf16
        scales, the bf16 zeros as minimums."""
        # The scales are bf16 as made; a model's .float() makes them float32, which bf16 holds exactly.
        dtype = self.scales.dtype if self.scales.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
        return QuantizedMatrix(unpack_nibbles(self.weight_int4), self.scales.to(dtype), self.zeros.to(dtype), 4, 8,
                               self.group_size)

    def extra_repr(self) -> str:
        return (f"d_in={self.d_in}, d_out={self.d_out}, group_size={self.group_size}, bias={self.bias is not None}, "
                f"impl={self.impl}")


def quantize_linears(model: nn.Module, layer_cls: type[Int8Linear] | type[Int4Linear]) -> None:
    """Replace every glasslm `Linear` inside `model` by a `layer_cls` layer, in place (for inference).

    A tied unembedding (the token embedding's transpose) gets its own quantized copy as
    `model.unembed`, since it is the single largest matrix read per token; the embedding lookup
    stays exact. The layers take the model config's `impl` ("fast" or "readable"). A model that
    already holds quantized layers is refused: rounding rounded weights again only loses more.
    """
    # (Any quantized layer has a dequantized_weight: int8, int4, and llama.cpp's blocks from glasslm.transforms.ggml.)
    already = {type(m).__name__ for m in model.modules() if hasattr(m, "dequantized_weight")}
    if already:
        raise ValueError(f"the model is already quantized ({', '.join(sorted(already))}); quantize a float model")
    config = getattr(model, "config", None)
    impl = getattr(config, "impl", "fast")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear):
                setattr(parent, name, layer_cls.from_weight(child.weight, child.bias, impl))
    if config is not None and getattr(model, "unembed", "absent") is None:
        model.unembed = layer_cls.from_weight(model.embed.weight, None, impl)


INT8 = Transform("int8", lambda model, _: quantize_linears(model, Int8Linear), kind="quantization",
                 summary="weight-only int8, one scale per output channel (a quarter of fp32's bytes)")
INT4 = Transform("int4", lambda model, _: quantize_linears(model, Int4Linear), kind="quantization",
                 summary="weight-only int4, a scale and zero per group of 64 inputs (an eighth of fp32's bytes)")
