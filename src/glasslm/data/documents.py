"""Where a corpus's documents come from: text files, JSONL files (a `text` field per line), parquet
files (a `text` column), Hugging Face `datasets` (a directory written by `save_to_disk`, or a name
`datasets.load_dataset` knows, streamed or not), and globs or directories of such files.

`expand_sources` turns what the user typed into `Source`s, in a fixed order (globs and directories
sorted), and `pieces` reads them as (split, text) pieces, one after another:

- a text file is one document: the text before `split_offset` (its last `val_fraction`, from a line
  start, as `prepare` always cut files) is a train piece, the rest a val piece;
- a record (a JSONL line, a parquet row, a dataset row) is one document, and record number i
  (counted over all record sources, from 0) is validation when floor((i + 1) f) > floor(i f), so
  every 1/f-th record is held out, spread evenly over the corpus, known without counting it first
  (streaming) and the same on every rerun.

Example:
    >>> import tempfile, pathlib, json
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "a.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\\n" for i in range(4)))
    >>> [(p.split, p.text) for p in pieces(expand_sources([str(d / "*.jsonl")]), val_fraction=0.5)]
    [('train', 'doc 0'), ('val', 'doc 1'), ('train', 'doc 2'), ('val', 'doc 3')]
"""

from __future__ import annotations

import glob
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from glasslm.data.datasets import DATASETS, fetch_dataset
from glasslm.data.prepared import check_prepared, is_prepared
from glasslm.data.splits import split_offset

SourceKind = Literal["text", "jsonl", "parquet", "dataset-dir", "dataset-name"]
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
TEXT_SUFFIXES = (".txt", ".text", ".md")
RECORDS_PER_BATCH = 1024  # rows read at a time from parquet, JSONL and datasets


@dataclass(frozen=True)
class Source:
    """One input: what kind it is and where (a path, or a dataset name)."""

    kind: SourceKind
    location: str


@dataclass(frozen=True)
class Piece:
    """A document's text for one split; `index` counts pieces over the whole corpus, from 0."""

    index: int
    split: Literal["train", "val"]
    text: str


def _kind_of_file(path: Path) -> SourceKind:
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return "text"


def _is_saved_dataset(path: Path) -> bool:
    """A directory written by `datasets.Dataset.save_to_disk` (or a DatasetDict's)."""
    return (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file() \
        or (path / "state.json").is_file()


def _directory_sources(path: Path) -> list[Source]:
    check_prepared(path)
    if is_prepared(path):
        raise ValueError(f"{path} is a prepared dataset (token files), not text to prepare")
    if _is_saved_dataset(path):
        return [Source("dataset-dir", str(path))]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.lower().endswith(
        JSONL_SUFFIXES + PARQUET_SUFFIXES + TEXT_SUFFIXES) and not p.name.startswith("."))
    if not files:
        raise ValueError(f"{path} holds no .txt, .jsonl or .parquet files (nor a saved Hugging Face dataset)")
    return [Source(_kind_of_file(p), str(p)) for p in files]


def is_dataset_name(spec: str) -> bool:
    """Whether a missing path reads as a Hugging Face dataset name: owner/name, no file suffix.

    >>> is_dataset_name("HuggingFaceFW/fineweb-edu"), is_dataset_name("data/x.jsonl"), is_dataset_name("mine.txt")
    (True, False, False)
    """
    path = Path(spec)
    return spec.count("/") == 1 and not spec.startswith((".", "/", "~")) and not glob.has_magic(spec) \
        and path.suffix.lower() not in JSONL_SUFFIXES + PARQUET_SUFFIXES + TEXT_SUFFIXES and not path.exists()


def is_single_text_input(spec: str) -> bool:
    """Whether an input is one text file (or a known dataset's), which prepare's single-file layout
    (train.bin / val.bin) reads: not a glob, a directory, JSONL, parquet or a Hugging Face dataset.

    >>> is_single_text_input("tinyshakespeare"), is_single_text_input("corpus/*.txt"), is_single_text_input("a.jsonl")
    (True, False, False)
    """
    path = Path(spec)
    return spec in DATASETS or (not glob.has_magic(spec) and not path.is_dir() and not is_dataset_name(spec)
                                and _kind_of_file(path) == "text")


def expand_sources(inputs: Sequence[str | os.PathLike], data_dir: str | os.PathLike | None = None) -> list[Source]:
    """What each input names, in order: a known dataset name (DATASETS), a file (by its suffix:
    .jsonl/.json/.ndjson, .parquet, else text), a glob (sorted matches), a directory (a saved
    Hugging Face dataset, else its .txt/.jsonl/.parquet files, sorted), or else a dataset name for
    `datasets.load_dataset` (owner/name).

    >>> expand_sources(["no/such/*.jsonl"])
    Traceback (most recent call last):
    ...
    FileNotFoundError: no file matches the pattern 'no/such/*.jsonl'
    >>> expand_sources(["HuggingFaceFW/fineweb-edu"])
    [Source(kind='dataset-name', location='HuggingFaceFW/fineweb-edu')]
    """
    if not inputs:
        raise ValueError("no inputs given: name text, JSONL or parquet files, a glob, a directory or a dataset")
    sources: list[Source] = []
    for spec in map(str, inputs):
        path = Path(spec)
        if spec in DATASETS:
            sources.append(Source("text", str(fetch_dataset(spec, data_dir))))
        elif path.is_file():
            sources.append(Source(_kind_of_file(path), spec))
        elif path.is_dir():
            sources.extend(_directory_sources(path))
        elif glob.has_magic(spec):
            matches = sorted(p for p in glob.glob(spec, recursive=True) if Path(p).is_file())
            if not matches:
                raise FileNotFoundError(f"no file matches the pattern {spec!r}")
            sources.extend(Source(_kind_of_file(Path(p)), p) for p in matches)
        elif is_dataset_name(spec):
            sources.append(Source("dataset-name", spec))
        else:
            raise FileNotFoundError(f"{spec!r} is neither a known dataset ({', '.join(DATASETS)}), a file, a glob, "
                                    "a directory nor a Hugging Face dataset name (owner/name)")
    return sources


def _pyarrow(what: str) -> Any:
    try:
        import pyarrow  # noqa: F401
        import pyarrow.json
        import pyarrow.parquet
    except ImportError:
        raise ImportError(f"reading {what} needs pyarrow: pip install pyarrow (in a glasslm checkout: "
                          "pip install -e '.[data]')") from None
    return pyarrow


def _column_texts(batch: Any, name: str, where: str, what: str) -> list[str]:
    """The strings of column `name` of a pyarrow record batch, refusing a missing or non-text column."""
    if name not in batch.schema.names:
        raise ValueError(f"{where} has no {what} {name!r} (it has: {', '.join(batch.schema.names)}); "
                         f"name the one holding the text with --{what}")
    texts = batch.column(name).to_pylist()
    bad = next((t for t in texts if not isinstance(t, str)), "")
    if bad != "":
        raise ValueError(f"{where}: {what} {name!r} holds {type(bad).__name__} values, not text")
    return texts


def _jsonl_texts(path: str, field: str) -> Iterator[list[str]]:
    pa = _pyarrow("JSONL")
    try:
        reader = pa.json.open_json(path, read_options=pa.json.ReadOptions(block_size=1 << 24))
        for batch in reader:
            yield _column_texts(batch, field, path, "field")
    except pa.ArrowInvalid as err:
        raise ValueError(f"{path} is not JSONL (one JSON object per line): {err}") from None


def _parquet_texts(path: str, column: str) -> Iterator[list[str]]:
    pa = _pyarrow("parquet")
    try:
        parquet = pa.parquet.ParquetFile(path)
    except pa.ArrowInvalid as err:
        raise ValueError(f"{path} is not a parquet file: {err}") from None
    if column not in parquet.schema_arrow.names:
        raise ValueError(f"{path} has no column {column!r} (it has: {', '.join(parquet.schema_arrow.names)}); "
                         "name the one holding the text with --column")
    for batch in parquet.iter_batches(batch_size=RECORDS_PER_BATCH, columns=[column]):
        yield _column_texts(batch, column, path, "column")


def _dataset_texts(source: Source, column: str, split: str, streaming: bool) -> Iterator[list[str]]:
    try:
        import datasets
    except ImportError:
        raise ImportError("Hugging Face datasets need the datasets package: pip install datasets (in a glasslm "
                          "checkout: pip install -e '.[data]')") from None
    if source.kind == "dataset-dir":
        dataset = datasets.load_from_disk(source.location)
        if isinstance(dataset, datasets.DatasetDict):
            if split not in dataset:
                raise ValueError(f"{source.location} has no split {split!r} (it has: {', '.join(dataset)}); "
                                 "choose one with --split")
            dataset = dataset[split]
    else:
        dataset = datasets.load_dataset(source.location, split=split, streaming=streaming)
    names = list(dataset.column_names or [])
    if column not in names:
        raise ValueError(f"dataset {source.location} has no column {column!r} (it has: {', '.join(names)}); "
                         "name the one holding the text with --column")
    for batch in dataset.select_columns([column]).iter(batch_size=RECORDS_PER_BATCH):
        texts = batch[column]
        if any(not isinstance(t, str) for t in texts):
            raise ValueError(f"dataset {source.location}: column {column!r} holds values that are not text")
        yield texts


def record_texts(source: Source, field: str = "text", column: str = "text", split: str = "train",
                 streaming: bool = False) -> Iterator[list[str]]:
    """The texts of a record source, a batch (list) at a time."""
    if source.kind == "jsonl":
        return _jsonl_texts(source.location, field)
    if source.kind == "parquet":
        return _parquet_texts(source.location, column)
    return _dataset_texts(source, column, split, streaming)


def is_validation_record(i: int, val_fraction: float) -> bool:
    """Whether record i (from 0) is held out: every 1/val_fraction-th, evenly spread.

    >>> [i for i in range(30) if is_validation_record(i, 0.1)]
    [9, 19, 29]
    """
    return math.floor((i + 1) * val_fraction + 1e-9) > math.floor(i * val_fraction + 1e-9)


def _text_file_pieces(path: str, val_fraction: float) -> Iterator[tuple[str, str]]:
    data = Path(path).read_bytes()
    cut = split_offset(path, val_fraction)
    try:
        yield "train", data[:cut].decode("utf-8")
        yield "val", data[cut:].decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text ({err})") from None


def pieces(sources: Sequence[Source], val_fraction: float, field: str = "text", column: str = "text",
           split: str = "train", streaming: bool = False) -> Iterator[Piece]:
    """Every document's train or val piece, in order (see the module docstring for the split rule)."""
    index = record = 0
    for source in sources:
        if source.kind == "text":
            for which, text in _text_file_pieces(source.location, val_fraction):
                yield Piece(index, which, text)  # type: ignore[arg-type]
                index += 1
            continue
        for texts in record_texts(source, field, column, split, streaming):
            for text in texts:
                yield Piece(index, "val" if is_validation_record(record, val_fraction) else "train", text)
                index, record = index + 1, record + 1


def corpus_characters(sources: Sequence[Source], **read: Any) -> list[str]:
    """Every distinct character of the corpus's documents, sorted (a character tokenizer's vocabulary)."""
    chars: set[str] = set()
    for piece in pieces(sources, 0.5, **read):
        chars.update(piece.text)
    if not chars:
        raise ValueError("the inputs hold no text: no characters for a vocabulary")
    return sorted(chars)
