"""Random hostile copies of a valid GGUF file, and a child process that runs glasslm's commands on them.

`mutant(raw, seed)` makes one copy: a metadata value replaced by another of any type and size, a key
dropped, a tensor's dimensions, ggml type, offset or name changed, a tensor dropped or doubled,
bytes of the header overwritten, the file truncated, or the header's counts or version changed. The
same seed gives the same bytes.

`python -m tests.hf.gguf_fuzz FILES... --results OUT.jsonl` runs `glasslm info`, `glasslm generate`
(2 greedy tokens) and, on every fourth file, `glasslm convert --from-gguf` on each file in this one
process, through `glasslm.cli.main` as the command line runs it, and writes one JSON line per file:
each command's exit status, the stderr lines, the exception that escaped `main` (a traceback for a
user), and the seconds taken. Two guards hold it to the rules: the process may not map more than
`--memory-mib` beyond what it held before the first file (RLIMIT_DATA, which counts every private
anonymous mapping, so an attempt to allocate gigabytes fails at once, lazily touched or not), and a
file that takes more than `--seconds` is stopped by faulthandler, which prints where it hung and
ends the process (the parent sees which file was last started).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import random
import struct
import sys
import time
from pathlib import Path

from tests.hf.gguf_bytes import ARRAY, BOOL, FLOAT32, FLOAT64, INT32, INT64, STRING, UINT8, UINT32, UINT64, RawGGUF

HOSTILE_VALUES = [
    (UINT32, 0), (UINT32, 1), (INT32, -1), (UINT32, 2 ** 31), (UINT32, 2 ** 32 - 1), (UINT64, 2 ** 63),
    (UINT64, 2 ** 64 - 1), (INT64, -2 ** 63), (FLOAT32, 0.0), (FLOAT32, -1.0), (FLOAT32, math.nan),
    (FLOAT32, math.inf), (FLOAT32, 24.0), (FLOAT64, 1e300), (BOOL, True), (UINT8, 3), (STRING, "x"), (STRING, ""),
    (ARRAY, (UINT32, [])), (ARRAY, (UINT32, [1, 2, 3])), (ARRAY, (STRING, ["a", "b"])), (ARRAY, (FLOAT32, [0.5])),
]
HOSTILE_DIMS = [0, 1, 2, 3, 31, 33, 2 ** 16, 2 ** 31, 2 ** 32, 2 ** 32 + 1, 2 ** 63, 2 ** 64 - 1]
HOSTILE_COUNTS = [0, 1, 2 ** 31, 2 ** 32, 2 ** 63, 2 ** 64 - 1]


def _near(value: int, rng: random.Random) -> int:
    """An integer near, or far from, `value` (kept in u32 so it is written as the key's own type)."""
    return rng.choice([0, value - 1, value + 1, value * 2, value * 1000, value // 2]) % 2 ** 32


def _mutate_value(raw: RawGGUF, rng: random.Random) -> str:
    key, kind, value = rng.choice(raw.kv)
    if kind in (UINT32, INT32, UINT64) and rng.random() < 0.5:
        new = _near(value, rng)
        raw.set(key, UINT32, new)
        return f"{key}={new}"
    new_kind, new = rng.choice(HOSTILE_VALUES)
    raw.set(key, new_kind, new)
    return f"{key}={new!r} (type {new_kind})"


def _mutate_tensor(raw: RawGGUF, rng: random.Random) -> str:
    t = rng.choice(raw.tensors)
    what = rng.choice(["dims", "dims", "type", "offset", "name", "drop", "double"])
    if what == "dims":
        i = rng.randrange(len(t.dims) + 1)
        if i == len(t.dims):
            t.dims = t.dims + [rng.choice([1, 2])] if rng.random() < 0.5 else t.dims[:-1] or [1]
        else:
            t.dims[i] = rng.choice(HOSTILE_DIMS)
        return f"{t.name} dims {t.dims}"
    if what == "type":
        t.ggml_type = rng.randrange(46)
        return f"{t.name} type {t.ggml_type}"
    if what == "offset":
        t.offset = rng.choice([t.offset + 1, t.offset + 32, max(0, t.offset - 32), 2 ** 63, len(raw.data),
                               rng.randrange(2 ** 64)]) % 2 ** 64
        return f"{t.name} offset {t.offset}"
    if what == "name":
        old, t.name = t.name, rng.choice([other.name for other in raw.tensors] + ["rope_freqs.weight", "blk.99.x"])
        return f"{old} renamed {t.name}"
    if what == "drop":
        raw.tensors.remove(t)
        return f"{t.name} dropped"
    raw.tensors.append(t)
    return f"{t.name} twice"


def _mutate_bytes(data: bytes, header_end: int, rng: random.Random) -> tuple[bytes, str]:
    what = rng.choice(["flip", "flip", "truncate", "counts", "version"])
    out = bytearray(data)
    if what == "flip":
        places = [rng.randrange(4, header_end) for _ in range(rng.randint(1, 8))]
        for place in places:
            out[place] = rng.randrange(256)
        return bytes(out), f"bytes {places} overwritten"
    if what == "truncate":
        end = rng.randrange(len(data))
        return data[:end], f"truncated at {end}"
    if what == "counts":
        at = rng.choice([8, 16])
        out[at:at + 8] = struct.pack("<Q", rng.choice(HOSTILE_COUNTS))
        return bytes(out), f"count at {at} = {struct.unpack_from('<Q', out, at)[0]}"
    out[4:8] = struct.pack("<I", rng.choice([0, 1, 2, 4, 2 ** 24 + 3]))
    return bytes(out), f"version {struct.unpack_from('<I', out, 4)[0]}"


def mutant(raw: RawGGUF, seed: int) -> tuple[bytes, str]:
    """One hostile copy of `raw` (bytes, what was changed)."""
    import copy

    rng = random.Random(seed)
    mutated = copy.deepcopy(raw)
    kind = rng.choice(["value", "value", "value", "drop_key", "tensor", "tensor", "bytes", "bytes"])
    if kind == "value":
        what = _mutate_value(mutated, rng)
    elif kind == "drop_key":
        key = rng.choice(mutated.kv)[0]
        mutated.drop(key)
        what = f"{key} dropped"
    elif kind == "tensor":
        what = _mutate_tensor(mutated, rng)
    else:
        data = raw.to_bytes()
        return _mutate_bytes(data, len(data) - len(raw.data), rng)
    return mutated.to_bytes(), what


def _run(argv: list[str]) -> dict:
    from glasslm.cli import main

    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    escaped = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse
            code = exit_.code
        except BaseException as exc:  # noqa: BLE001 (what a user would see as a traceback)
            code, escaped = None, f"{type(exc).__name__}: {exc}"
    return {"argv": argv[0], "code": code, "stderr": err.getvalue().splitlines(), "escaped": escaped,
            "seconds": round(time.monotonic() - start, 3)}


def _limit_memory(mib: int) -> None:
    """Cap this process's private mappings at what it holds now plus `mib` (Linux: RLIMIT_DATA)."""
    import resource

    held = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("VmData:")) * 1024
    resource.setrlimit(resource.RLIMIT_DATA, (held + mib * 2 ** 20, resource.RLIM_INFINITY))


def main() -> None:
    import faulthandler

    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+")
    parser.add_argument("--results", required=True)
    parser.add_argument("--warm", required=True, help="a valid file, run first without limits (kernels loaded)")
    parser.add_argument("--memory-mib", type=int, default=512)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out_dir = Path(args.results).parent
    warm = _run(["generate", "--checkpoint", args.warm, "--prompt", "ab", "--max-new-tokens", "2", "--temperature", "0"])
    assert warm["code"] == 0, warm
    _limit_memory(args.memory_mib)
    try:  # the guard holds here: twice the allowance is refused (else the check would prove nothing)
        torch.empty(2 * args.memory_mib * 2 ** 20, dtype=torch.uint8)
        raise SystemExit("RLIMIT_DATA does not limit allocations on this system")
    except RuntimeError:
        pass
    with open(args.results, "w") as results:
        for i, path in enumerate(args.files):
            print(path, file=sys.__stderr__, flush=True)  # the last one named is the one that hung
            faulthandler.dump_traceback_later(args.seconds, exit=True, file=sys.__stderr__)
            runs = [_run(["info", "--checkpoint", path]),
                    _run(["generate", "--checkpoint", path, "--prompt", "ab", "--max-new-tokens", "2",
                          "--temperature", "0"])]
            if i % 4 == 0:
                runs.append(_run(["convert", "--from-gguf", path, "--out", str(out_dir / "converted"),
                                  "--overwrite"]))
            faulthandler.cancel_dump_traceback_later()
            results.write(json.dumps({"file": path, "runs": runs}) + "\n")
            results.flush()


if __name__ == "__main__":
    main()
