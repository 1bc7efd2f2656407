"""A GGUF file opened for reading: its metadata as plain Python values and its tensors, read lazily.

The file is memory-mapped by the gguf package's reader (llama.cpp's own Python library). A tensor
comes out either dequantized to float32 by that library's numpy dequantizers (every ggml type:
F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants, ...) or as its raw block bytes, for
the formats glasslm keeps as they are (`glasslm.transforms.ggml`).

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

import functools
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

GGUF_MAGIC = b"GGUF"
GGUF_SUFFIX = ".gguf"


def is_gguf_file(path: str | os.PathLike) -> bool:
    """True for an existing file that starts with GGUF's magic bytes."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def _plain(value: Any) -> Any:
    """A metadata value as Python has it; a float (stored in float32) as the shortest decimal that is
    that float32, so 1e-06 reads as 1e-06, not 9.99999997e-07 (config.json's number, the same float32)."""
    import numpy as np

    return float(str(np.float32(value))) if isinstance(value, float) else value


def _gguf_lib():
    try:
        import gguf
    except ImportError:
        raise ImportError("reading GGUF files needs the gguf package (llama.cpp's): pip install gguf") from None
    return gguf


class GGUFFile:
    """The metadata and tensors of one GGUF file (`GGUFFile.open(path)`)."""

    def __init__(self, reader: Any, path: Path):
        self.path, self._reader = path, reader
        self.metadata: dict[str, Any] = {}
        for name, field in reader.fields.items():
            if not name.startswith("GGUF."):  # the header's own counts, not model metadata
                self.metadata[name] = _plain(field.contents())
        self._tensors = {t.name: t for t in reader.tensors}

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
        return self._tensor(name).tensor_type.name.lower()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self._tensor(name).shape))

    def dequantized(self, name: str) -> Tensor:
        """The tensor as float32, whatever its type, in PyTorch's shape."""
        import numpy as np

        tensor = self._tensor(name)
        gguf = _gguf_lib()
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as err:
            raise ValueError(f"{self.path}: tensor {name} is {tensor.tensor_type.name}, which the gguf package "
                             f"cannot dequantize ({err})") from None
        return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(self.shape(name))

    def blocks(self, name: str) -> Tensor:
        """A tensor's raw bytes, (rows, bytes per row) uint8, as the file holds them (for the block formats:
        each row's blocks, one after another)."""
        import numpy as np

        data = np.ascontiguousarray(self._tensor(name).data)
        return torch.from_numpy(data.view(np.uint8).copy()).reshape(self.shape(name)[0], -1)

    def _tensor(self, name: str) -> Any:
        if name not in self._tensors:
            raise KeyError(f"{self.path} has no tensor {name!r}")
        return self._tensors[name]


@functools.lru_cache(maxsize=2)
def _open_file(path: Path, mtime_ns: int, size: int) -> GGUFFile:
    gguf = _gguf_lib()
    try:
        return GGUFFile(gguf.GGUFReader(path), path)
    except (ValueError, IndexError, KeyError, OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not a readable GGUF file ({err}); truncated or corrupt?") from None
