"""Prepared datasets: text files tokenized once into flat token files (`train.bin`, `val.bin`),
a `meta.json` and the tokenizer's files, read back memory-mapped (`load_prepared`) so training
reads only the windows it samples.

Example:
    >>> token_dtype(50257), token_dtype(200_000)
    (dtype('uint16'), dtype('uint32'))
"""

from __future__ import annotations

import codecs
import errno
import itertools
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
from torch import Tensor

from glasslm.data.sharded import MANIFEST_FILE, ShardedTokens, load_split, read_manifest
from glasslm.data.splits import VAL_FRACTION, check_val_fraction, split_offset
from glasslm.locations import INCOMPLETE_MARKER, check_output_dir
from glasslm.progress import progress_bar
from glasslm.tokenizers import Tokenizer, load_tokenizer, special_token_ids

META_FILE = "meta.json"  # written last: a directory with it (and no INCOMPLETE_MARKER) is complete
TOKEN_FILE_SUFFIX = ".bin"  # train.bin, val.bin
CHUNK_BYTES = 1 << 20  # text is read and tokenized this many bytes at a time

TokenDType = Literal["uint16", "uint32"]
TOKEN_DTYPES: tuple[TokenDType, ...] = get_args(TokenDType)


def token_file(directory: str | os.PathLike, split: Literal["train", "val"]) -> Path:
    """The flat token file of one split in a prepared directory (`train.bin` or `val.bin`)."""
    return Path(directory) / f"{split}{TOKEN_FILE_SUFFIX}"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (half the disk and memory bandwidth), else uint32."""
    small, large = TOKEN_DTYPES
    return np.dtype(small) if vocab_size <= 1 << 16 else np.dtype(large)


def _read_text(path: Path, start: int, end: int, chunk_bytes: int, bar: Any = None) -> Iterator[str]:
    """Decoded text of bytes [start, end) of a file, in chunks (multi-byte characters kept whole)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    with open(path, "rb") as f:
        f.seek(start)
        remaining = end - start
        while remaining > 0:
            block = f.read(min(chunk_bytes, remaining))
            if not block:
                break
            remaining -= len(block)
            if bar is not None:
                bar.update(len(block))
            yield decoder.decode(block)
    yield decoder.decode(b"", final=True)


def _write_tokens(ids: Iterator[int], path: Path, dtype: np.dtype, vocab_size: int, block_size: int = 1 << 16) -> int:
    """Stream ids to a flat binary file in fixed-size blocks; returns the number written."""
    count = 0
    ids = iter(ids)
    with open(path, "wb") as f:
        while True:
            # np.fromiter pulls a whole block from the iterator in C, not one Python step per token.
            block = np.fromiter(itertools.islice(ids, block_size), dtype=np.int64)
            if len(block) == 0:
                return count
            count += _flush(block, f, dtype, vocab_size)


def _flush(block: np.ndarray, f: Any, dtype: np.dtype, vocab_size: int) -> int:
    if len(block) and (block.min() < 0 or block.max() >= vocab_size):
        raise ValueError(f"tokenizer produced an id outside [0, {vocab_size})")
    # f.write, not ndarray.tofile: on a full disk tofile reports a bare short write ("65536 requested
    # and 43008 written") with no errno, where a file write raises ENOSPC, which prepare explains.
    f.write(np.ascontiguousarray(block, dtype=dtype).data)
    return len(block)


def prepare(
    sources: Sequence[str | os.PathLike], tokenizer: Tokenizer, out_dir: str | os.PathLike,
    val_fraction: float = VAL_FRACTION, chunk_bytes: int = CHUNK_BYTES, progress: bool = True, overwrite: bool = False,
) -> dict[str, Any]:
    """Tokenize text files into `train.bin` / `val.bin` + `meta.json` + the tokenizer's files.

    Split rule (`split_offset`): in each source file, text before the first line start at or after
    (1 - val_fraction) of its bytes goes to train.bin, the rest to val.bin, so every file
    contributes to both. Each file is a document: where the tokenizer has an end-of-text (eos)
    token, its id goes between two files' text in each split, so a model learns where documents
    end (one file gives exactly its own tokens). Text is streamed in chunks, so memory does not
    grow with the corpus.

    `out_dir` must be new or empty; `overwrite=True` deletes what it holds first. A marker file
    stays in the directory until `meta.json`, written last, completes it: a killed `prepare` leaves
    a directory that reads as an incomplete preparation. On an error (a full disk) or SIGINT /
    SIGTERM, everything written is removed.

    Example:
        >>> import tempfile, pathlib
        >>> from glasslm.tokenizers import CharTokenizer
        >>> d = pathlib.Path(tempfile.mkdtemp()); (d / "a.txt").write_text("hello world\\n" * 20)
        240
        >>> prepare([d / "a.txt"], CharTokenizer.from_text("helo wrd\\n"), d / "out", progress=False)["train_tokens"]
        216
    """
    check_val_fraction(val_fraction)
    paths = [Path(p) for p in sources]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
    total = sum(p.stat().st_size for p in paths)
    if total == 0:
        raise ValueError("the input text is empty: nothing to prepare")
    out = Path(out_dir)
    check_output_dir(out, overwrite, inputs=paths, what="dataset")
    created = not out.exists()
    if not created and overwrite:
        shutil.rmtree(out)
        created = True
    out.mkdir(parents=True, exist_ok=True)
    try:
        (out / INCOMPLETE_MARKER).write_text("glasslm prepare did not finish here; rerun it with --overwrite\n")
        meta = _prepare_into(paths, tokenizer, out, val_fraction, chunk_bytes, progress, total)
        (out / INCOMPLETE_MARKER).unlink()
    except BaseException as err:
        # Everything in `out` is ours (it was new or empty): remove it, leave no .tmp behind.
        for child in list(out.iterdir()) if out.is_dir() else []:
            shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
        if created:
            shutil.rmtree(out, ignore_errors=True)
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            raise ValueError(f"no space left on the device while writing {out}; removed the partial "
                             "dataset (nothing else was changed)") from None
        raise
    return meta


def _prepare_into(paths: list[Path], tokenizer: Tokenizer, out: Path, val_fraction: float, chunk_bytes: int,
                  progress: bool, total: int) -> dict[str, Any]:
    dtype = token_dtype(tokenizer.vocab_size)
    splits = {p: split_offset(p, val_fraction) for p in paths}
    counts = {}
    with progress_bar(total=total, unit="B", unit_scale=True, desc="prepare", disable=not progress) as bar:
        for split in ("train", "val"):
            def texts(p: Path) -> Iterator[str]:
                start, end = (0, splits[p]) if split == "train" else (splits[p], p.stat().st_size)
                return _read_text(p, start, end, chunk_bytes, bar)

            final = token_file(out, split)
            tmp = out / f".{final.name}.tmp"
            ids = _document_ids(tokenizer, [texts(p) for p in paths])
            counts[split] = _write_tokens(ids, tmp, dtype, tokenizer.vocab_size)
            os.replace(tmp, final)
    tokenizer.save(out)
    meta = {
        "vocab_size": tokenizer.vocab_size, "dtype": dtype.name, "train_tokens": counts["train"],
        "val_tokens": counts["val"], "val_fraction": val_fraction, "sources": [str(p) for p in paths],
        "tokenizer": getattr(tokenizer, "kind", type(tokenizer).__name__),
    }
    (out / META_FILE).write_text(json.dumps(meta, indent=2))  # written last: marks the set complete
    return meta


def _document_ids(tokenizer: Tokenizer, documents: list[Iterator[str]]) -> Iterator[int]:
    """The ids of the documents (one per file) one after another, the tokenizer's end-of-text (its
    eos: `<|endoftext|>` for glasslm's char and BPE tokenizers, GPT-2's) between each two, as GPT-2's
    training text marks where one document ends. A tokenizer with no eos gets the files' text
    run together, as prepare always did."""
    eos = special_token_ids(tokenizer)["eos"]
    if eos is None:
        return tokenizer.encode_iterable(itertools.chain.from_iterable(documents))
    parts = ([eos] if k else [] for k in range(len(documents)))  # nothing before the first document
    return itertools.chain.from_iterable(
        itertools.chain(before, tokenizer.encode_iterable(doc)) for before, doc in zip(parts, documents))


def char_vocabulary(paths: Sequence[str | os.PathLike], chunk_bytes: int = CHUNK_BYTES) -> list[str]:
    """Every distinct character in the files, sorted, read in chunks (for a character tokenizer)."""
    chars: set[str] = set()
    for path in paths:
        for text in _read_text(Path(path), 0, Path(path).stat().st_size, chunk_bytes):
            chars.update(text)
    if not chars:
        raise ValueError("the input text is empty: no characters for a vocabulary")
    return sorted(chars)


def is_prepared(path: str | os.PathLike) -> bool:
    return (Path(path) / META_FILE).is_file() and not (Path(path) / INCOMPLETE_MARKER).exists()


def check_prepared(path: str | os.PathLike) -> None:
    """Name an interrupted `prepare` as such (instead of "not a dataset")."""
    path = Path(path)
    if (path / INCOMPLETE_MARKER).exists() and (path / MANIFEST_FILE).exists():
        raise ValueError(f"{path} is an incomplete preparation (prepare was interrupted; its finished shards are "
                         "kept): rerun the same prepare command to resume it, or pass --overwrite to start again")
    if (path / INCOMPLETE_MARKER).exists() or any(path.glob(f".*{TOKEN_FILE_SUFFIX}.tmp")):
        raise ValueError(f"{path} is an incomplete preparation (prepare was interrupted): "
                         "rerun prepare with --overwrite")


def load_token_file(path: str | os.PathLike, dtype: str | np.dtype) -> np.ndarray:
    """A read-only memory map of a flat token file, with clear errors for empty or mis-typed files."""
    path, dtype = Path(path), np.dtype(dtype)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"{path} is empty: no tokens to train on")
    if size % dtype.itemsize:
        raise ValueError(f"{path} is {size} bytes, not a whole number of {dtype.name} tokens: wrong dtype?")
    return np.memmap(path, dtype=dtype, mode="r")


@dataclass
class TokenData:
    """Training and validation token streams plus the tokenizer that made them."""

    train: Tensor | np.ndarray | ShardedTokens  # ShardedTokens: a sharded directory's stream (glasslm.data.sharded)
    val: Tensor | np.ndarray | ShardedTokens
    tokenizer: Tokenizer
    description: str
    source: str  # the prepared directory or the text file, as a path


def load_prepared(directory: str | os.PathLike) -> TokenData:
    """The memory-mapped train/val token streams and tokenizer of a directory written by `prepare`
    (train.bin / val.bin) or by `prepare_shards` (each split's shards read as one `ShardedTokens`)."""
    root = Path(directory)
    check_prepared(root)
    try:
        meta = json.loads((root / META_FILE).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{root / META_FILE} is unreadable ({err})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{root / META_FILE} should hold a JSON object describing the dataset, "
                         f"got a {type(meta).__name__}; rerun prepare with --overwrite")
    if meta.get("dtype") not in TOKEN_DTYPES:
        raise ValueError(f"{root / META_FILE}: dtype should be {' or '.join(TOKEN_DTYPES)}, got {meta.get('dtype')!r}; "
                         "rerun prepare with --overwrite")
    tokenizer = load_tokenizer(root)
    if tokenizer.vocab_size != meta.get("vocab_size"):
        raise ValueError(f"{root}: tokenizer has {tokenizer.vocab_size} tokens but meta.json says {meta.get('vocab_size')}")
    if meta.get("layout") == "shards":
        manifest = read_manifest(root)
        if manifest.get("dtype") != meta["dtype"] or not manifest.get("complete"):
            raise ValueError(f"{root / MANIFEST_FILE} does not match {root / META_FILE}; rerun prepare with --overwrite")
        train, val = load_split(root, manifest, "train"), load_split(root, manifest, "val")
    else:
        train = load_token_file(token_file(root, "train"), meta["dtype"])
        val = load_token_file(token_file(root, "val"), meta["dtype"])
    return TokenData(train, val, tokenizer, f"{root} ({len(train):,} train / {len(val):,} val tokens, "
                                            f"vocab {tokenizer.vocab_size})", str(root))
