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

import dataclasses
import functools
import mmap
import os
import struct
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


class _Cursor:
    """Reads GGUF's little-endian values one after another from a buffer."""

    def __init__(self, buffer: memoryview, offset: int = 0):
        self.buffer, self.offset = buffer, offset

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.take("<Q")
        start, self.offset = self.offset, self.offset + length
        if self.offset > len(self.buffer):
            raise ValueError("a string runs past the end of the file")
        return bytes(self.buffer[start:self.offset]).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.take("<I"), self.take("<Q")
            if item_kind == _STRING:
                return [self.string() for _ in range(count)]
            if item_kind not in _SCALARS:
                raise ValueError(f"an array of value type {item_kind}")
            dtype = np.dtype(_SCALARS[item_kind][1]).newbyteorder("<")
            values = np.frombuffer(self.buffer, dtype, count, self.offset)
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


class GGUFFile:
    """The metadata and tensors of one GGUF file (`GGUFFile.open(path)`)."""

    def __init__(self, path: Path):
        self.path = path
        self._data = np.memmap(path, mode="r")
        self.metadata: dict[str, Any] = {}
        self._tensors: dict[str, _TensorEntry] = {}
        self._read_header(memoryview(self._data))

    def _read_header(self, buffer: memoryview) -> None:
        cursor = _Cursor(buffer, 4)
        version = cursor.take("<I")
        if version not in _VERSIONS:
            raise ValueError(f"GGUF version {version} (a big-endian file, or one newer than glasslm reads: "
                             f"{', '.join(map(str, _VERSIONS))})")
        n_tensors, n_values = cursor.take("<Q"), cursor.take("<Q")
        for _ in range(n_values):
            key = cursor.string()
            self.metadata[key] = cursor.value(cursor.take("<I"))
        infos = [self._tensor_info(cursor) for _ in range(n_tensors)]
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-cursor.offset // alignment) * alignment
        for name, entry in infos:
            entry = dataclasses.replace(entry, offset=start + entry.offset)
            if entry.offset + entry.n_bytes > len(buffer):
                raise ValueError(f"tensor {name} runs past the end of the file")
            self._tensors[name] = entry

    @staticmethod
    def _tensor_info(cursor: _Cursor) -> tuple[str, _TensorEntry]:
        gguf = _gguf_lib()
        name = cursor.string()
        dims = [cursor.take("<Q") for _ in range(cursor.take("<I"))]
        qtype = gguf.GGMLQuantizationType(cursor.take("<I"))
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        n_bytes = int(np.prod(dims, dtype=np.int64)) // block * block_bytes
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
            raise ValueError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")
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
        blocks = torch.from_numpy(np.array(raw, dtype=np.uint8)).reshape(entry.shape[0] if len(entry.shape) > 1 else 1, -1)
        self._release(entry)
        return blocks

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
    def _rows(entry: _TensorEntry) -> int:
        return int(np.prod(entry.shape[:-1], dtype=np.int64)) if len(entry.shape) > 1 else 1

    def _tensor(self, name: str) -> _TensorEntry:
        if name not in self._tensors:
            raise KeyError(f"{self.path} has no tensor {name!r}")
        return self._tensors[name]


@functools.lru_cache(maxsize=2)
def _open_file(path: Path, mtime_ns: int, size: int) -> GGUFFile:
    try:
        return GGUFFile(path)
    except (ValueError, IndexError, KeyError, OSError, struct.error, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not a readable GGUF file ({err}); truncated or corrupt?") from None
