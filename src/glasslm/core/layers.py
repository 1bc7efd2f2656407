"""The small building blocks: linear maps, embeddings, norms, activations, MLPs, dropout, loss.

Each is written out from tensor ops so it can be read line by line. Where PyTorch has a fused
kernel for the same maths, `impl="fast"` uses it; tests check both give the same numbers.

Example:
    >>> import torch
    >>> norm = LayerNorm(4)
    >>> norm(torch.tensor([[1.0, 2.0, 3.0, 4.0]])).mean().abs() < 1e-6
    tensor(True)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn
from torch.nn.modules import module as _torch_module

# Whether any hook is registered on all modules at once (torch.nn.modules.module.register_module_*
# hooks). A private torch helper: where a torch version lacks it, every hook point takes nn.Module's
# full call, which is always correct.
_has_any_global_hook = getattr(_torch_module, "_has_any_global_hook", lambda: True)


def upcast(x: Tensor) -> Tensor:
    """x in at least float32 (bf16/fp16 go up, float64 stays): for numerically touchy steps."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class HookPoint(nn.Module):
    """An identity function with a name, where hooks can read or replace an activation.

    With no hook registered, calling it costs one Python call and no copy: it returns `x` without
    nn.Module's call machinery (about 1 µs, and a one-token GPT-2 step passes ~170 hook points).
    """

    def __call__(self, x: Tensor) -> Tensor:
        if self.active or self._backward_hooks or self._backward_pre_hooks or _has_any_global_hook():
            return super().__call__(x)
        return x

    def forward(self, x: Tensor) -> Tensor:
        return x

    @property
    def active(self) -> bool:
        return bool(self._forward_hooks or self._forward_pre_hooks)


def any_hooked(*points: HookPoint) -> bool:
    """Whether calling any of `points` runs a hook (forward, backward, or one on every module): a fused
    step whose inside they show must then be written out. Plain dict checks: it runs on every forward."""
    for point in points:
        if point._forward_hooks or point._forward_pre_hooks or point._backward_hooks or point._backward_pre_hooks:
            return True
    return bool(_has_any_global_hook())


def softcap(x: Float[Tensor, "*any"], cap: float, impl: str = "readable") -> Float[Tensor, "*any"]:
    """cap * tanh(x / cap): x unchanged near 0, squashed smoothly into (-cap, cap) (Gemma 2's attention
    scores and logits). `impl="fast"` writes into x where nothing needs it kept for a backward pass
    (inference: a logits tensor of batch x seq x vocab is not allocated twice more).

    >>> [round(v, 4) for v in softcap(torch.tensor([0.1, 100.0]), 30.0).tolist()]  # 0.1 kept, 100 capped under 30
    [0.1, 29.9237]
    """
    if impl == "fast" and not (x.requires_grad and torch.is_grad_enabled()):
        return x.div_(cap).tanh_().mul_(cap)
    return cap * torch.tanh(x / cap)


class Linear(nn.Module):
    """y = x @ weight.T + bias, with weight stored (d_out, d_in) like torch and HF."""

    def __init__(self, d_in: int, d_out: int, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        # F.linear is exactly x @ weight.T + bias, done as one BLAS call (addmm); see `linear`.
        return linear(x, self.weight, self.bias)


def linear(x: Float[Tensor, "... d_in"], weight: Float[Tensor, "d_out d_in"],
           bias: Float[Tensor, "d_out"] | None = None) -> Float[Tensor, "... d_out"]:
    """x @ weight.T + bias (`F.linear`), with a single float32 row shared across threads on a CPU.

    MKL runs a one-row product (every matmul of a batch-1 decoding step) on one thread whatever
    torch's thread count. With the weight laid out column-major (`optimize_for_decoding`), its output
    columns split into one block per thread without a copy, and a batched product (bmm) of the row
    against the blocks runs a block per thread: ~1.5x faster per matrix on 2 threads
    (docs/generation.md). Anything else, including one thread and autograd, is plain `F.linear`.

    Example:
        >>> w = torch.randn(6, 4).T.contiguous().T  # column-major, as optimize_for_decoding lays it
        >>> x = torch.randn(1, 4)
        >>> torch.allclose(linear(x, w), F.linear(x, w), atol=1e-6)
        True
    """
    d_out, d_in = weight.shape
    # Cheapest tests first: training (grad) and multi-row calls leave at the first one or two. The
    # compiler cannot trace the thread count or the strided view, so compiled graphs keep F.linear.
    if (not torch.is_grad_enabled() and x.numel() == d_in and weight.stride() == (1, d_out)
            and x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu"
            and not torch.compiler.is_compiling()):
        threads = torch.get_num_threads()
        if threads > 1:
            return _row_across_threads(x, weight, bias, threads).reshape(*x.shape[:-1], d_out)
    return F.linear(x, weight, bias)


def _row_across_threads(x: Float[Tensor, "... d_in"], weight: Float[Tensor, "d_out d_in"],
                        bias: Float[Tensor, "d_out"] | None, threads: int) -> Float[Tensor, "1 d_out"]:
    """One row times a column-major weight, its output columns cut into `threads` blocks (a bmm)."""
    d_out, d_in = weight.shape
    width = d_out // threads
    columns = weight.T  # (d_in, d_out), contiguous
    # Block b is columns [b * width, (b + 1) * width): a (d_in, width) view with row stride d_out.
    blocks = columns.as_strided((threads, d_in, width), (width, d_out, 1), columns.storage_offset())
    row = x.reshape(1, 1, d_in).expand(threads, 1, d_in)
    y = torch.bmm(row, blocks).reshape(1, threads * width)  # (threads, 1, width): blocks in column order
    if threads * width < d_out:  # the columns left over when d_out does not divide evenly
        y = torch.cat([y, x.reshape(1, d_in) @ columns[:, threads * width:]], dim=1)
    return y if bias is None else y + bias


class Embedding(nn.Module):
    """A lookup table: token id -> row of `weight` (vocab_size, d_model)."""

    def __init__(self, vocab_size: int, d_model: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, d_model))
        nn.init.normal_(self.weight, std=0.02)

    @property
    def device(self) -> torch.device:
        """Where the rows it gives are (decoding puts its tokens and cache there)."""
        return self.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The rows' dtype (every embedding glasslm has answers `device` and `dtype` without its table)."""
        return self.weight.dtype

    def forward(self, tokens: Int[Tensor, "batch seq"]) -> Float[Tensor, "batch seq d_model"]:
        # The same rows as weight[tokens], but that indexing's backward (an accumulating index_put
        # on CPU) sums repeated tokens' gradients in an order that changes with thread timing, so
        # two identical runs drifted apart; F.embedding's backward sums in a fixed order.
        return F.embedding(tokens, self.weight)


class LayerNorm(nn.Module):
    """Normalise each vector to zero mean and unit variance, then scale and shift.

    `unbiased_std=True` is the variant some tutorials write by hand (seed 002):
    (x - mean) / (std + eps) with the unbiased (n - 1) standard deviation, eps outside the root.
    `hook_scale` sees the divisor and `hook_normalized` the normalised vector before the gain and
    bias (TransformerLens's two hooks); either hooked, the step is written out instead of fused.
    """

    def __init__(self, d_model: int, eps: float = 1e-5, bias: bool = True, impl: str = "readable",
                 unbiased_std: bool = False):
        super().__init__()
        self.eps, self.impl, self.unbiased_std = eps, impl, unbiased_std
        self.weight = nn.Parameter(torch.ones(d_model))
        self.bias = nn.Parameter(torch.zeros(d_model)) if bias else None
        self.hook_scale, self.hook_normalized = HookPoint(), HookPoint()

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        if any_hooked(self.hook_scale, self.hook_normalized):  # a hooked step: written out, as TransformerLens's
            out = self.hook_normalized(self._normalize_hooked(x)) * self.weight
            return out if self.bias is None else out + self.bias
        if self.unbiased_std:  # no fused kernel computes this variant
            mean = x.mean(dim=-1, keepdim=True)
            out = self.weight * (x - mean) / (x.std(dim=-1, keepdim=True) + self.eps)
        elif self.impl == "fast":
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        else:
            mean = x.mean(dim=-1, keepdim=True)
            var = x.var(dim=-1, keepdim=True, unbiased=False)  # biased, as in the LayerNorm paper
            out = (x - mean) * torch.rsqrt(var + self.eps) * self.weight
        return out if self.bias is None else out + self.bias

    def _normalize_hooked(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        """(x - mean) / scale, the divisor passed through `hook_scale` ((..., 1), TransformerLens's hook_scale)."""
        centred = x - x.mean(dim=-1, keepdim=True)
        if self.unbiased_std:
            scale = x.std(dim=-1, keepdim=True) + self.eps
        else:
            scale = (centred.pow(2).mean(dim=-1, keepdim=True) + self.eps).sqrt()
        return centred / self.hook_scale(scale)


class RMSNorm(nn.Module):
    """Scale each vector by the inverse of its root-mean-square (no centring, no bias).

    Computed in float32 and cast back, because squaring bf16/fp16 values loses too much precision.
    `unit_offset=True` (Gemma) scales by (1 + weight), the weights starting at 0, in float32 before
    the cast back (as Gemma's reference does).
    """

    def __init__(self, d_model: int, eps: float = 1e-6, impl: str = "readable", unit_offset: bool = False):
        super().__init__()
        self.eps, self.impl, self.unit_offset = eps, impl, unit_offset
        self.weight = nn.Parameter(torch.zeros(d_model) if unit_offset else torch.ones(d_model))
        self.hook_scale, self.hook_normalized = HookPoint(), HookPoint()

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        x32 = upcast(x)
        if any_hooked(self.hook_scale):  # the divisor as its own step, (..., 1) like TransformerLens's hook_scale
            normed = x32 / self.hook_scale((x32.pow(2).mean(dim=-1, keepdim=True) + self.eps).sqrt())
        elif self.impl == "fast":
            normed = F.rms_norm(x32, x.shape[-1:], eps=self.eps)
        else:
            normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        # hook_normalized is before the gain, as TransformerLens's (x / scale, in x's dtype where HF rounds it).
        if self.unit_offset:
            return (self.hook_normalized(normed) * (1.0 + upcast(self.weight))).to(x.dtype)
        # Round to the input dtype before scaling (as HF Llama does), and keep that dtype.
        return (self.hook_normalized(normed.to(x.dtype)) * self.weight).to(x.dtype)


def make_norm(kind: str, d_model: int, eps: float, bias: bool, impl: str, unbiased_std: bool = False,
              unit_offset: bool = False) -> nn.Module:
    if kind == "layernorm":
        return LayerNorm(d_model, eps=eps, bias=bias, impl=impl, unbiased_std=unbiased_std)
    return RMSNorm(d_model, eps=eps, impl=impl, unit_offset=unit_offset)


def norm_for(config, d: int | None = None) -> nn.Module:
    """The norm a ModelConfig asks for, over `d` features (default d_model; q/k norms: d_head)."""
    c = config
    return make_norm(c.norm, d or c.d_model, c.norm_eps, c.site_bias("norm"), c.impl, c.norm_unbiased_std,
                     c.norm_unit_offset)


# --- activations -------------------------------------------------------------------------------

def gelu(x: Tensor) -> Tensor:
    """Exact GELU: x * Phi(x), Phi the standard normal CDF."""
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def gelu_tanh(x: Tensor) -> Tensor:
    """GPT-2's tanh approximation of GELU ("gelu_new" in HF)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def relu(x: Tensor) -> Tensor:
    return x.clamp_min(0.0)


def silu(x: Tensor) -> Tensor:
    """x * sigmoid(x), also called swish."""
    return x * torch.sigmoid(x)


READABLE_ACTIVATIONS = {"gelu": gelu, "gelu_tanh": gelu_tanh, "relu": relu, "silu": silu}
FAST_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def activation(name: str, impl: str = "readable"):
    table = FAST_ACTIVATIONS if impl == "fast" else READABLE_ACTIVATIONS
    return table[name]


def dropout(x: Tensor, p: float, training: bool, impl: str = "readable") -> Tensor:
    """Zero each element with probability p and scale survivors by 1/(1-p) (identity in eval)."""
    if not training or p == 0.0:
        return x
    if impl == "fast":
        return F.dropout(x, p, training=True)
    keep = torch.rand_like(x) >= p
    return x * keep / (1.0 - p)


class MLP(nn.Module):
    """Position-wise feed-forward: down(dropout(act(up(x)))) (the dropout only while training)."""

    def __init__(self, d_model: int, d_mlp: int, act: str, bias: bool, impl: str, hidden_dropout: float = 0.0):
        super().__init__()
        self.hidden_dropout, self.impl = hidden_dropout, impl
        self.up = Linear(d_model, d_mlp, bias=bias)
        self.down = Linear(d_mlp, d_model, bias=bias)
        self.act = activation(act, impl)
        self.hook_pre, self.hook_post = HookPoint(), HookPoint()

    def forward(self, x: Float[Tensor, "batch seq d_model"]) -> Float[Tensor, "batch seq d_model"]:
        hidden = self.hook_pre(self.up(x))  # (batch, seq, d_mlp)
        hidden = self.hook_post(self.act(hidden))
        return self.down(dropout(hidden, self.hidden_dropout, self.training, self.impl))


class SwiGLU(nn.Module):
    """Gated feed-forward (Shazeer 2020, used by Llama): down(silu(gate(x)) * up(x))."""

    def __init__(self, d_model: int, d_mlp: int, act: str, bias: bool, impl: str, hidden_dropout: float = 0.0):
        super().__init__()
        self.hidden_dropout, self.impl = hidden_dropout, impl
        self.gate = Linear(d_model, d_mlp, bias=bias)
        self.up = Linear(d_model, d_mlp, bias=bias)
        self.down = Linear(d_mlp, d_model, bias=bias)
        self.act = activation(act, impl)
        self.hook_pre, self.hook_pre_linear, self.hook_post = HookPoint(), HookPoint(), HookPoint()

    def forward(self, x: Float[Tensor, "batch seq d_model"]) -> Float[Tensor, "batch seq d_model"]:
        gate = self.hook_pre(self.gate(x))  # (batch, seq, d_mlp)
        linear = self.hook_pre_linear(self.up(x))  # (batch, seq, d_mlp): the ungated branch
        hidden = self.hook_post(self.act(gate) * linear)
        return self.down(dropout(hidden, self.hidden_dropout, self.training, self.impl))


def cross_entropy(
    logits: Float[Tensor, "... vocab"], targets: Int[Tensor, "..."], impl: str = "fast",
    ignore_index: int = -100,
) -> Float[Tensor, ""]:
    """Mean of -log softmax(logits)[target] over all positions whose target is not ignore_index."""
    logits = logits.reshape(-1, logits.shape[-1])  # (positions, vocab)
    targets = targets.reshape(-1)
    if impl == "fast":
        return F.cross_entropy(upcast(logits), targets, ignore_index=ignore_index)
    keep = targets != ignore_index
    logits, targets = upcast(logits[keep]), targets[keep]
    log_probs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    return -log_probs.gather(-1, targets[:, None]).mean()
