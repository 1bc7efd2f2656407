"""Two CPU facts both decoding windows act on, measured on the CPUs glasslm runs on (docs/generation.md).

- Under bf16 (or fp16) weights on a CPU, keys and values stay float32: CPUs without bf16 matrix units
  run bf16 attention several times slower than float32 (the weights stay bf16).
- One-row bf16 steps are vector x matrix products, which PyTorch's own kernel runs about twice as fast
  as oneDNN's (oneDNN wins for prefill and batches), so those steps run with oneDNN switched off.

Example:
    >>> import torch
    >>> low_precision_cpu(torch.zeros(2, dtype=torch.bfloat16)), low_precision_cpu(torch.zeros(2))
    (True, False)
    >>> with onednn_disabled():
    ...     torch.backends.mkldnn.enabled
    False
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn


def low_precision_cpu(weight: Tensor | nn.Module) -> bool:
    """True for bf16/fp16 weights (or an embedding that gives rows of them) on a CPU: their KV cache is
    kept float32, their one-row steps skip oneDNN."""
    return weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16)


@contextlib.contextmanager
def onednn_disabled(disable: bool = True) -> Iterator[None]:
    """Within this block PyTorch's CPU matmuls skip oneDNN (mkldnn) and use ATen's own kernels."""
    previous = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = previous and not disable
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = previous
