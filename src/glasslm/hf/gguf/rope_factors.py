"""Llama 3's RoPE scaling as GGUF files hold it: a `rope_freqs.weight` tensor of per-pair divisors.

Llama 3.1+ slows its rotary pairs down by a factor that depends on each pair's wavelength (see
`glasslm.core.positions.llama3_scaled_frequencies`): pairs turning fast are kept, slow ones are
divided by `factor`, and between two wavelengths the divisor moves smoothly from 1 to `factor`.
llama.cpp's converter writes no metadata for this; it writes the divisors themselves, one float32 per
rotated pair (`rope_freqs.weight`), and llama.cpp divides each pair's frequency by its entry.

glasslm's model says the same scaling by its four numbers (`rope_factor`, `rope_low_freq_factor`,
`rope_high_freq_factor`, `rope_original_context`), so `llama3_from_factors` finds numbers that give
the file's divisors and checks that they do, to float32 rounding: divisors that are not Llama 3's
shape over the frequencies the metadata states (`rope.freq_base`, `rope.dimension_count`) are refused,
never approximated. Only where the divisors cross a boundary are the boundaries fixed by them; the
original context is the file's `rope.scaling.original_context_length` (glasslm writes it) or Llama
3's 8192, and the two boundary wavelengths are original / low and original / high.

Example:
    >>> import torch
    >>> inv = 500000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    >>> from glasslm.core.positions import llama3_scaled_frequencies
    >>> factors = inv / llama3_scaled_frequencies(inv, 32.0, 1.0, 4.0, 8192)   # Llama 3.2's
    >>> params = llama3_from_factors(factors.float(), 500000.0)
    >>> params["factor"], round(params["low_freq_factor"], 4), round(params["high_freq_factor"], 4)
    (32.0, 1.0, 4.0)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from glasslm.core.positions import llama3_scaled_frequencies

LLAMA3_ORIGINAL_CONTEXT = 8192  # what llama.cpp's converter assumes when config.json's top level has none
_RTOL = 1e-5  # float32 divisors, computed by the converter from float32 frequencies


def plain_frequencies(theta: float, dims: int) -> Tensor:
    """The unscaled rotary frequencies of `dims` rotated features (dims / 2 pairs), in float64."""
    return theta ** (-torch.arange(0, dims, 2, dtype=torch.float64) / dims)


def llama3_factors(theta: float, dims: int, factor: float, low: float, high: float, original: int) -> Tensor:
    """The divisors llama.cpp reads from `rope_freqs.weight` for this Llama 3 scaling (float64)."""
    inv = plain_frequencies(theta, dims)
    return inv / llama3_scaled_frequencies(inv, factor, low, high, original)


def _gives(divisors: Tensor, theta: float, factor: float, low: float, high: float, original: int) -> bool:
    """Whether this Llama 3 scaling gives `divisors` to float32 rounding."""
    if not (factor >= 1 and 0 < low < high):
        return False
    again = llama3_factors(theta, 2 * divisors.numel(), factor, low, high, original)
    return bool(torch.allclose(again, divisors, rtol=_RTOL, atol=0))


def _boundaries(x: Tensor, s: Tensor, ones: Tensor, fulls: Tensor) -> tuple[float, float]:
    """(1/L, 1/H): the inverse wavelengths where the ramp s = (x - 1/L) / (1/H - 1/L) reaches 0 and 1,
    fitted to the ramp's points (x: inverse wavelengths, decreasing; s at the pairs in between) and
    placed between the neighbouring kept (`ones`) and fully scaled (`fulls`) pairs where they leave room."""
    mid = ~(ones | fulls)
    above = float(x[ones].min()) if ones.any() else float(x.max()) * 2  # the slowest kept pair
    below = float(x[fulls].max()) if fulls.any() else float(x.min()) / 2  # the fastest fully scaled pair
    if int(mid.sum()) >= 2:  # a straight line through the ramp's points
        xm, sm = x[mid], s[mid]
        a = float(((xm - xm.mean()) * (sm - sm.mean())).sum() / ((xm - xm.mean()) ** 2).sum())
        b = float(sm.mean()) - a * float(xm.mean())
        return -b / a, (1 - b) / a
    if int(mid.sum()) == 1:  # one point: its neighbour on the fast side fixes the line's other end
        xm, sm = float(x[mid][0]), float(s[mid][0])
        x_high = (xm + above) / 2
        return (xm - sm * x_high) / (1 - sm), x_high
    return below + (above - below) / 3, below + 2 * (above - below) / 3


def llama3_from_factors(factors: Tensor, theta: float, original_context: int | None = None) -> dict[str, Any]:
    """HF `rope_parameters` of the Llama 3 scaling whose divisors are `factors` (one per rotated pair,
    over frequencies of base `theta`); {} where every divisor is 1 (no scaling). ValueError where no
    Llama 3 scaling gives them to float32 rounding."""
    f = factors.double().flatten()
    if not bool(torch.isfinite(f).all()) or bool((f <= 0).any()):
        raise ValueError("rope_freqs.weight holds a divisor that is not a positive number")
    if bool(torch.allclose(f, torch.ones_like(f), rtol=0, atol=_RTOL)):
        return {}
    original = original_context or LLAMA3_ORIGINAL_CONTEXT
    factor = float(f.max())
    x = plain_frequencies(theta, 2 * f.numel()) / (2 * math.pi)  # 1 / wavelength, decreasing
    ones, fulls = (f - 1).abs() <= _RTOL, (f - factor).abs() <= _RTOL * factor
    s = (1 / f - 1 / factor) / (1 - 1 / factor)  # how far each pair is from fully scaled (1) to kept (0)
    # Llama 3's own low and high (1 and 4) where they give these divisors (always, for the files of
    # Llama 3.1-3.3), else the boundaries the divisors fix.
    x_low, x_high = (1 / original, 4 / original) if _gives(f, theta, factor, 1.0, 4.0, original) else \
        _boundaries(x, s, ones, fulls)
    params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": original * x_low,
              "high_freq_factor": original * x_high, "original_max_position_embeddings": original}
    if not _gives(f, theta, factor, params["low_freq_factor"], params["high_freq_factor"], original):
        raise ValueError(f"rope_freqs.weight's {f.numel()} divisors are not Llama 3's rope scaling of the "
                         f"frequencies of base {theta:g} (the file's rope.freq_base)")
    return params
