"""What the machine can do, for the commands that choose threads and dtypes (never the library).

Two facts decide decoding speed on a CPU and are easy to get wrong:
- **bfloat16 units.** CPUs with AVX-512 BF16 or AMX run bf16 matmuls fast; without them (e.g. Intel
  Xeons with only avx512_vnni) PyTorch emulates bf16 at a fraction of fp32's speed, so bf16 makes a
  model slower, not faster.
- **threads.** Decoding one token of a small model is a chain of tiny matmuls; with a thread per
  core, each one pays a synchronisation that costs more than the work, and on a busy machine the
  threads wait for cores. Small models decode fastest on one thread.

Example:
    >>> isinstance(cpu_has_bf16(), bool)
    True
    >>> decode_threads(n_parameters=1_000_000, cores=8)
    1
    >>> decode_threads(n_parameters=124_000_000, cores=2, load=0.2), decode_threads(124_000_000, cores=2, load=1.9)
    (2, 1)
"""

from __future__ import annotations

import functools
import math
import os
import random
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

# Measured with benchmarks/bench_generate.py --threads-sweep (see docs/generation.md): below about
# this many parameters one thread decodes faster than two on the 2-core machines.
ONE_THREAD_BELOW_PARAMETERS = 20_000_000


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_bf16() -> bool:
    """True where the CPU has bfloat16 matmul units (AVX-512 BF16 or AMX)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def default_dtype(device: str) -> str:
    """float32 on CPUs without bf16 units, bfloat16 where bf16 is fast (CUDA, CPUs with the units)."""
    if device.startswith("cuda"):
        return "bfloat16"
    if device == "cpu" and cpu_has_bf16():
        return "bfloat16"
    return "float32"


def warn_if_slow_dtype(dtype: str, device: str) -> None:
    """One line on stderr when bf16 is asked for on a CPU that has no bf16 units."""
    if dtype == "bfloat16" and device == "cpu" and cpu_flags() and not cpu_has_bf16():
        print("warning: this CPU has no bfloat16 units (no avx512_bf16/amx_bf16 flag): bfloat16 will be several "
              "times slower than float32 here; use --dtype float32", file=sys.stderr)


def decode_threads(n_parameters: int, cores: int | None = None, load: float | None = None) -> int:
    """Threads for one-token decoding: 1 for small models; else one per core that is free.

    `load` is the number of runnable tasks already on the machine (default: the 1-minute load
    average). A decoding step is a chain of short parallel regions that end in a barrier: if one
    thread's core is taken by another process, every region waits for it, so on a loaded machine
    extra threads make each token slower than one thread does (benchmarks/bench_llamacpp.py
    --busy, docs/generation.md). So the cores counted are those the load leaves free, at least one.
    """
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if n_parameters < ONE_THREAD_BELOW_PARAMETERS:
        return 1
    if load is None:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    # A core counts as free unless more than half of it is in use, so an idle machine's background
    # noise (a load of 0.1-0.4) keeps every core.
    return max(1, min(cores, math.floor(cores - load + 0.5)))


def keeps_global_rng(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run `fn` with torch's, Python's and NumPy's global generators put back afterwards.

    Training and lm-eval seed them (dropout has no generator argument, so it draws from torch's),
    but the caller's own random stream must not be reset by calling a library function.

    Example:
        >>> import torch
        >>> before = torch.get_rng_state()
        >>> keeps_global_rng(lambda: torch.manual_seed(0))()  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> torch.equal(torch.get_rng_state(), before)
        True
    """
    import numpy as np
    import torch

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        python_state, numpy_state = random.getstate(), np.random.get_state()
        cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=cuda):
            try:
                return fn(*args, **kwargs)
            finally:
                random.setstate(python_state)
                np.random.set_state(numpy_state)
    return wrapper
