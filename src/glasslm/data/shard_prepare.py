"""`prepare_shards`: a corpus of any size (text, JSONL, parquet, Hugging Face datasets; see
glasslm.data.documents) tokenized in parallel into fixed-size shards (glasslm.data.sharded),
resumable when interrupted.

How it runs: documents are read in order and grouped into batches of about `BATCH_CHARS`
characters; the batches are tokenized a few at a time ahead of the writer (by the tokenizer's own
threaded `encode_batch` where it has one, tiktoken's or the `tokenizers` library's, else by
worker processes), and the writer appends each document's ids to its split's stream, the eos
before every document but the first, cutting a shard file every `shard_tokens` ids. Documents stay
in corpus order whatever the parallelism, so the result is the same for any `workers`.

Resuming: after every finished shard the manifest (written atomically) records it and, per split,
a cursor: the first document not wholly in finished shards and how many of its ids are. Rerunning
the same command on the directory skips the finished documents unread by the tokenizer, never
rewrites a finished shard, and ends byte-identical to an uninterrupted run. A rerun with another
tokenizer (by the sha256 of its files), shard size or inputs is refused, naming what differs.

Example:
    >>> import tempfile, pathlib, json
    >>> from glasslm.data.sharded import read_manifest
    >>> from glasslm.tokenizers import CharTokenizer
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "a.jsonl").write_text("".join(json.dumps({"text": "ab" * i}) + "\\n" for i in range(1, 11)))
    >>> meta = prepare_shards([str(d / "a.jsonl")], CharTokenizer.from_text("ab"), d / "out", shard_tokens=40,
    ...                       workers=1, progress=False)
    >>> meta["train_tokens"], meta["val_tokens"], [s["tokens"] for s in read_manifest(d / "out")["splits"]["train"]]
    (98, 20, [40, 40, 18])
"""

from __future__ import annotations

import errno
import json
import hashlib
import os
import shutil
import tempfile
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Callable

import numpy as np

from glasslm.data.documents import Piece, Source, expand_sources, pieces
from glasslm.data.prepared import META_FILE, token_dtype
from glasslm.data.sharded import FORMAT, MANIFEST_FILE, SHARD_DIR, read_manifest, write_manifest
from glasslm.data.splits import VAL_FRACTION, check_val_fraction
from glasslm.locations import INCOMPLETE_MARKER, check_output_dir
from glasslm.progress import progress_bar
from glasslm.tokenizers import Tokenizer, special_token_ids

DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB of uint16 ids a shard
BATCH_CHARS = 1 << 21  # text handed to the tokenizer at a time
SPLIT_NAMES = ("train", "val")


@dataclass(frozen=True)
class ReadOptions:
    """How documents are read from the inputs (see glasslm.data.documents)."""

    field: str = "text"  # JSONL
    column: str = "text"  # parquet and datasets
    split: str = "train"  # datasets
    streaming: bool = False  # datasets.load_dataset(..., streaming=True)


def tokenizer_sha256(tokenizer: Tokenizer, saved: str | os.PathLike | None = None) -> str:
    """The sha256 of the files `tokenizer.save` writes (names and bytes): two tokenizers with the same
    files give every text the same ids. `saved`: a directory already holding only those files."""
    if saved is None:
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer.save(tmp)
            return tokenizer_sha256(tokenizer, tmp)
    digest = hashlib.sha256()
    for path in sorted(Path(saved).rglob("*")):
        if path.is_file():
            digest.update(path.relative_to(saved).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


# --- tokenizing in parallel ---------------------------------------------------------------------------------

_WORKER_TOKENIZER: Tokenizer | None = None  # the worker processes' tokenizer (set by their initializer)
Encoded = tuple[np.ndarray, np.ndarray]  # (every text's ids one after another (int64), each text's count)


def flat_ids(ids_list: Sequence[Sequence[int]]) -> Encoded:
    """Lists of ids as one int64 array and their lengths (arrays cross processes far faster than lists).

    >>> ids, lengths = flat_ids([[1, 2], [], [3]])
    >>> ids.tolist(), lengths.tolist()
    ([1, 2, 3], [2, 0, 1])
    """
    lengths = np.fromiter(map(len, ids_list), dtype=np.int64, count=len(ids_list))
    return np.fromiter(chain.from_iterable(ids_list), dtype=np.int64, count=int(lengths.sum())), lengths


def _start_worker(tokenizer: Tokenizer) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tokenizer


def _encode_in_worker(texts: list[str]) -> Encoded:
    assert _WORKER_TOKENIZER is not None
    return flat_ids([_WORKER_TOKENIZER.encode(text) for text in texts])


def encoder(tokenizer: Tokenizer, workers: int) -> tuple[Executor, Callable[[list[str]], Encoded]]:
    """(executor, function of a batch of texts -> their ids): the tokenizer's threaded `encode_batch`
    on one background thread where it has one, else `workers` processes (one per core by default)."""
    batch = getattr(tokenizer, "encode_batch", None)
    if batch is not None:
        return ThreadPoolExecutor(1), lambda texts: flat_ids(batch(texts, num_threads=max(1, workers)))
    if workers <= 1:
        return ThreadPoolExecutor(1), lambda texts: flat_ids([tokenizer.encode(t) for t in texts])
    context = get_context("fork" if os.name == "posix" else "spawn")  # fork: workers start in milliseconds
    return ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker,
                               initargs=(tokenizer,)), _encode_in_worker


def ordered_map(executor: Executor, fn: Callable[[Any], Any], items: Iterable[Any], ahead: int,
                argument: Callable[[Any], Any] = lambda item: item) -> Iterator[tuple[Any, Any]]:
    """(item, fn(argument(item))) for each item, computed on the executor, in order, with at most
    `ahead` calls in flight (so memory stays bounded however long `items` is).

    >>> with ThreadPoolExecutor(2) as ex:
    ...     [r for _, r in ordered_map(ex, lambda x: x * x, range(5), ahead=2)]
    [0, 1, 4, 9, 16]
    """
    pending: deque = deque()
    for item in items:
        pending.append((item, executor.submit(fn, argument(item))))
        if len(pending) >= ahead:
            done, future = pending.popleft()
            yield done, future.result()
    while pending:
        done, future = pending.popleft()
        yield done, future.result()


# --- the writer --------------------------------------------------------------------------------------------

@dataclass
class SplitWriter:
    """Appends one split's ids into shard files of `shard_tokens` ids, keeping the manifest's record."""

    root: Path
    split: str
    dtype: np.dtype
    shard_tokens: int
    shards: list[dict[str, Any]]  # the manifest's list for this split (finished shards)
    cursor: dict[str, int]  # the manifest's cursor: {"piece": first piece not wholly written, "skip": its ids written}
    on_shard: Callable[[], None]
    buffer: np.ndarray = field(init=False)
    fill: int = 0

    def __post_init__(self) -> None:
        self.buffer = np.empty(self.shard_tokens, dtype=self.dtype)

    def add(self, piece: int, ids: np.ndarray, skipped: int) -> None:
        """Append ids[skipped:] of piece `piece` (ids: all of the piece's ids, its eos included)."""
        pos = skipped
        while pos < len(ids):
            take = min(self.shard_tokens - self.fill, len(ids) - pos)
            self.buffer[self.fill:self.fill + take] = ids[pos:pos + take]
            self.fill, pos = self.fill + take, pos + take
            if self.fill == self.shard_tokens:
                self.flush({"piece": piece, "skip": pos} if pos < len(ids) else {"piece": piece + 1, "skip": 0})

    def flush(self, cursor: dict[str, int]) -> None:
        """Write the buffer as the next shard (atomically), then record it and the cursor in the manifest."""
        if self.fill:
            name = f"{SHARD_DIR}/{self.split}-{len(self.shards):06d}.bin"
            tmp = self.root / SHARD_DIR / f".{self.split}-{len(self.shards):06d}.bin.tmp"
            with open(tmp, "wb") as f:
                f.write(self.buffer[:self.fill].data)
            os.replace(tmp, self.root / name)
            start = self.shards[-1]["start"] + self.shards[-1]["tokens"] if self.shards else 0
            self.shards.append({"file": name, "tokens": self.fill, "start": start})
            self.fill = 0
        self.cursor.clear()
        self.cursor.update(cursor)
        self.on_shard()


# --- the run -----------------------------------------------------------------------------------------------

def _batches(stream: Iterator[Piece], cursors: dict[str, dict[str, int]]) -> Iterator[list[tuple[Piece, bool, int]]]:
    """Batches of (piece, eos before it, ids of it already written) for the pieces still to write."""
    seen = dict.fromkeys(SPLIT_NAMES, 0)
    batch: list[tuple[Piece, bool, int]] = []
    chars = 0
    for piece in stream:
        first = seen[piece.split] == 0
        seen[piece.split] += 1
        cursor = cursors[piece.split]
        if piece.index < cursor["piece"]:
            continue  # wholly in finished shards
        batch.append((piece, not first, cursor["skip"] if piece.index == cursor["piece"] else 0))
        chars += len(piece.text)
        if chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _write_all(root: Path, tokenizer: Tokenizer, manifest: dict[str, Any], stream: Iterator[Piece],
               workers: int, progress: bool) -> int:
    """Tokenize and write every piece not yet in a finished shard; returns the number of pieces."""
    dtype, vocab, eos = np.dtype(manifest["dtype"]), tokenizer.vocab_size, special_token_ids(tokenizer)["eos"]
    lead = np.array([] if eos is None else [eos], dtype=np.int64)
    writers = {s: SplitWriter(root, s, dtype, manifest["shard_tokens"], manifest["splits"][s], manifest["cursors"][s],
                              lambda: write_manifest(root, manifest)) for s in SPLIT_NAMES}
    executor, encode = encoder(tokenizer, workers)
    pieces_seen = max(c["piece"] for c in manifest["cursors"].values())
    with executor, progress_bar(desc="prepare", unit="tok", unit_scale=True, disable=not progress) as bar:
        texts = (lambda batch: [p.text for p, _, _ in batch])
        for batch, (flat, lengths) in ordered_map(executor, encode, _batches(stream, manifest["cursors"]),
                                                  2 + workers, texts):
            if len(flat) and (flat.min() < 0 or flat.max() >= vocab):
                raise ValueError(f"tokenizer produced an id outside [0, {vocab})")
            ends = np.cumsum(lengths).tolist()
            for (piece, eos_first, skipped), start, end in zip(batch, [0, *ends], ends):
                ids = flat[start:end]
                writers[piece.split].add(piece.index, np.concatenate([lead, ids]) if eos_first else ids, skipped)
                pieces_seen = piece.index + 1
            bar.update(len(flat))
    for writer in writers.values():
        writer.flush({"piece": pieces_seen, "skip": 0})
    return pieces_seen


def _new_manifest(tokenizer: Tokenizer, sha256: str, sources: Sequence[Source], shard_tokens: int,
                  val_fraction: float, read: ReadOptions) -> dict[str, Any]:
    return {
        "format": FORMAT, "complete": False, "dtype": token_dtype(tokenizer.vocab_size).name,
        "vocab_size": tokenizer.vocab_size, "tokenizer": getattr(tokenizer, "kind", type(tokenizer).__name__),
        "tokenizer_sha256": sha256, "shard_tokens": shard_tokens, "val_fraction": val_fraction,
        "read": vars(read) | {"streaming": None}, "sources": [[s.kind, s.location] for s in sources],
        "splits": {s: [] for s in SPLIT_NAMES}, "cursors": {s: {"piece": 0, "skip": 0} for s in SPLIT_NAMES},
    }


def _check_resumable(out: Path, fresh: dict[str, Any]) -> dict[str, Any]:
    """The manifest of an interrupted run in `out`, refused if this run would make something else."""
    manifest = read_manifest(out)
    for key, what in (("tokenizer_sha256", "tokenizer"), ("shard_tokens", "--shard-tokens"),
                      ("val_fraction", "--val-fraction"), ("sources", "inputs"), ("read", "reading options"),
                      ("dtype", "token dtype")):
        if manifest.get(key) != fresh[key]:
            raise ValueError(f"{out} holds an interrupted preparation made with another {what} "
                             f"({manifest.get(key)!r}, now {fresh[key]!r}); rerun it as it was to resume, "
                             "or pass --overwrite to start again")
    return manifest


def _start(out: Path, fresh: dict[str, Any], saved_tokenizer: Path, inputs: list[str],
           overwrite: bool) -> dict[str, Any]:
    """The manifest to go on from: an interrupted run's in `out` (resumed), or a new one in a new or
    emptied `out`, which gets the tokenizer's files (from `saved_tokenizer`)."""
    resumable = (out / INCOMPLETE_MARKER).is_file() and (out / MANIFEST_FILE).is_file()
    if resumable and not overwrite:
        check_output_dir(out, True, inputs=inputs, what="dataset")
        return _check_resumable(out, fresh)
    check_output_dir(out, overwrite, inputs=inputs, what="dataset")
    if out.exists() and overwrite:
        shutil.rmtree(out)
    (out / SHARD_DIR).mkdir(parents=True, exist_ok=True)
    (out / INCOMPLETE_MARKER).write_text("glasslm prepare did not finish here; rerun the same command to resume "
                                         "(or pass --overwrite to start again)\n")
    shutil.copytree(saved_tokenizer, out, dirs_exist_ok=True)
    write_manifest(out, fresh)
    return fresh


def _finish(out: Path, manifest: dict[str, Any], documents: int) -> dict[str, Any]:
    """Check both splits hold tokens, then mark the directory complete (meta.json last)."""
    counts = {s: sum(e["tokens"] for e in manifest["splits"][s]) for s in SPLIT_NAMES}
    if counts["train"] == 0:
        raise ValueError("the inputs hold no text: nothing to prepare")
    if counts["val"] == 0:
        raise ValueError(f"no validation text: {documents} documents at --val-fraction {manifest['val_fraction']} "
                         "hold none out (every 1/val_fraction-th record is held out, and the end of each text file); "
                         "use more documents or a larger --val-fraction")
    manifest["complete"], manifest["documents"] = True, documents
    write_manifest(out, manifest)
    meta = {"layout": "shards", "vocab_size": manifest["vocab_size"], "dtype": manifest["dtype"],
            "train_tokens": counts["train"], "val_tokens": counts["val"], "val_fraction": manifest["val_fraction"],
            "sources": [location for _, location in manifest["sources"]], "tokenizer": manifest["tokenizer"],
            "shards": {s: len(manifest["splits"][s]) for s in SPLIT_NAMES}}
    (out / META_FILE).write_text(json.dumps(meta, indent=2))
    (out / INCOMPLETE_MARKER).unlink()
    return meta


def prepare_shards(
    inputs: Sequence[str | os.PathLike], tokenizer: Tokenizer, out_dir: str | os.PathLike,
    val_fraction: float = VAL_FRACTION, shard_tokens: int = DEFAULT_SHARD_TOKENS, workers: int | None = None,
    read: ReadOptions = ReadOptions(), progress: bool = True, overwrite: bool = False,
    data_dir: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Tokenize the documents of `inputs` (see `expand_sources`) into shards of `shard_tokens` ids
    under `out_dir`; returns what `meta.json` holds (token counts per split, shards per split).

    `workers`: tokenizing threads (a tokenizer with `encode_batch`) or processes; None: one per
    CPU core; 1: in this process. An interrupted run (an error, Ctrl-C, a kill) leaves its finished
    shards and manifest: the same call resumes it (see the module docstring); `overwrite=True`
    starts again. `load_prepared(out_dir)` reads the result.
    """
    check_val_fraction(val_fraction)
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be at least 1, got {shard_tokens}")
    sources = expand_sources(inputs, data_dir)
    out = Path(out_dir)
    local = [s.location for s in sources if s.kind != "dataset-name"]
    with tempfile.TemporaryDirectory() as saved:  # saved once: hashed, then copied into a new `out`
        tokenizer.save(saved)
        fresh = _new_manifest(tokenizer, tokenizer_sha256(tokenizer, saved), sources, shard_tokens, val_fraction, read)
        manifest = _start(out, fresh, Path(saved), local, overwrite)
    if manifest["complete"]:
        raise ValueError(f"{out} is already complete; pass --overwrite to prepare it again")
    stream = pieces(sources, val_fraction, read.field, read.column, read.split, read.streaming)
    try:
        documents = _write_all(out, tokenizer, manifest, stream, workers or os.cpu_count() or 1, progress)
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise ValueError(f"no space left on the device while writing {out}; its finished shards are kept: "
                             "free some space and rerun the same command to resume") from None
        raise
    return _finish(out, manifest, documents)
