"""Weight-only int8 quantization for decoding: a quarter of fp32's bytes per weight.

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

Example:
    >>> import torch
    >>> from glasslm.core.config import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> model = TransformerLM(get_preset("llama-tiny")).eval()
    >>> tokens = torch.randint(0, 512, (1, 8))
    >>> reference = model(tokens)
    >>> quantize_int8(model)
    >>> (model(tokens) - reference).abs().max().item() < 0.05
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

from .core.layers import Linear

METHODS = ("int8",)
# torch 2.13's CPU kernel returns garbage, or crashes, when d_in is not a multiple of 32 (seen with
# d_in 40, 56, 100, 344; every multiple of 32 tried was right): such layers take the readable path.
_KERNEL_D_IN_MULTIPLE = 32


def int8_per_channel(weight: Float[Tensor, "d_out d_in"]) -> tuple[Tensor, Float[Tensor, "d_out"]]:
    """(int8 weight, float32 scale per output channel), symmetric, so that W ≈ scale[:, None] * W_int8."""
    weight = weight.detach().float()
    # An all-zero row gets scale 1 (its int8 row is zero either way) instead of a division by zero.
    scales = weight.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    quantized = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return quantized, scales


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
        return layer

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> Float[Tensor, "d_out d_in"]:
        return self.weight_int8.to(dtype) * self.scales[:, None].to(dtype)

    def forward(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        if self.impl == "fast" and x.device.type == "cpu" and self.d_in % _KERNEL_D_IN_MULTIPLE == 0:
            if self.weight_int8.data_ptr() % 64 or not self.weight_int8.is_contiguous():
                # Tensors read from a safetensors file can start anywhere in it; the kernel's vector
                # loads need the allocator's 64-byte alignment (an unaligned weight crashed it).
                self.weight_int8 = self.weight_int8.contiguous().clone()
            # The kernel wants 2-D bf16 input and scales of the same dtype: (rows, d_in) -> (rows, d_out).
            rows = x.reshape(-1, self.d_in).to(torch.bfloat16)
            y = torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self._bf16_scales())
            y = y.to(x.dtype).reshape(*x.shape[:-1], self.d_out)
            return y if self.bias is None else y + self.bias.to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight(x.dtype), bias)

    def _bf16_scales(self) -> Tensor:
        # Cached: converting d_out scales on every call would be a small but needless copy per layer.
        cached = getattr(self, "_scales_bf16", None)
        if cached is None or cached.device != self.scales.device:
            cached = self._scales_bf16 = self.scales.to(torch.bfloat16)
        return cached

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}, bias={self.bias is not None}, impl={self.impl}"


def quantize_int8(model: nn.Module, impl: str | None = None) -> None:
    """Replace every glasslm `Linear` inside `model` by an `Int8Linear`, in place (for inference).

    A tied unembedding (the token embedding's transpose) gets its own int8 copy as `model.unembed`,
    since it is the single largest matrix read per token; the embedding lookup stays exact.
    `impl` defaults to the model config's `impl` ("fast" or "readable").
    """
    config = getattr(model, "config", None)
    impl = impl or getattr(config, "impl", "fast")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear):
                setattr(parent, name, Int8Linear.from_weight(child.weight, child.bias, impl))
    if config is not None and getattr(model, "unembed", "absent") is None:
        model.unembed = Int8Linear.from_weight(model.embed.weight, None, impl)


def quantized_structure(model: nn.Module, method: str) -> None:
    """Give a (meta-device) model the module structure of a quantized checkpoint before loading it."""
    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}; choose from {', '.join(METHODS)}")
    quantize_int8(model)
