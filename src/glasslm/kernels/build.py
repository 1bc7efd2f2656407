"""Building glasslm's C++ kernels: compiled on first use into a cache, loaded as torch ops.

`load()` compiles `qmatmul.cpp`, `decode.cpp`, `block.cpp` and `experts.cpp` (and the `ops.h` they share)
with `torch.utils.cpp_extension` the first time any process needs it (tens of seconds), into
`$TORCH_EXTENSIONS_DIR` if set, else `~/.cache/glasslm/kernels`, in a
folder named after the sources' hash, the compiler flags and the torch and Python versions. A build
that loaded leaves `built.json` beside the library, and every later process loads that library
directly, from any checkout or virtual environment with the same sources and torch: ninja's own
check is not asked, since its build file records the absolute paths of the sources and of torch's
headers, which differ between checkouts (before issue 47 a second clone rebuilt everything, and the
other processes waited on its lock). A build, or a wait for another process's, says so in one line
on stderr with its seconds, apart from any decoding time. Where it cannot be built (no C++
compiler, no ninja, a non-x86 CPU is fine) glasslm says so in one line and the quantized layers run
PyTorch's own kernels instead.

Which code path runs is chosen at run time: AVX-512 VNNI where the CPU has it, else AVX2, else
plain C++. `$GLASSLM_KERNELS` overrides the choice: `avx512`, `avx2`, `scalar` (a lower path than the
CPU allows, so every path can be tested on one machine) or `off` (no extension: PyTorch's kernels).
`use_isa` changes it inside a process.

Example:
    >>> ops = load()
    >>> ops is None or isa_name() in ISA_LEVELS
    True
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

ENV = "GLASSLM_KERNELS"
ISA_LEVELS = {"scalar": 0, "avx2": 1, "avx512": 2}  # the C++ side's numbering
SOURCES = [Path(__file__).with_name(name) for name in ("qmatmul.cpp", "decode.cpp", "block.cpp", "experts.cpp")]
HEADERS = [Path(__file__).with_name("ops.h")]  # (what the sources declare for one another: part of the build's key)
# -O3 for the vector loops; OpenMP so at::parallel_for runs on torch's threads (the library joins
# the libgomp torch already loaded). No -march: each path names its instructions (target
# attributes), so one build runs on any x86-64 CPU and picks its path at run time.
# -ffp-contract=off: a * b + c stays two roundings, as in the readable reference (no fused multiply-add
# unless the code asks for one).
# Tuples, handed to torch as fresh lists: torch's build appends its own libraries to the list it is
# given, which changed this process's cache_dir() once it had compiled (a later cache_dir() named a
# folder with nothing in it).
CFLAGS = ("-O3", "-fopenmp", "-std=c++17", "-ffp-contract=off")
LDFLAGS = ("-fopenmp",)


LIBRARY, BUILT = "glasslm_kernels.so", "built.json"  # the library, and the record a build that loaded leaves


def cache_dir() -> Path:
    """Where built kernels live: a folder per sources, flags, torch build and Python version (no path:
    every checkout of the same sources shares it)."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "glasslm" / "kernels")
    code = b"".join(source.read_bytes() for source in SOURCES + HEADERS)
    key = hashlib.sha256(code + " ".join(CFLAGS + LDFLAGS).encode() + torch.__version__.encode()).hexdigest()[:16]
    tag = f"torch{torch.__version__.split('+')[0]}-py{sys.version_info.major}{sys.version_info.minor}"
    return root / f"kernels-{tag}-{key}"


def _load_built(folder: Path) -> bool:
    """Load the library a finished build left in `folder`; False where there is none (or it fails to load)."""
    if not (folder / BUILT).is_file() or not (folder / LIBRARY).is_file():
        return False
    try:
        torch.ops.load_library(str(folder / LIBRARY))
    except (OSError, RuntimeError):
        return False
    return True


@contextlib.contextmanager
def _build_lock(folder: Path) -> Iterator[bool]:
    """Hold `folder`'s build lock; yields whether another process held it first (so this one waited).

    torch's own lock is a file that a killed build leaves behind, and every later process then waits
    on it forever (a test killing a child mid-compile hung a whole CI run). An flock dies with its
    process, so while it is held no other glasslm build runs there, and a leftover torch `lock` file
    can only be stale: it is removed."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): torch's file lock alone
        yield False
        return
    with open(folder / "build.flock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            waited = False
        except BlockingIOError:
            fcntl.flock(handle, fcntl.LOCK_EX)
            waited = True
        (folder / "lock").unlink(missing_ok=True)
        try:
            yield waited
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(folder: Path) -> None:
    """Compile into `folder` (or wait for the process compiling there and load what it built), then
    record the build and say what it cost, in one line on stderr."""
    from torch.utils import cpp_extension

    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with _build_lock(folder) as waited:
        if waited and _load_built(folder):
            print(f"glasslm: waited {time.perf_counter() - started:.1f} s for another process building the C++ "
                  f"kernels (cached in {folder})", file=sys.stderr)
            return
        cpp_extension.load("glasslm_kernels", [str(source) for source in SOURCES], extra_cflags=list(CFLAGS),
                           extra_ldflags=list(LDFLAGS), build_directory=str(folder), is_python_module=False, verbose=False)
        seconds = time.perf_counter() - started
        staged = folder / f"{BUILT}.{os.getpid()}"
        staged.write_text(json.dumps({"torch": torch.__version__, "seconds": round(seconds, 1)}))
        staged.replace(folder / BUILT)
    print(f"glasslm: compiled the C++ kernels in {seconds:.1f} s (once for these sources and this torch; "
          f"cached in {folder})", file=sys.stderr)


@functools.cache
def load() -> Any | None:
    """`torch.ops.glasslm_kernels`, built or loaded; None (after one line on stderr saying why) where
    the extension cannot be built or `$GLASSLM_KERNELS` is `off`."""
    wanted = os.environ.get(ENV, "").strip().lower()
    if wanted == "off":
        return None
    if wanted and wanted not in ISA_LEVELS:
        raise ValueError(f"${ENV}={wanted!r}: choose one of {', '.join(ISA_LEVELS)} or off")
    try:
        folder = cache_dir()
        if not _load_built(folder):
            _build(folder)
    except Exception as err:  # noqa: BLE001 - any failure to build means: run without the extension
        lines = str(err).strip().splitlines() or [type(err).__name__]
        reason = next((line for line in lines if "error:" in line), lines[-1])[:200]
        print(f"glasslm: the C++ quantized kernels could not be built ({reason}); quantized layers run "
              "PyTorch's slower kernels (set GLASSLM_KERNELS=off to skip trying)", file=sys.stderr)
        return None
    ops = torch.ops.glasslm_kernels
    ops.select_isa(ISA_LEVELS[wanted] if wanted else -1)
    return ops


def available() -> bool:
    """Whether the C++ kernels are loaded (building them on first call)."""
    return load() is not None


def isa_name() -> str:
    """The path the kernels take now: avx512, avx2 or scalar."""
    ops = load()
    if ops is None:
        raise RuntimeError("the C++ kernels are not loaded")
    return {level: name for name, level in ISA_LEVELS.items()}[ops.current_isa()]


_LEVEL: list[int] = []  # the level chosen last through use_isa (empty: the environment's or the best)


def _current_level() -> int:
    if _LEVEL:
        return _LEVEL[-1]
    wanted = os.environ.get(ENV, "").strip().lower()
    return ISA_LEVELS.get(wanted, -1)


def supported_isas() -> list[str]:
    """The paths this CPU can run, from plain C++ up."""
    ops = load()
    best = -1 if ops is None else ops.supported_isa()
    return [name for name, level in ISA_LEVELS.items() if level <= best]


@contextlib.contextmanager
def use_isa(name: str) -> Iterator[None]:
    """Within this block the kernels take path `name` (one of `supported_isas()`)."""
    ops = load()
    if ops is None or name not in supported_isas():
        raise ValueError(f"path {name!r} is not available here; this CPU runs {supported_isas()}")
    _LEVEL.append(ISA_LEVELS[name])
    ops.select_isa(_LEVEL[-1])
    try:
        yield
    finally:
        _LEVEL.pop()
        ops.select_isa(_current_level())
