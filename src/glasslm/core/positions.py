"""Three ways to tell the model where a token sits: learned, sinusoidal and rotary (RoPE).

Learned and sinusoidal positions are vectors added to the token embeddings; rotary positions
rotate each head's queries and keys so that q·k depends only on how far apart two tokens are.

Example:
    >>> import torch
    >>> table = sinusoidal_table(8, 4)
    >>> table[0].tolist()  # position 0: sin(0)=0, cos(0)=1 in each pair
    [0.0, 1.0, 0.0, 1.0]
"""

from __future__ import annotations

import contextlib
import math

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from glasslm.core.layers import upcast


def _shapes_only() -> bool:
    """Whether modules are being built on the meta device (shapes only, weights assigned later): the
    fixed tables then need only their shapes. Computing them there would run PyTorch's reference ops,
    whose first use imports its compiler (~1 s at every model load)."""
    return torch.get_default_device().type == "meta"


def _frequencies_device() -> contextlib.AbstractContextManager:
    """Where to compute a table's few frequencies: the CPU on the meta device (see `_shapes_only`)."""
    return torch.device("cpu") if _shapes_only() else contextlib.nullcontext()


class LearnedPositions(nn.Module):
    """One trained vector per position (GPT-2's `wpe`)."""

    def __init__(self, context_length: int, d_model: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(context_length, d_model))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, positions: Int[Tensor, "*leading seq"]) -> Float[Tensor, "*leading seq d_model"]:
        return self.weight[positions]


def sinusoidal_table(context_length: int, d_model: int, base: float = 10000.0) -> Float[Tensor, "seq d_model"]:
    """PE[pos, 2i] = sin(pos / base^(2i/d)), PE[pos, 2i+1] = cos(pos / base^(2i/d)) (Vaswani et al.)."""
    positions = torch.arange(context_length, dtype=torch.float64)[:, None]  # (seq, 1)
    inv_freq = base ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)  # (d_model/2,)
    angles = positions * inv_freq  # (seq, d_model/2)
    table = torch.empty(context_length, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles)
    return table.float()


class SinusoidalPositions(nn.Module):
    """Fixed sine/cosine position vectors; nothing to learn, not saved in checkpoints."""

    def __init__(self, context_length: int, d_model: int):
        super().__init__()
        table = torch.empty(context_length, d_model) if _shapes_only() else sinusoidal_table(context_length, d_model)
        self.register_buffer("table", table, persistent=False)

    def forward(self, positions: Int[Tensor, "*leading seq"]) -> Float[Tensor, "*leading seq d_model"]:
        return self.table[positions]


def llama3_scaled_frequencies(
    inv_freq: Float[Tensor, "half"], factor: float, low_freq_factor: float, high_freq_factor: float,
    original_context: int,
) -> Float[Tensor, "half"]:
    """Llama 3.1's RoPE scaling: slow the low frequencies down by `factor`, keep the high ones.

    A pair whose wavelength (2*pi / frequency) is shorter than original_context / high_freq_factor
    keeps its frequency (it resolves local order); one longer than original_context /
    low_freq_factor is divided by `factor` (it can now span a longer context); in between, the
    frequency moves linearly in original_context / wavelength from one to the other.

    Example:
        >>> f = llama3_scaled_frequencies(torch.tensor([1.0, 1e-4], dtype=torch.float64), 8.0, 1.0, 4.0, 8192)
        >>> f.tolist()  # wavelength 6.3 is kept, wavelength 62832 > 8192 is slowed 8x
        [1.0, 1.25e-05]
    """
    wavelength = 2 * math.pi / inv_freq
    ratio = original_context / wavelength  # how many wavelengths fit in the original context
    smooth = ((ratio - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0.0, 1.0)
    # smooth = 1: high frequency, unchanged; smooth = 0: low frequency, divided by factor.
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def linear_scaled_frequencies(inv_freq: Float[Tensor, "half"], factor: float) -> Float[Tensor, "half"]:
    """Position interpolation (Chen et al. 2023): every frequency divided by `factor`, as if each
    position were position / factor.

    >>> linear_scaled_frequencies(torch.tensor([1.0, 0.5]), 4.0).tolist()
    [0.25, 0.125]
    """
    return inv_freq / factor


def yarn_scaled_frequencies(
    inv_freq: Float[Tensor, "half"], theta: float, factor: float, original_context: int,
    beta_fast: float = 32.0, beta_slow: float = 1.0,
) -> Float[Tensor, "half"]:
    """YaRN (Peng et al. 2023): keep the pairs that turn more than beta_fast times over the original
    context, slow those that turn fewer than beta_slow times by `factor`, and ramp linearly between.

    The ramp runs over pair indices: pair i turns original_context * inv_freq[i] / (2 pi) times, so
    the index where it turns r times is dims * ln(original_context / (2 pi r)) / (2 ln theta)
    (rounded outwards, as the reference implementation does).

    >>> inv = 10000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    >>> ratio = inv / yarn_scaled_frequencies(inv, 10000.0, 4.0, 64)
    >>> [round(r, 3) for r in ratio[[0, -1]].tolist()]  # the fastest pair kept, the slowest slowed 4x
    [1.0, 4.0]
    """
    dims = 2 * inv_freq.shape[0]

    def pair_turning(rotations: float) -> float:  # the pair index that turns `rotations` times
        return dims * math.log(original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(pair_turning(beta_fast)), 0)
    high = min(math.ceil(pair_turning(beta_slow)), dims - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(dims // 2, dtype=inv_freq.dtype) - low) / (high - low)).clamp(0.0, 1.0)
    # ramp = 0: a fast pair, kept; ramp = 1: a slow pair, divided by factor.
    return inv_freq * (1 - ramp) + inv_freq / factor * ramp


def dynamic_ntk_frequencies(theta: float, dims: int, factor: float, original_context: int,
                            seq_len: int) -> Float[Tensor, "half"]:
    """Dynamic NTK scaling: past the original context, raise the RoPE base so that the slowest pair
    still turns less than once over `seq_len` positions:
    base = theta * (factor * seq_len / original_context - (factor - 1)) ^ (dims / (dims - 2)).
    Within the original context the frequencies are plain RoPE's.

    >>> plain = dynamic_ntk_frequencies(1e4, 8, 2.0, 16, seq_len=16)
    >>> torch.allclose(plain, 1e4 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    True
    >>> bool((dynamic_ntk_frequencies(1e4, 8, 2.0, 16, seq_len=32)[1:] < plain[1:]).all())
    True
    """
    if seq_len > original_context:
        theta = theta * (factor * seq_len / original_context - (factor - 1)) ** (dims / (dims - 2))
    return theta ** (-torch.arange(0, dims, 2, dtype=torch.float64) / dims)


def yarn_attention_factor(factor: float) -> float:
    """YaRN's default multiplier of cos and sin: 0.1 ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def scaled_frequencies(config, theta: float) -> tuple[Float[Tensor, "half"], float]:
    """A ModelConfig's rotary frequencies at base `theta`, scaled as its rope_scaling says, and the
    factor cos and sin are multiplied by (1 except for yarn). The one place rope scaling is applied.

    >>> from glasslm.core.config import ModelConfig
    >>> inv, gain = scaled_frequencies(ModelConfig(d_model=16, n_heads=2, rope_scaling="linear", rope_factor=2.0), 1e4)
    >>> inv.shape, inv[0].item(), gain
    (torch.Size([4]), 0.5, 1.0)
    """
    c = config
    dims = c.rotary_dims or c.d_head
    inv_freq = theta ** (-torch.arange(0, dims, 2, dtype=torch.float64) / dims)  # (dims/2,)
    if c.rope_scaling == "llama3":
        inv_freq = llama3_scaled_frequencies(inv_freq, c.rope_factor, c.rope_low_freq_factor,
                                             c.rope_high_freq_factor, c.rope_original_context)
    elif c.rope_scaling == "linear":
        inv_freq = linear_scaled_frequencies(inv_freq, c.rope_factor)
    elif c.rope_scaling == "yarn":
        inv_freq = yarn_scaled_frequencies(inv_freq, theta, c.rope_factor, c.rope_original_context,
                                           c.rope_beta_fast, c.rope_beta_slow)
        gain = c.rope_attention_factor
        return inv_freq, yarn_attention_factor(c.rope_factor) if gain is None else gain
    return inv_freq, 1.0


_TABLE_CHUNK = 8192  # float64 angles computed at a time on one thread: 64 KB, in cache


def rotary_table(context_length: int, inv_freq: Float[Tensor, "half"], gain: float = 1.0
                 ) -> tuple[Float[Tensor, "seq half"], Float[Tensor, "seq half"]]:
    """(cos, sin) of every position's angle p * inv_freq, computed in float64, times `gain`, stored
    as float32: (gain * torch.cos(angles)).float() for the whole table, a stretch of rows at a time.

    A whole table of a 128k-token context is 4M float64 angles, and each pass over them (angles, cos,
    sin, gain, the float32 copy) went through memory; on one thread, a stretch stays in cache and is
    written straight into the float32 table (the 1B Llama's tables: ~0.09 s -> ~0.03 s, and no 100 MB
    of float64 passing through). The same float32 values as the one-pass formula (tests/core/
    test_layers.py); the stretches are multiples of 64 rows, so no element's vector lane changes.
    On more threads, or another device, the table is made in one pass (a thousand small ops would
    each wait for the threads: seconds where the machine is busy).

    >>> angles = torch.arange(3, dtype=torch.float64)[:, None] * torch.tensor([1.0, 0.5], dtype=torch.float64)
    >>> cos, sin = rotary_table(3, torch.tensor([1.0, 0.5], dtype=torch.float64))
    >>> torch.equal(cos, torch.cos(angles).float()), torch.equal(sin, torch.sin(angles).float())
    (True, True)
    """
    half = inv_freq.shape[0]
    cos, sin = (torch.empty(context_length, half, dtype=torch.float32) for _ in range(2))
    positions = torch.arange(context_length, dtype=torch.float64)[:, None]  # (seq, 1)
    one_pass = positions.device.type != "cpu" or torch.get_num_threads() > 1
    rows = max(1, context_length) if one_pass else max(64, _TABLE_CHUNK // max(1, half) // 64 * 64)
    for start in range(0, context_length, rows):
        angles = positions[start:start + rows] * inv_freq  # (rows, half)
        for table, turn in ((cos, torch.cos), (sin, torch.sin)):
            if gain == 1.0:  # (x * 1.0 is x: skipped; `out` rounds the float64 result to float32, as .float())
                turn(angles, out=table[start:start + rows])
            else:
                torch.mul(turn(angles), gain, out=table[start:start + rows])
    return cos, sin


class RotaryPositions(nn.Module):
    """Rotary embedding (Su et al. 2021): rotate pairs of features by position-dependent angles.

    Pairs are adjacent features (x[2i], x[2i+1]), as in the paper and Meta's original Llama code.
    (Hugging Face's Llama instead pairs x[i] with x[i + d_head/2]; interop permutes weights.)
    `llama3` holds (factor, low_freq_factor, high_freq_factor, original_context) to apply
    `llama3_scaled_frequencies`; None means plain RoPE. `inv_freq` (d/2 frequencies) replaces the
    table from `theta` (scaled frequencies, `scaled_frequencies`), rotating only the first d of each
    head's features when d < d_head (partial rotary, GPT-NeoX); `gain` multiplies cos and sin (YaRN).
    `impl="fast"` computes the same rotation as
    one complex multiplication per pair (about 3x faster forward + backward on CPU than the written-out
    form, whose strided half-tensors are slow to multiply); "readable" writes it out.
    """

    def __init__(self, context_length: int, d_head: int, theta: float = 10000.0,
                 llama3: tuple[float, float, float, int] | None = None, impl: str = "readable", *,
                 inv_freq: Tensor | None = None, gain: float = 1.0):
        super().__init__()
        self.impl, self.local = impl, False
        # Dynamic NTK: (theta, factor, original_context); frequencies then depend on each call's length.
        self.dynamic: tuple[float, float, int] | None = None
        with _frequencies_device():
            if inv_freq is None:
                inv_freq = theta ** (-torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)  # (d_head/2,)
            if llama3 is not None:
                inv_freq = llama3_scaled_frequencies(inv_freq, *llama3)
        self.rotary_dims = 2 * inv_freq.shape[0]
        if _shapes_only():
            cos = sin = torch.empty(context_length, inv_freq.shape[0])
        else:
            cos, sin = rotary_table(context_length, inv_freq, gain)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @classmethod
    def from_config(cls, config, local: bool = False) -> "RotaryPositions":
        """The rotary table a ModelConfig asks for (its context, head size, rotary dims, theta and
        scaling); `local`: the sliding-window layers' table (rope_local_theta, unscaled)."""
        c = config
        with _frequencies_device():
            if local:
                inv_freq, gain = scaled_frequencies(c.replace(rope_scaling="none"), c.rope_local_theta)
            else:
                inv_freq, gain = scaled_frequencies(c, c.rope_theta)
        module = cls(c.context_length, c.d_head, impl=c.impl, inv_freq=inv_freq, gain=gain)
        module.local = local  # what materialize_buffers rebuilds the table from
        if c.rope_scaling == "dynamic" and not local:
            module.dynamic = (c.rope_theta, c.rope_factor, c.rope_original_context)
        return module

    def _cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """The table's rows at `positions`; with dynamic NTK scaling past the original context, the
        rows of a table for this call's length (max position + 1), as transformers recomputes it."""
        if self.dynamic is not None:
            seq_len = int(positions.max()) + 1  # (reads the positions back: dynamic scaling only)
            theta, factor, original = self.dynamic
            if seq_len > original:
                inv_freq = dynamic_ntk_frequencies(theta, self.rotary_dims, factor, original, seq_len)
                angles = positions.to(torch.float64)[..., None] * inv_freq.to(positions.device)
                return torch.cos(angles).float(), torch.sin(angles).float()
        return self.cos[positions], self.sin[positions]

    def forward(
        self, x: Float[Tensor, "*batch seq d_head"], positions: Int[Tensor, "seq"] | Int[Tensor, "*leading seq"]
    ) -> Float[Tensor, "*batch seq d_head"]:
        """Rotate `x` (any leading dims, e.g. (batch, heads, seq, d_head) or (batch, seq, d_head)).

        `positions` is (seq,) for every row alike, or has x's leading batch dims first: (batch, seq)
        positions apply per row to (batch, seq, d_head) input and, broadcast over heads, to
        (batch, heads, seq, d_head) input.

        >>> rope = RotaryPositions(context_length=16, d_head=8)
        >>> rope(torch.randn(4, 12, 8), torch.arange(12).expand(4, 12)).shape
        torch.Size([4, 12, 8])
        >>> rope(torch.randn(4, 2, 12, 8), torch.arange(12).expand(4, 12)).shape
        torch.Size([4, 2, 12, 8])
        """
        if positions.dim() > x.dim() - 1:
            raise ValueError(f"positions of shape {tuple(positions.shape)} have more dims than x's "
                             f"{tuple(x.shape[:-1])} (leading dims, seq)")
        if self.rotary_dims < x.shape[-1]:  # partial rotary: the features past rotary_dims pass unrotated
            rotated = self.forward(x[..., :self.rotary_dims], positions)
            return torch.cat([rotated, x[..., self.rotary_dims:]], dim=-1)
        cos, sin = self._cos_sin(positions)  # positions.shape + (d_head/2,)
        # Per-row positions (left-padded batches) lead with x's batch dims; any dims of x between
        # them and seq (heads) get size-1 axes to broadcast over.
        missing = x.dim() - 1 - positions.dim()
        if positions.dim() > 1 and missing > 0:
            shape = (*positions.shape[:-1], *([1] * missing), positions.shape[-1], cos.shape[-1])
            cos, sin = cos.reshape(shape), sin.reshape(shape)
        pairs = upcast(x).unflatten(-1, (-1, 2))  # (batch, heads, seq, d_head/2, 2)
        if self.impl == "fast" and not torch.compiler.is_compiling():
            # Pair (first, second) as the complex number first + i·second: multiplying by
            # cos + i·sin is the same 2-D rotation. view_as_complex needs even strides and offset.
            if pairs.stride(-1) != 1 or pairs.storage_offset() % 2 or any(s % 2 for s in pairs.stride()[:-1]):
                pairs = pairs.contiguous()
            rotation = torch.complex(cos.to(pairs.dtype), sin.to(pairs.dtype))
            return torch.view_as_real(torch.view_as_complex(pairs) * rotation).flatten(-2).to(x.dtype)
        first, second = pairs[..., 0], pairs[..., 1]
        # 2-D rotation of each (first, second) pair by its angle.
        rotated = torch.stack((first * cos - second * sin, first * sin + second * cos), dim=-1)
        return rotated.flatten(-2).to(x.dtype)
