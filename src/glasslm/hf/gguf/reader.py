"""A GGUF file opened for reading: its metadata as plain Python values and its tensors, read lazily.

The layout (GGUF versions 2 and 3, little-endian, as llama.cpp writes it):

    "GGUF" | version u32 | tensor count u64 | key-value count u64
    key-values:   key (u64 length + UTF-8) | value type u32 | value
    tensor infos: name | dims count u32 | dims u64... (innermost first) | ggml type u32 | offset u64
    padding to `general.alignment` (32), then the tensors' data, each at its offset

The header is parsed here rather than by the gguf package's reader: that reader makes a numpy view
for every element of every array, which takes seconds for a vocabulary of 50,000 tokens and their
merges; this one reads them in one pass (~0.1 s). Tensor data stays memory-mapped until asked for
and is dequantized by the gguf package's numpy dequantizers (llama.cpp's own Python library: every
ggml type, F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants, ...), or handed out as its
raw block bytes for the formats glasslm keeps as they are (`glasslm.transforms.ggml`).

GGUF lists a tensor's dimensions innermost first (ggml's `ne`); shapes here are PyTorch's, outermost
first, so a Linear weight is (d_out, d_in) in both.

Example:
    >>> import tempfile, numpy as np, gguf
    >>> path = tempfile.mkdtemp() + "/tiny.gguf"
    >>> writer = gguf.GGUFWriter(path, "llama")
    >>> writer.add_block_count(1)
    >>> writer.add_tensor("blk.0.ffn_up.weight", np.ones((3, 32), dtype=np.float32))
    >>> for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
    ...     write()
    >>> writer.close()
    >>> file = GGUFFile.open(path)
    >>> file.arch, file.arch_value("block_count"), file.shape("blk.0.ffn_up.weight"), file.qtype("blk.0.ffn_up.weight")
    ('llama', 1, (3, 32), 'f32')
"""

from __future__ import annotations

import array
import dataclasses
import functools
import math
import mmap
import os
import struct
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

GGUF_MAGIC = b"GGUF"
GGUF_SUFFIX = ".gguf"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# GGUF value types -> (struct format, numpy dtype) for the fixed-size ones; 8 is a string, 9 an array.
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16), 4: ("<I", np.uint32),
            5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_), 10: ("<Q", np.uint64),
            11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY = 8, 9


def is_gguf_file(path: str | os.PathLike) -> bool:
    """True for an existing file that starts with GGUF's magic bytes."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def _gguf_lib():
    try:
        import gguf
    except ImportError:
        raise ImportError("reading GGUF files needs the gguf package (llama.cpp's): pip install gguf") from None
    return gguf


def _plain(value: Any) -> Any:
    """A float (stored in float32) as the shortest decimal that is that float32: 1e-06 reads as 1e-06,
    not 9.99999997e-07 (the number config.json says, the same float32)."""
    return float(str(np.float32(value))) if isinstance(value, float) else value


_U64 = struct.Struct("<Q")
_JOINED_AT_MOST = 1 << 26  # bytes of strings decoded at once, a few copies of them made (a vocabulary's: ~2 MB)


class _Cursor:
    """Reads GGUF's little-endian values one after another from a buffer, never past its end: every
    count and length is checked against the bytes left before anything is made from it."""

    def __init__(self, buffer: memoryview, offset: int = 0):
        self.buffer, self.offset = buffer, offset

    def left(self) -> int:
        return len(self.buffer) - self.offset

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if size > self.left():
            raise ValueError(f"the header runs past the end of the file (at byte {self.offset:,})")
        (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += size
        return value

    def count(self, what: str, least_bytes: int) -> int:
        """A u64 count of items of at least `least_bytes` each, which must fit in the bytes left."""
        n = self.take("<Q")
        if n * least_bytes > self.left():
            raise ValueError(f"{what} count {n:,} needs more bytes than the file has left ({self.left():,})")
        return n

    def string(self) -> str:
        length = self.count("a string's byte", 1)
        start, self.offset = self.offset, self.offset + length
        return bytes(self.buffer[start:self.offset]).decode("utf-8", errors="replace")

    def strings(self, n: int) -> list[str]:
        """`n` strings one after another: `string()` n times, in one loop (a vocabulary is 50k-260k of
        them, read at every load), or at once (`_joined_strings`) where that gives the same strings."""
        joined = self._joined_strings(n)
        if joined is not None:
            return joined
        buffer, offset, end, out = self.buffer, self.offset, len(self.buffer), []
        length_at = _U64.unpack_from
        for _ in range(n):
            if offset + 8 > end:
                raise ValueError(f"the header runs past the end of the file (at byte {offset:,})")
            (length,) = length_at(buffer, offset)
            offset += 8
            if length > end - offset:
                raise ValueError(f"a string's byte count {length:,} needs more bytes than the file has left "
                                 f"({end - offset:,})")
            out.append(str(buffer[offset:offset + length], "utf-8", "replace"))
            offset += length
        self.offset = offset
        return out

    def _joined_strings(self, n: int) -> list[str] | None:
        """`strings(n)` decoded as one text: the loop finds only where each string starts, and the
        strings' bytes, each after a zero byte (its length's last byte), are decoded and split in one
        go (~2x faster than a decode per string). None (the loop then reads them, and says what is
        wrong) where that could differ: a string running past the end, or one holding a zero byte
        or bytes that are not UTF-8 (which `strings` decodes with replacement characters)."""
        buffer, start, starts = self.buffer, self.offset, array.array("q")  # (8 bytes a string: within the file's size)
        offset, length_at, append = start, _U64.unpack_from, starts.append
        try:
            for _ in range(n):
                append(offset)
                offset += 8 + length_at(buffer, offset)[0]
        except (struct.error, OverflowError):  # a length read past the end of the buffer, or past 2**63
            return None
        if offset > len(buffer) or not starts or offset - start > _JOINED_AT_MOST:
            return None
        data = np.frombuffer(buffer, np.uint8, offset - start, start)
        firsts = np.frombuffer(starts, dtype=np.int64) - start  # (n,) where each length starts
        edges = np.zeros(len(data) + 1, dtype=np.int8)  # +1 where a kept stretch starts, -1 where it ends
        edges[firsts + 7] = 1  # (a length's last byte: zero, as no length here is 2**56 bytes)
        edges[np.append(firsts[1:], len(data))] = -1
        joined = data[np.cumsum(edges[:-1], dtype=np.int8) > 0].tobytes()  # "\0" + s0 + "\0" + s1 ...
        if joined.count(0) != n:
            return None
        try:
            text = joined.decode("utf-8")
        except UnicodeDecodeError:
            return None
        self.offset = offset
        return text.split("\0")[1:]

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind = self.take("<I")
            if item_kind == _STRING:
                return self.strings(self.count("an array's item", 8))
            if item_kind not in _SCALARS:
                raise ValueError(f"an array of value type {item_kind} (arrays of arrays are not read)")
            dtype = np.dtype(_SCALARS[item_kind][1]).newbyteorder("<")
            values = np.frombuffer(self.buffer, dtype, self.count("an array's item", dtype.itemsize), self.offset)
            self.offset += values.nbytes
            return values.tolist()
        if kind not in _SCALARS:
            raise ValueError(f"unknown value type {kind}")
        return _plain(self.take(_SCALARS[kind][0]))


@dataclasses.dataclass(frozen=True)
class _TensorEntry:
    qtype: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # PyTorch's order, outermost first
    offset: int  # from the start of the file
    n_bytes: int


_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
# The smallest key-value (key length, an empty key, value type, a one-byte value) and tensor info
# (name length, dims count, one dim, type, offset), for bounding their counts by the file's length.
_LEAST_VALUE_BYTES, _LEAST_TENSOR_BYTES = 8 + 4 + 1, 8 + 4 + 8 + 4 + 8


def _alignment(metadata: dict[str, Any]) -> int:
    """`general.alignment`: a power of two (llama.cpp's rule), 32 where the file says none."""
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment is {alignment!r}; it must be a power of two")
    return alignment


class GGUFFile:
    """The metadata and tensors of one GGUF file (`GGUFFile.open(path)`)."""

    def __init__(self, path: Path):
        self.path = path
        self._data = np.memmap(path, mode="r")
        self._mapped: list[_TensorEntry] = []  # views given out whose pages are still this process's
        self._private: np.memmap | None = None  # the copy-on-write mapping `kept_blocks` views
        self.metadata: dict[str, Any] = {}
        self._tensors: dict[str, _TensorEntry] = {}
        self._read_header(memoryview(self._data))

    def _read_header(self, buffer: memoryview) -> None:
        cursor = _Cursor(buffer, 4)
        version = cursor.take("<I")
        if version not in _VERSIONS:
            raise ValueError(f"GGUF version {version} (a big-endian file, or one newer than glasslm reads: "
                             f"{', '.join(map(str, _VERSIONS))})")
        n_tensors = cursor.count("the tensor", _LEAST_TENSOR_BYTES)
        for _ in range(cursor.count("the key-value", _LEAST_VALUE_BYTES)):
            key = cursor.string()
            if key in self.metadata:
                raise ValueError(f"the key {key!r} appears twice")
            self.metadata[key] = cursor.value(cursor.take("<I"))
        infos = [self._tensor_info(cursor) for _ in range(n_tensors)]
        alignment = _alignment(self.metadata)
        start = -(-cursor.offset // alignment) * alignment  # the data section, after the padding
        for name, entry in infos:
            if name in self._tensors:
                raise ValueError(f"tensor {name} appears twice")
            if entry.offset % alignment:
                raise ValueError(f"tensor {name}'s offset {entry.offset:,} is not a multiple of the alignment {alignment}")
            entry = dataclasses.replace(entry, offset=start + entry.offset)
            if entry.offset + entry.n_bytes > len(buffer):  # (Python integers: no wrapping)
                raise ValueError(f"tensor {name} ({entry.n_bytes:,} bytes at {entry.offset:,}) runs past the end of "
                                 f"the file ({len(buffer):,} bytes)")
            self._tensors[name] = entry

    @staticmethod
    def _tensor_info(cursor: _Cursor) -> tuple[str, _TensorEntry]:
        gguf = _gguf_lib()
        name = cursor.string()
        n_dims = cursor.take("<I")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ValueError(f"tensor {name} has {n_dims} dimensions (ggml's tensors have 1 to {_MAX_DIMS})")
        dims = [cursor.take("<Q") for _ in range(n_dims)]
        if 0 in dims:
            raise ValueError(f"tensor {name} has a dimension of 0")
        kind = cursor.take("<I")
        try:
            qtype = gguf.GGMLQuantizationType(kind)
            block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name} has ggml type {kind}, which the gguf package does not know") from None
        if dims[0] % block:
            raise ValueError(f"tensor {name}'s rows of {dims[0]:,} do not divide into {qtype.name}'s blocks of {block}")
        # The byte count in Python integers, exact however large the dimensions (a 64-bit product wraps).
        n_bytes = math.prod(dims) // block * block_bytes
        return name, _TensorEntry(qtype, tuple(int(d) for d in reversed(dims)), cursor.take("<Q"), n_bytes)

    @classmethod
    def open(cls, path: str | os.PathLike) -> "GGUFFile":
        """Read `path`'s header, metadata and tensor index (tensor data stays on disk until asked for).

        The last files opened are kept (while unchanged on disk): a command that asks a file for its
        chat template and then loads it parses its header once.
        """
        path = Path(path).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        if not is_gguf_file(path):
            what = "it is empty" if path.stat().st_size == 0 else "it does not start with the bytes 'GGUF'"
            raise ValueError(f"{path} is not a GGUF file ({what})")
        stat = path.stat()
        return _open_file(path, stat.st_mtime_ns, stat.st_size)

    @property
    def arch(self) -> str:
        """`general.architecture`: llama.cpp's name for the model's architecture ("llama", "qwen2", ...)."""
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError(f"{self.path} names no general.architecture")
        return arch

    def arch_value(self, key: str, default: Any = None) -> Any:
        """The architecture's own metadata `{arch}.{key}` (e.g. "attention.head_count")."""
        return self.metadata.get(f"{self.arch}.{key}", default)

    def tensor_names(self) -> set[str]:
        return set(self._tensors)

    def qtype(self, name: str) -> str:
        """The tensor's ggml type in lower case: "f32", "f16", "q8_0", "q4_1", "q4_k", ..."""
        return self._tensor(name).qtype.name.lower()

    def shape(self, name: str) -> tuple[int, ...]:
        return self._tensor(name).shape

    def blocks(self, name: str) -> Tensor:
        """A tensor's raw bytes, (rows, bytes per row) uint8, as the file holds them (for the block formats:
        each row's blocks, one after another)."""
        entry = self._tensor(name)
        raw = self._data[entry.offset:entry.offset + entry.n_bytes]
        blocks = torch.from_numpy(np.array(raw, dtype=np.uint8)).reshape(self._block_rows(entry), -1)
        self._release(entry)
        return blocks

    def blocks_shape(self, name: str) -> tuple[int, int]:
        """(rows, bytes per row) of `blocks(name)`, without reading it."""
        entry = self._tensor(name)
        rows = self._block_rows(entry)
        return rows, entry.n_bytes // rows

    def mapped_blocks(self, name: str) -> Tensor:
        """`blocks(name)` without a copy: a read-only view of the file's mapped bytes, for a reader that
        copies them at once (a packer re-laying them out). Never write to it. Its pages are dropped from
        this process's memory at the next `mapped_blocks` call or `drop_mapped()` (reading the view
        after that only reads them back from the OS's cache)."""
        self.drop_mapped()
        entry = self._tensor(name)
        raw = self._data[entry.offset:entry.offset + entry.n_bytes]
        with warnings.catch_warnings():  # (torch warns of any read-only array: this one is by design)
            warnings.simplefilter("ignore", UserWarning)
            blocks = torch.from_numpy(raw).reshape(self._block_rows(entry), -1)
        self._mapped.append(entry)
        return blocks

    def kept_blocks(self, name: str) -> Tensor:
        """`blocks(name)` without a copy, for a layer that keeps the bytes as they are (float weights):
        a view of a private, copy-on-write mapping of the file, which lives as long as any view of it.
        Its pages are read from the file when first touched and shared with the OS's cache, as
        llama.cpp maps a model, and a write to it changes only this process's copy. (As with llama.cpp,
        overwriting the file in place while a model reads it changes or cuts what it reads; writing a
        new file and renaming it over the old one does not.)"""
        entry = self._tensor(name)
        if self._private is None:
            self._private = np.memmap(self.path, mode="c")
        raw = self._private[entry.offset:entry.offset + entry.n_bytes]
        return torch.from_numpy(raw).reshape(self._block_rows(entry), -1)

    def drop_mapped(self) -> None:
        """Drops the pages of the views `mapped_blocks` gave from this process's memory."""
        while self._mapped:
            self._release(self._mapped.pop())

    def dequantized(self, name: str) -> Tensor:
        """The tensor as float32, whatever its type, in PyTorch's shape."""
        entry = self._tensor(name)
        gguf = _gguf_lib()
        raw = self._data[entry.offset:entry.offset + entry.n_bytes]
        typed = {"F32": np.float32, "F16": np.float16}.get(entry.qtype.name)
        data = raw.view(typed) if typed else raw.reshape(-1, entry.n_bytes // max(1, self._rows(entry)))
        try:
            values = gguf.quants.dequantize(np.asarray(data), entry.qtype)
        except NotImplementedError as err:
            raise ValueError(f"{self.path}: tensor {name} is {entry.qtype.name}, which the gguf package "
                             f"cannot dequantize ({err})") from None
        tensor = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(entry.shape)
        self._release(entry)
        return tensor

    def _release(self, entry: _TensorEntry) -> None:
        """Drops a tensor's pages of the mapped file from this process's memory once it has its own copy
        (the pages stay in the OS's cache): a loaded model would otherwise count the file twice."""
        mapped = getattr(self._data, "_mmap", None)
        if mapped is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = entry.offset // mmap.PAGESIZE * mmap.PAGESIZE
        mapped.madvise(mmap.MADV_DONTNEED, start, entry.offset + entry.n_bytes - start)

    @staticmethod
    def _block_rows(entry: _TensorEntry) -> int:
        """Rows of `blocks(name)`: PyTorch's first dimension (a 1-D tensor: one row)."""
        return entry.shape[0] if len(entry.shape) > 1 else 1

    @staticmethod
    def _rows(entry: _TensorEntry) -> int:
        return int(np.prod(entry.shape[:-1], dtype=np.int64)) if len(entry.shape) > 1 else 1

    def _tensor(self, name: str) -> _TensorEntry:
        if name not in self._tensors:
            raise ValueError(f"{self.path} has no tensor {name!r}")
        return self._tensors[name]


@functools.lru_cache(maxsize=2)
def _open_file(path: Path, mtime_ns: int, size: int) -> GGUFFile:
    try:
        return GGUFFile(path)
    except (ValueError, OSError) as err:  # (the parser raises ValueError for anything wrong in the file)
        raise ValueError(f"{path} is not a readable GGUF file ({err}); truncated or corrupt?") from None
