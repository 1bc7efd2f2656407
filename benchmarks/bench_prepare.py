"""`glasslm prepare`'s speed on a JSONL corpus beside the bare tokenizers' batch encoding of the same
documents: tiktoken's `encode_ordinary_batch` (GPT-2) and Hugging Face `tokenizers`' `encode_batch`
(the same GPT-2 vocabulary as a tokenizer.json). prepare's time is end to end: reading the JSONL
files, tokenizing, writing the shards and the manifest. The goal (issue 35): prepare >= 0.8x of
tiktoken's batch speed with the same number of threads.

Each figure is the median of --repeats runs, the three run interleaved in one process so machine
load affects them alike; the load average is printed beside them (the machine may be shared).

Usage:
    python benchmarks/bench_prepare.py --workers 2            # 40 MB of JSONL
    python benchmarks/bench_prepare.py --smoke                # 0.3 MB, once (the test suite runs it)

Needs tinyshakespeare.txt and gpt2/ under --data-dir ($GLASSLM_DATA_DIR, else ~/.cache/glasslm);
tiktoken's gpt2 files are read from <data-dir>/tiktoken_cache.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from glasslm.data import prepare_shards
from glasslm.locations import data_dir as resolve_data_dir
from glasslm.tokenizers import get_tokenizer, to_hf_json


def write_corpus(root: Path, text: str, megabytes: float, files: int = 4) -> list[str]:
    """JSONL files of about `megabytes` in all: Shakespeare's paragraphs and synthetic documents."""
    paras = [p for p in text.split("\n\n") if p]
    rng = np.random.default_rng(0)
    words = text.split()
    docs: list[str] = []
    size = 0
    while size < megabytes * 1e6:
        if len(docs) % 2:
            doc = " ".join(rng.choice(words, size=int(rng.integers(50, 400))))
        else:
            doc = paras[len(docs) % len(paras)]
        docs.append(doc)
        size += len(doc.encode()) + 12
    per_file = -(-len(docs) // files)
    for k in range(files):
        with open(root / f"part-{k:03d}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs[k * per_file:(k + 1) * per_file])
    return docs


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def run(args: argparse.Namespace) -> dict[str, float]:
    import tiktoken
    from tokenizers import Tokenizer as HFTokenizer

    data = resolve_data_dir(args.data_dir)
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(data / "tiktoken_cache"))
    tok = get_tokenizer("gpt2", data_dir=data)
    bare_tiktoken = tiktoken.get_encoding("gpt2")
    bare_hf = HFTokenizer.from_str(json.dumps(to_hf_json(tok)))
    work = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    try:
        docs = write_corpus(work, (data / "tinyshakespeare.txt").read_text(), args.megabytes)
        times: dict[str, list[float]] = {"prepare": [], "tiktoken": [], "tokenizers": []}
        tokens = 0
        for _ in range(args.repeats):
            start = time.perf_counter()
            meta = prepare_shards([str(work / "*.jsonl")], tok, work / "out", shard_tokens=args.shard_tokens,
                                  workers=args.workers, progress=False, overwrite=True)
            times["prepare"].append(time.perf_counter() - start)
            tokens = meta["train_tokens"] + meta["val_tokens"]
            start = time.perf_counter()
            bare = sum(map(len, bare_tiktoken.encode_ordinary_batch(docs, num_threads=args.workers)))
            times["tiktoken"].append(time.perf_counter() - start)
            start = time.perf_counter()
            bare_hf.encode_batch(docs, add_special_tokens=False)
            times["tokenizers"].append(time.perf_counter() - start)
        return report(times, tokens, bare, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(times: dict[str, list[float]], tokens: int, bare: int, args: argparse.Namespace) -> dict[str, float]:
    """Print tokens/s per contender (medians) and prepare's ratio to tiktoken's batch speed."""
    # prepare writes one eos between documents, which the bare encoders do not produce.
    speeds = {name: (tokens if name == "prepare" else bare) / statistics.median(t) for name, t in times.items()}
    print(f"{cpu_model()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} "
          f"{os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}; {args.megabytes:g} MB of JSONL, {bare:,} tokens, "
          f"--workers {args.workers}, medians of {args.repeats}", file=sys.stderr)
    for name, speed in speeds.items():
        print(f"{name:<11} {speed / 1e6:7.2f} M tokens/s")
    ratio = speeds["prepare"] / speeds["tiktoken"]
    print(f"prepare / tiktoken batch: {ratio:.2f}x (goal >= 0.8x)")
    return speeds | {"ratio": ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--megabytes", type=float, default=40.0)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shard-tokens", type=int, default=2_000_000)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--smoke", action="store_true", help="0.3 MB once: that it runs, not how fast")
    args = parser.parse_args()
    if args.smoke:
        args.megabytes, args.repeats, args.shard_tokens = 0.3, 1, 20_000
    speeds = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(speeds))


if __name__ == "__main__":
    main()
