"""The sharded layout of a prepared dataset, and reading it back as one token stream per split.

A directory written by `prepare_shards` holds `manifest.json` (format, dtype, vocabulary size, the
tokenizer's sha256, and per split the shard files in order with their token counts and first
positions: the index), `shards/train-000000.bin`, ... (flat uint16/uint32 ids, `--shard-tokens`
each, the last one shorter), the tokenizer's files, and `meta.json` (written last, as for the
single-file layout). The shards of a split are consecutive pieces of one stream: documents
separated by the tokenizer's eos, cut at fixed token counts wherever they fall.

`ShardedTokens` reads that stream memory-mapped: `len`, integer, slice and integer-array indexing
over the whole stream (positions on both sides of a shard boundary are read from both shards), so
`get_batch` samples windows uniformly over every position exactly as from one flat file (the same
windows, given the same generator), and training's exact resume carries over unchanged.

Example:
    >>> import numpy as np
    >>> stream = ShardedTokens([np.arange(0, 5), np.arange(5, 8)])
    >>> len(stream), stream[3:7].tolist(), stream[np.array([[4, 5], [7, 0]])].tolist()
    (8, [3, 4, 5, 6], [[4, 5], [7, 0]])
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

MANIFEST_FILE = "manifest.json"
SHARD_DIR = "shards"
FORMAT = "glasslm-shards-1"


class ShardedTokens:
    """Consecutive 1-D token arrays (memory maps) read as one stream of `len` positions."""

    def __init__(self, shards: Sequence[np.ndarray]):
        self.shards = [s for s in shards if len(s)]
        lengths = np.array([len(s) for s in self.shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(lengths)])  # shard k holds [starts[k], starts[k+1])
        self.dtype = self.shards[0].dtype if self.shards else np.dtype(np.uint16)

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return self[np.arange(start, stop, step)]
            return self._range(start, max(start, stop))
        positions = np.asarray(index)
        if positions.dtype.kind not in "iu":
            raise TypeError(f"ShardedTokens indices must be integers or slices, got {positions.dtype}")
        flat = np.where(positions < 0, positions + len(self), positions).reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= len(self)):
            raise IndexError(f"index out of range for a stream of {len(self)} tokens")
        out = np.empty(flat.shape, dtype=self.dtype)
        shard_of = np.searchsorted(self.starts, flat, side="right") - 1
        for k in np.unique(shard_of):
            at = shard_of == k
            out[at] = self.shards[k][flat[at] - self.starts[k]]
        return out.reshape(positions.shape) if positions.ndim else out[0]

    def _range(self, start: int, stop: int) -> np.ndarray:
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        parts = []
        k = max(first, 0)
        while k < len(self.shards) and self.starts[k] < stop:
            lo, hi = max(start, self.starts[k]) - self.starts[k], min(stop, self.starts[k + 1]) - self.starts[k]
            parts.append(self.shards[k][lo:hi])
            k += 1
        return np.concatenate(parts) if parts else np.empty(0, dtype=self.dtype)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self._range(0, len(self))
        return whole if dtype is None else whole.astype(dtype)

    def tolist(self) -> list[int]:
        return self._range(0, len(self)).tolist()


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a sharded directory, refusing one that is unreadable or of another format."""
    path = Path(directory) / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is unreadable ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not a glasslm shard manifest ({FORMAT}); rerun prepare with --overwrite")
    return manifest


def write_manifest(directory: str | os.PathLike, manifest: dict[str, Any]) -> None:
    """Write the manifest atomically: a reader sees the old one or the new one, never half of one."""
    path = Path(directory) / MANIFEST_FILE
    tmp = path.with_name(f".{MANIFEST_FILE}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(manifest, indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_split(directory: str | os.PathLike, manifest: dict[str, Any], split: str) -> ShardedTokens:
    """The memory-mapped shards of one split, checked against the manifest's token counts."""
    root, dtype = Path(directory), np.dtype(manifest["dtype"])
    shards = []
    for entry in manifest["splits"][split]:
        path = root / entry["file"]
        if not path.is_file():
            raise FileNotFoundError(f"{path} (listed in {root / MANIFEST_FILE}) does not exist")
        if path.stat().st_size != entry["tokens"] * dtype.itemsize:
            raise ValueError(f"{path} is {path.stat().st_size} bytes, but the manifest lists {entry['tokens']} "
                             f"{dtype.name} tokens: the dataset is damaged; rerun prepare with --overwrite")
        shards.append(np.memmap(path, dtype=dtype, mode="r"))
    stream = ShardedTokens(shards)
    if len(stream) == 0:
        raise ValueError(f"{root}: the {split} split holds no tokens")
    return stream
