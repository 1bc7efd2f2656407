"""Datasets on disk and random contiguous training batches.

Known datasets are fetched from their public URL once, checked against a sha256, and kept in a
data directory: `--data-dir`, else the GLASSLM_DATA_DIR environment variable, else
~/.cache/glasslm. The CLI, the benchmarks and the scripts all use this one rule (`data_dir`).
Offline, the error says exactly where to put the file; `glasslm fetch NAME --from DIR` copies a
verified copy in from a local folder.

One split rule (`split_offset`) serves `prepare` and `train --data file.txt` alike: in each file,
text from the first line start at or after (1 - val_fraction) of its bytes is validation text.

Example:
    >>> import torch
    >>> tokens = torch.arange(100)
    >>> x, y = get_batch(tokens, batch_size=2, context_length=8, generator=torch.Generator().manual_seed(0))
    >>> bool((y[:, :-1] == x[:, 1:]).all())  # targets are the inputs shifted by one
    True
"""

from __future__ import annotations

import codecs
import errno
import hashlib
import itertools
import json
import os
import shutil
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from jaxtyping import Int
from torch import Tensor
from tqdm.auto import tqdm

from glasslm.locations import DATA_DIR_ENV, DATA_DIR_RULE, data_dir

@dataclass(frozen=True)
class DatasetInfo:
    filename: str
    url: str
    sha256: str


DATASETS: dict[str, DatasetInfo] = {
    "tinyshakespeare": DatasetInfo(
        filename="tinyshakespeare.txt",
        url="https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
        sha256="86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
    ),
}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_dataset(name: str, directory: str | os.PathLike | None = None,
                  source_dir: str | os.PathLike | None = None) -> Path:
    """Path to a known dataset's file, downloading and verifying it first if it is not there.

    With `source_dir`, a missing file is copied from that local folder (and verified) instead of
    downloaded: how the scripts seed the data directory from a shared copy on offline machines.
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    info = DATASETS[name]
    target = data_dir(directory) / info.filename
    if target.is_file():
        found = sha256_of(target)
        if found != info.sha256:
            raise ValueError(f"{target} has sha256 {found}, expected {info.sha256}: delete it to re-download")
        return target
    origin = info.url if source_dir is None else str(Path(source_dir) / info.filename)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{info.filename}.", suffix=".tmp", delete=False)
    try:
        with tmp:
            if source_dir is not None:
                with open(origin, "rb") as f:
                    shutil.copyfileobj(f, tmp)
            else:
                with urllib.request.urlopen(info.url, timeout=30) as response:
                    shutil.copyfileobj(response, tmp)
        found = sha256_of(Path(tmp.name))
        if found != info.sha256:
            raise ValueError(f"{origin} has sha256 {found}, expected {info.sha256}")
        os.replace(tmp.name, target)
    except (urllib.error.URLError, OSError) as err:
        Path(tmp.name).unlink(missing_ok=True)
        if source_dir is not None:
            raise
        # One line: the rule, and the exact path the file must have.
        raise RuntimeError(
            f"could not download dataset {name!r} from {info.url} ({err}); if this machine is offline, "
            f"put {info.filename} at {target} (data directory: {DATA_DIR_RULE}), "
            f"or copy it in with: glasslm fetch {name} --from DIR"
        ) from None
    except BaseException:
        Path(tmp.name).unlink(missing_ok=True)
        raise
    return target


def resolve_text(source: str | os.PathLike, directory: str | os.PathLike | None = None) -> Path:
    """A dataset name from DATASETS or a path to a text file."""
    if isinstance(source, str) and source in DATASETS:
        return fetch_dataset(source, directory)
    path = Path(source)
    if path.is_dir():
        check_prepared(path)  # names an interrupted `prepare` as such
        if is_prepared(path):
            raise ValueError(f"{path} is a prepared dataset (token files), not a text file")
        raise ValueError(f"{path} is a directory, not a text file or a dataset made by `glasslm prepare`")
    if not path.is_file():
        raise FileNotFoundError(f"{str(source)!r} is neither a known dataset ({', '.join(DATASETS)}) nor a file")
    return path


def train_val_split(tokens: Int[Tensor, "n"], val_fraction: float = 0.1) -> tuple[Tensor, Tensor]:
    """First (1 - val_fraction) of the tokens for training, the rest for validation (no shuffling,
    so no validation window overlaps a training window except at the single boundary).

    For tokens that do not come from a text file; text is split by `split_offset`, on a line start."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    cut = int(len(tokens) * (1.0 - val_fraction))
    return tokens[:cut], tokens[cut:]


def get_batch(
    tokens: Int[Tensor, "n"] | np.ndarray,
    batch_size: int,
    context_length: int,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> tuple[Int[Tensor, "batch seq"], Int[Tensor, "batch seq"]]:
    """Random contiguous windows: inputs tokens[i : i+T] and next-token targets tokens[i+1 : i+T+1].

    `tokens` may be a 1-D tensor or numpy array, including a memory-mapped token file: only the
    sampled windows are read from disk. Starts are uniform over every full window, drawn from
    `generator` (torch's global generator if None). Both outputs are int64 on `device`.

    >>> x, y = get_batch(np.arange(100), batch_size=2, context_length=4, device="cpu")
    >>> x.shape, bool((y == x + 1).all())
    (torch.Size([2, 4]), True)
    """
    if isinstance(device, torch.Generator):
        raise TypeError("get_batch's 4th argument is the device; pass the generator as generator=...")
    n_starts = len(tokens) - context_length
    if n_starts < 1:
        raise ValueError(
            f"dataset of {len(tokens)} tokens is too small for one window of context_length "
            f"{context_length} + 1 target; use more text or a shorter context"
        )
    starts = torch.randint(n_starts, (batch_size,), generator=generator)
    offsets = starts[:, None] + torch.arange(context_length + 1)  # (batch, seq + 1)
    if isinstance(tokens, np.ndarray):
        windows = torch.from_numpy(tokens[offsets.numpy()].astype(np.int64))
    else:
        windows = tokens[offsets].long()
    x, y = windows[:, :-1], windows[:, 1:]
    if torch.device(device).type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


# --- prepared token files ---------------------------------------------------------------------

META_FILE = "meta.json"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (half the disk and memory bandwidth), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def split_offset(path: str | os.PathLike, val_fraction: float = 0.1) -> int:
    """Byte offset where a file's validation text starts: the first line start at or after
    (1 - val_fraction) of its bytes, or the next UTF-8 character boundary if no newline follows
    within 1 MiB. The one split rule of `prepare`, `train --data file.txt` and `eval --split`.

    >>> import tempfile, pathlib
    >>> f = pathlib.Path(tempfile.mkdtemp()) / "t.txt"; _ = f.write_text("aaaa\\nbbbb\\ncccc\\n")
    >>> split_offset(f, 0.3)  # 70% of 15 bytes is byte 10, which starts the line "cccc"
    10
    >>> split_offset(f, 0.4)  # 60% is byte 9, the newline ending "bbbb": the next line starts at 10
    10
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    path = Path(path)
    size = path.stat().st_size
    cut = int(size * (1.0 - val_fraction))
    if cut == 0:
        return 0
    with open(path, "rb") as f:
        f.seek(cut - 1)
        ahead = f.read(1 << 20)  # ahead[0] is the byte before the cut
    newline = ahead.find(b"\n")
    if newline >= 0:
        return cut + newline
    ahead = ahead[1:]
    step = 0
    while step < len(ahead) and ahead[step] & 0xC0 == 0x80:  # skip UTF-8 continuation bytes
        step += 1
    return cut + step


def read_split(path: str | os.PathLike, split: str, val_fraction: float = 0.1) -> str:
    """The text of one split of a file ("train", "val" or "all"), by `split_offset`'s rule."""
    data = Path(path).read_bytes()
    if split == "all":
        return data.decode("utf-8")
    cut = split_offset(path, val_fraction)
    if split == "train":
        return data[:cut].decode("utf-8")
    if split == "val":
        return data[cut:].decode("utf-8")
    raise ValueError(f"split must be train, val or all, got {split!r}")


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


INCOMPLETE_MARKER = ".prepare-incomplete"


def prepare(
    sources: Sequence[str | os.PathLike], tokenizer: Any, out_dir: str | os.PathLike,
    val_fraction: float = 0.1, chunk_bytes: int = 1 << 20, progress: bool = True, overwrite: bool = False,
) -> dict[str, Any]:
    """Tokenize text files into `train.bin` / `val.bin` + `meta.json` + the tokenizer's files.

    Split rule (`split_offset`): in each source file, text before the first line start at or after
    (1 - val_fraction) of its bytes goes to train.bin, the rest to val.bin, so every file
    contributes to both. Text is streamed in chunks, so memory does not grow with the corpus.

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
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
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


def _prepare_into(paths: list[Path], tokenizer: Any, out: Path, val_fraction: float, chunk_bytes: int,
                  progress: bool, total: int) -> dict[str, Any]:
    dtype = token_dtype(tokenizer.vocab_size)
    splits = {p: split_offset(p, val_fraction) for p in paths}
    counts = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="prepare", disable=not progress) as bar:
        for split in ("train", "val"):
            def texts() -> Iterator[str]:
                for p in paths:
                    start, end = (0, splits[p]) if split == "train" else (splits[p], p.stat().st_size)
                    yield from _read_text(p, start, end, chunk_bytes, bar)

            tmp = out / f".{split}.bin.tmp"
            counts[split] = _write_tokens(tokenizer.encode_iterable(texts()), tmp, dtype, tokenizer.vocab_size)
            os.replace(tmp, out / f"{split}.bin")
    tokenizer.save(out)
    meta = {
        "vocab_size": tokenizer.vocab_size, "dtype": dtype.name, "train_tokens": counts["train"],
        "val_tokens": counts["val"], "val_fraction": val_fraction, "sources": [str(p) for p in paths],
        "tokenizer": getattr(tokenizer, "kind", type(tokenizer).__name__),
    }
    (out / META_FILE).write_text(json.dumps(meta, indent=2))  # written last: marks the set complete
    return meta


def check_output_dir(out: str | os.PathLike, overwrite: bool = False, inputs: Sequence[str | os.PathLike] = (),
                     what: str = "output") -> None:
    """Refuse an output directory that would lose data: a file, a non-empty directory (unless
    `overwrite`), or one holding or equal to an input. Used by prepare, convert and train-tokenizer.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "x").write_text("keep me")
    >>> check_output_dir(d / "new")  # new: fine
    >>> check_output_dir(d)
    Traceback (most recent call last):
    ...
    ValueError: ... is not empty (x); choose another --out, or pass --overwrite to replace what it holds
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is an existing file, not a directory; choose another --out")
    resolved = out.resolve()
    for source in inputs:
        source = Path(source).resolve()
        if source == resolved or resolved in source.parents:
            raise ValueError(f"--out {out} would overwrite the input {source}; choose another --out")
    if not out.is_dir():
        return
    children = sorted(child.name for child in out.iterdir())
    if children and not overwrite:
        if INCOMPLETE_MARKER in children:
            raise ValueError(f"{out} holds an incomplete preparation (an interrupted prepare); "
                             "rerun prepare with --overwrite")
        shown = ", ".join(children[:4]) + (", ..." if len(children) > 4 else "")
        raise ValueError(f"{what} directory {out} is not empty ({shown}); choose another --out, "
                         "or pass --overwrite to replace what it holds")


def char_vocabulary(paths: Sequence[str | os.PathLike], chunk_bytes: int = 1 << 20) -> list[str]:
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
    if (path / INCOMPLETE_MARKER).exists() or any(path.glob(".*.bin.tmp")):
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

    train: Tensor | np.ndarray
    val: Tensor | np.ndarray
    tokenizer: Any
    description: str
    source: str  # the prepared directory or the text file, as a path


def load_prepared(directory: str | os.PathLike) -> TokenData:
    """The memory-mapped train/val files and tokenizer of a directory written by `prepare`."""
    from glasslm.tokenizers import load_tokenizer

    root = Path(directory)
    check_prepared(root)
    try:
        meta = json.loads((root / META_FILE).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{root / META_FILE} is unreadable ({err})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{root / META_FILE} should hold a JSON object describing the dataset, "
                         f"got a {type(meta).__name__}; rerun prepare with --overwrite")
    if meta.get("dtype") not in ("uint16", "uint32"):
        raise ValueError(f"{root / META_FILE}: dtype should be uint16 or uint32, got {meta.get('dtype')!r}; "
                         "rerun prepare with --overwrite")
    tokenizer = load_tokenizer(root)
    if tokenizer.vocab_size != meta.get("vocab_size"):
        raise ValueError(f"{root}: tokenizer has {tokenizer.vocab_size} tokens but meta.json says {meta.get('vocab_size')}")
    train = load_token_file(root / "train.bin", meta["dtype"])
    val = load_token_file(root / "val.bin", meta["dtype"])
    return TokenData(train, val, tokenizer, f"{root} ({len(train):,} train / {len(val):,} val tokens, "
                                            f"vocab {tokenizer.vocab_size})", str(root))


def load_training_data(source: str, directory: str | os.PathLike | None = None, val_fraction: float = 0.1,
                       tokenizer: Any | None = None) -> TokenData:
    """A prepared dataset directory, or a text file / dataset name tokenized in memory
    (character-level unless a tokenizer is given)."""
    from glasslm.tokenizers import CharTokenizer

    if is_prepared(source):
        return load_prepared(source)
    path = resolve_text(source, directory)
    data = path.read_bytes()
    if not data:
        raise ValueError(f"{path} is empty")
    # The same split as `prepare`: validation text starts on a line, at or after 90% of the bytes.
    cut = split_offset(path, val_fraction)
    try:
        train_text, val_text = data[:cut].decode("utf-8"), data[cut:].decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text ({err})") from None
    tokenizer = tokenizer or CharTokenizer.from_text(train_text + val_text)
    train = torch.tensor(tokenizer.encode(train_text), dtype=torch.long)
    val = torch.tensor(tokenizer.encode(val_text), dtype=torch.long)
    return TokenData(train, val, tokenizer, f"{path} ({len(train_text) + len(val_text):,} characters, "
                                            f"vocab {tokenizer.vocab_size}, {len(train):,} train / "
                                            f"{len(val):,} val tokens)", str(path))
