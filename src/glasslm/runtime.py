"""What the machine can do, for the commands that choose threads and dtypes (the library sets no
thread count for good: only `loading_threads`, for the one-time layout of a model's weights, and
it puts the caller's count back).

Two facts decide decoding speed on a CPU and are easy to get wrong:
- **bfloat16 units.** CPUs with AVX-512 BF16 or AMX run bf16 matmuls fast; without them (e.g. Intel
  Xeons with only avx512_vnni) PyTorch emulates bf16 at a fraction of fp32's speed, so bf16 makes a
  model slower, not faster.
- **threads.** Decoding one token of a small model is a chain of tiny matmuls; with a thread per
  core, each one pays a synchronisation that costs more than the work, and on a busy machine the
  threads wait for cores. Small models decode fastest on one thread. Training and evaluation too
  run on the cores the machine's load leaves free (`choose_threads`): there a thread whose core
  another process holds stalls every matmul.

Example:
    >>> isinstance(cpu_has_bf16(), bool)
    True
    >>> decode_threads(n_parameters=1_000_000, cores=8)
    1
    >>> decode_threads(n_parameters=124_000_000, cores=2, load=0.2), decode_threads(124_000_000, cores=2, load=1.9)
    (2, 1)
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
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


def machine_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS says, else every CPU)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def runnable_now(samples: int = 8, interval_s: float = 0.0125) -> float | None:
    """Tasks running or waiting for a core right now, besides this process's own thread: the mean of
    /proc/stat's procs_running over `samples` readings (None where there is no /proc/stat)."""
    readings = []
    for i in range(samples):
        try:
            text = Path("/proc/stat").read_text()
        except OSError:
            return None
        running = next((line.split()[1] for line in text.splitlines() if line.startswith("procs_running")), None)
        if running is None:
            return None
        readings.append(max(0, int(running) - 1))  # less the thread reading it
        if i + 1 < samples:
            time.sleep(interval_s)
    return sum(readings) / len(readings)


def machine_load() -> float:
    """Runnable tasks other than this command's: the larger of the 1-minute load average and what
    runs now (`runnable_now`). The average lags a minute behind a load that has just begun (a
    test's busy loops, a neighbour's job starting); the instant reading misses a load between its
    bursts. Taking the larger errs toward fewer threads, the cheaper mistake: a thread too few
    leaves a core idle, a thread too many waits for a core at every barrier (an order of magnitude
    slower, docs/training.md)."""
    average = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    now = runnable_now()
    return max(average, now if now is not None else 0.0)


def free_cores(cores: int | None = None, load: float | None = None) -> int:
    """Cores that `load` runnable tasks (default: `machine_load()`) leave free, at least one.

    A core counts as free unless more than half of it is in use, so an idle machine's background
    noise (a load of 0.1-0.4) keeps every core.
    """
    cores = machine_cores() if cores is None else cores
    load = machine_load() if load is None else load
    return max(1, min(cores, math.floor(cores - load + 0.5)))


def release_openmp_threads() -> bool:
    """Let the calling thread's idle OpenMP team go, before another thread takes over the computing.

    GNU OpenMP (torch's on Linux) keeps each thread's team of workers alive after its first parallel
    region, and once it manages more threads than there are cores it stops spinning between regions
    and puts workers to sleep instead. So a server that loaded its model on the main thread and
    decodes on another ran every step through sleeping and waking workers: one SmolLM2 stream on 2
    threads went at 50 tokens/s served against 264 in `glasslm generate` (issue 42), and a torch
    matmul on a second thread took 3x as long as on the first. `omp_pause_resource_all` frees the
    caller's team (OpenMP 5.0; libgomp frees only the caller's), and a later parallel region on this
    thread builds a new one. True where it was released; False where the runtime is not libgomp
    (others pause every thread's team, which another thread may be using) or has no such call.

    Example:
        >>> isinstance(release_openmp_threads(), bool)
        True
    """
    import ctypes

    try:
        libraries = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                     if "/libgomp" in line}
    except OSError:
        return False
    released = False
    for library in sorted(libraries):  # torch's, and any other package's own copy (sentencepiece has one)
        try:
            pause = ctypes.CDLL(library).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.restype, pause.argtypes = ctypes.c_int, [ctypes.c_int]
        released |= pause(1) == 0  # omp_pause_soft: the threads end, the runtime stays
    return released


def decode_threads(n_parameters: int, cores: int | None = None, load: float | None = None) -> int:
    """Threads for one-token decoding: 1 for small models; else one per core that is free.

    `load` is the number of runnable tasks already on the machine (default: `machine_load()`). A
    decoding step is a chain of short parallel regions that end in a barrier: if one thread's core
    is taken by another process, every region waits for it, so on a loaded machine extra threads
    make each token slower than one thread does (benchmarks/bench_llamacpp.py --busy,
    docs/generation.md). So the cores counted are those the load leaves free (`free_cores`).
    """
    if n_parameters < ONE_THREAD_BELOW_PARAMETERS:
        return 1
    return free_cores(cores, load)


@dataclass(frozen=True)
class ThreadChoice:
    """The threads a command computes on, and the line that says why when it is not one per core."""

    threads: int | None  # None: leave PyTorch's count (OMP_NUM_THREADS chose it)
    note: str | None  # one line for stderr, or None when there is nothing to say


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cycle collector off for the block, then as it was before. For code that makes hundreds
    of thousands of objects that are either garbage at once (freed by their reference counts) or kept,
    and no reference cycles, so that a collection in the middle can find nothing: a full one walks every
    object the process holds, ~0.09 s once torch is imported, and a 49k-token vocabulary's build set
    one off at every SmolLM2 load. Nothing the caller made is collected differently afterwards.

    Example:
        >>> import gc
        >>> with collector_paused():
        ...     gc.isenabled()
        False
        >>> gc.isenabled()
        True
    """
    import gc

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def loading_threads() -> Iterator[int]:
    """torch's CPU threads raised, for the block, to every core the machine's load leaves free, then put
    back: loading lays each weight out once for the kernels (a pass over the whole file, bound by
    writing fresh memory, which runs about as many times faster as there are cores to fault the pages
    in), and the count the caller chose for decoding (`--threads 1`) says nothing about that pass.
    Never lowers the caller's count, and leaves it alone where OMP_NUM_THREADS sets it. Only the
    1-minute load average is read (`machine_load` samples for 0.1 s, a tenth of a small model's load).
    Yields the count used.

    Example:
        >>> import torch
        >>> before = torch.get_num_threads()
        >>> with loading_threads() as threads:
        ...     threads >= before
        True
        >>> torch.get_num_threads() == before
        True
    """
    import torch

    before = torch.get_num_threads()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    threads = before if "OMP_NUM_THREADS" in os.environ else max(before, free_cores(load=load))
    if threads != before:
        torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        if threads != before:
            torch.set_num_threads(before)


def choose_threads(requested: int = 0, decoding_parameters: int | None = None, cores: int | None = None,
                   load: float | None = None, environ: Mapping[str, str] = os.environ) -> ThreadChoice:
    """Threads for a command: `requested` when given (a warning if the load leaves fewer cores
    free), PyTorch's own count where OMP_NUM_THREADS sets it (torchrun does), 1 for decoding a
    model under ONE_THREAD_BELOW_PARAMETERS, else one per free core, said in one line when that is
    fewer than the cores.

    Training and evaluation run on every free core for the same reason decoding does: each matmul
    ends in a barrier, and a thread whose core another process holds stalls the others (a LoRA
    fine-tune of the demo model at a load average of ~7 on 2 cores: 2.0 s a step on 2 threads,
    0.14 s on one; docs/training.md).

    Example:
        >>> choose_threads(cores=2, load=0.1, environ={})
        ThreadChoice(threads=2, note=None)
        >>> print(choose_threads(cores=2, load=5.2, environ={}).note)
        threads: 1 of 2 cores: the machine's load (5.2 runnable tasks) leaves 1 free, and threads beyond the free cores wait for them (--threads N to choose)
    """
    cores = machine_cores() if cores is None else cores
    if requested:
        free = free_cores(cores, load) if requested > 1 else requested
        return ThreadChoice(requested, None if requested <= free else (
            f"warning: --threads {requested} on a machine whose load leaves {free} of {cores} cores free: the "
            f"threads will wait for cores at every step; --threads {free} is likely faster"))
    if environ.get("OMP_NUM_THREADS"):
        return ThreadChoice(None, None)
    if decoding_parameters is not None and decoding_parameters < ONE_THREAD_BELOW_PARAMETERS:
        return ThreadChoice(1, None)  # a size rule, the same on every machine (docs/generation.md)
    load = machine_load() if load is None else load
    threads = free_cores(cores, load)
    return ThreadChoice(threads, None if threads == cores else (
        f"threads: {threads} of {cores} cores: the machine's load ({load:.1f} runnable tasks) leaves {threads} "
        "free, and threads beyond the free cores wait for them (--threads N to choose)"))


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
