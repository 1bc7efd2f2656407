"""Tokenizer benchmarks: glasslm beside Hugging Face `tokenizers` (training) and tiktoken (encoding).

Each measurement is the median of --repeats runs, and competitors run interleaved in the same
process so machine load affects both alike.

Usage:
    python benchmarks/bench_tokenizers.py --data-dir /work/shared/data
    python benchmarks/bench_tokenizers.py --data-dir /work/shared/data --big   # + 32k vocab on >= 50 MB
    python benchmarks/bench_tokenizers.py --smoke --big   # 20 KB of text, vocab 300, once (the test suite runs it)

Needs tinyshakespeare.txt and gpt2/ (see glasslm.tokenizers.find_gpt2_files) under --data-dir
(default, glasslm's one rule: $GLASSLM_DATA_DIR, else ~/.cache/glasslm); tiktoken's gpt2 files are read from <data-dir>/tiktoken_cache if present.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from glasslm.tokenizers import trainer as bpe
from glasslm.tokenizers import ENDOFTEXT, gpt2_tokenizer

EOT = ENDOFTEXT


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def hf_train(paths: list[str], vocab_size: int, special_tokens: list[str]):
    """Byte-level BPE with Hugging Face tokenizers (Rust), configured like glasslm's trainer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special_tokens, min_frequency=0,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train(paths, trainer)
    return tok


def bench_training(text_path: Path, vocab_size: int, repeats: int) -> None:
    text = text_path.read_text(encoding="utf-8")
    print(f"\n== BPE training: vocab {vocab_size} on {text_path.name} ({len(text.encode()) / 1e6:.2f} MB) ==")
    rows: dict[str, list[float]] = {}
    workers = [1, 2] if (os.cpu_count() or 1) > 1 else [1]
    for _ in range(repeats):
        for w in workers:
            t, (vocab, merges) = timed(lambda: bpe.train_bpe(Path(text_path), vocab_size, [EOT], num_workers=w))
            rows.setdefault(f"glasslm train_bpe (num_workers={w})", []).append(t)
        try:
            t, hf = timed(lambda: hf_train([str(text_path)], vocab_size, [EOT]))
            rows.setdefault("HF tokenizers BpeTrainer", []).append(t)
        except ImportError:
            pass
        # Where glasslm's time goes: counting pre-tokens vs the merge loop.
        t_count, counts = timed(lambda: bpe.count_corpus(Path(text_path), [EOT], num_workers=1))
        words = {k.encode(): v for k, v in counts.items()}
        t_merge, _ = timed(lambda: bpe.merge_counts(words, vocab_size - 257))
        rows.setdefault("  of which: count pre-tokens (1 process)", []).append(t_count)
        rows.setdefault("  of which: merge loop", []).append(t_merge)
    medians = {k: statistics.median(v) for k, v in rows.items()}
    for name, m in medians.items():
        print(f"{name:45s} {m:7.3f} s   (runs: {', '.join(f'{x:.3f}' for x in rows[name])})")
    hf_time = medians.get("HF tokenizers BpeTrainer")
    if hf_time:
        best = min(m for k, m in medians.items() if k.startswith("glasslm"))
        print(f"ratio glasslm (best) / HF tokenizers: {best / hf_time:.2f}x")
    print(f"learned {len(merges)} merges; first: {merges[:3]}")


def bench_encoding(text_path: Path, data_dir: Path, repeats: int) -> None:
    text = text_path.read_text(encoding="utf-8")
    nbytes = len(text.encode())
    print(f"\n== GPT-2 encoding of {text_path.name} ({nbytes / 1e6:.2f} MB) ==")
    cache = data_dir / "tiktoken_cache"
    if cache.is_dir():
        os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(cache))
    ours = gpt2_tokenizer(data_dir, backend="glasslm")
    candidates = {"glasslm (pure Python, warm cache)": ours.encode}
    try:
        import tiktoken

        candidates["tiktoken get_encoding('gpt2')"] = tiktoken.get_encoding("gpt2").encode_ordinary
        candidates["glasslm backend='tiktoken'"] = gpt2_tokenizer(data_dir, backend="tiktoken").encode
    except Exception as err:  # not installed, or no offline copy of its files
        print(f"(tiktoken unavailable: {err})")
    cold = []
    for _ in range(repeats):
        fresh = gpt2_tokenizer(data_dir, backend="glasslm")  # empty pre-token cache
        cold.append(timed(lambda: fresh.encode(text))[0])
    rows: dict[str, list[float]] = {"glasslm (pure Python, cold cache)": cold}
    reference = None
    ours.encode(text)  # warm up
    for _ in range(repeats):
        for name, fn in candidates.items():
            t, ids = timed(lambda: fn(text))
            rows.setdefault(name, []).append(t)
            assert reference is None or ids == reference, f"{name} gave different ids"
            reference = ids
    lines = text.splitlines(keepends=True)
    for _ in range(repeats):
        t, ids = timed(lambda: list(ours.encode_iterable(lines)))
        rows.setdefault("glasslm encode_iterable(lines)", []).append(t)
        assert ids == reference
    for name, times in rows.items():
        m = statistics.median(times)
        print(f"{name:40s} {nbytes / m / 1e6:7.2f} MB/s   ({m:.3f} s; {len(reference):,} tokens)")


def build_big_corpus(path: Path, min_bytes: int) -> int:
    """Concatenate UTF-8 text found on this machine (Python stdlib sources, /usr/share docs)."""
    roots = [Path(os.__file__).parent, Path("/usr/share/doc"), Path("/usr/share/common-licenses"), Path("/usr/lib/python3")]
    total = 0
    with open(path, "w", encoding="utf-8") as out:
        while total < min_bytes:
            before = total
            for root in roots:
                for f in sorted(root.rglob("*")):
                    if total >= min_bytes:
                        break
                    if not f.is_file() or f.suffix not in {".py", ".txt", ".rst", ".md", ""} or f.stat().st_size > 5e6:
                        continue
                    try:
                        text = f.read_text(encoding="utf-8")
                    except (UnicodeDecodeError, OSError):
                        continue
                    out.write(text + "\n" + EOT + "\n")
                    total += len(text.encode()) + len(EOT) + 2
            if total == before:
                break  # nothing readable found
    return total


def bench_big(vocab_size: int, min_bytes: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        size = build_big_corpus(corpus, min_bytes)
        print(f"\n== BPE training: vocab {vocab_size} on {size / 1e6:.1f} MB of local text (one run each, separate processes) ==")
        for which in ("glasslm", "hf"):
            result = subprocess.run([sys.executable, __file__, "--train-one", which, str(corpus), str(vocab_size)],
                                    capture_output=True, text=True, check=True)
            print(result.stdout.strip())


def train_one(which: str, corpus: str, vocab_size: int) -> None:
    """Child process: train once, report seconds and peak resident memory (self + workers)."""
    if which == "glasslm":
        t, _ = timed(lambda: bpe.train_bpe(Path(corpus), vocab_size, [EOT], num_workers=None))
        name = f"glasslm train_bpe (num_workers=auto={os.cpu_count()})"
    else:
        t, _ = timed(lambda: hf_train([corpus], vocab_size, [EOT]))
        name = "HF tokenizers BpeTrainer"
    peak_self = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    peak_children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(f"{name:45s} {t:8.2f} s   peak RSS {peak_self:7.0f} MiB (largest worker process {peak_children:.0f} MiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=None,
                        help="data directory (default, as everywhere in glasslm: $GLASSLM_DATA_DIR, else ~/.cache/glasslm)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab-size", type=int, default=10_000)
    parser.add_argument("--big", action="store_true", help="also train a 32k vocab on >= --big-mb MB of local text")
    parser.add_argument("--big-mb", type=int, default=50)
    parser.add_argument("--train-one", nargs=3, metavar=("WHICH", "CORPUS", "VOCAB"), help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="20 KB of text, vocab 300, one repeat: checks it runs")
    args = parser.parse_args()
    if args.train_one:
        which, corpus, vocab = args.train_one
        train_one(which, corpus, int(vocab))
        return
    from glasslm.data import resolve_text
    from glasslm.locations import data_dir as resolve_data_dir
    from glasslm.tokenizers import find_gpt2_files

    data_dir = resolve_data_dir(args.data_dir)
    try:
        shakespeare = resolve_text("tinyshakespeare", data_dir)
        find_gpt2_files(data_dir)
    except (OSError, ValueError, RuntimeError) as err:
        sys.exit(f"bench_tokenizers.py: error: {err}")
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            args.vocab_size, args.repeats = 300, 1
            shakespeare = Path(tmp) / "tinyshakespeare-20k.txt"
            shakespeare.write_text(resolve_text("tinyshakespeare", data_dir).read_text(encoding="utf-8")[:20_000])
        bench_training(shakespeare, args.vocab_size, args.repeats)
        bench_encoding(shakespeare, data_dir, args.repeats)
    if args.big:
        bench_big(300 if args.smoke else 32_000, 200_000 if args.smoke else args.big_mb << 20)


if __name__ == "__main__":
    main()
