"""Tensors of an HF model directory, read lazily: one safetensors file, sharded safetensors with an
index, or `pytorch_model.bin` (one file or sharded), without unpickling code.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> from safetensors.torch import save_file
    >>> directory = Path(tempfile.mkdtemp())
    >>> save_file({"wte.weight": torch.ones(2, 3)}, str(directory / SAFETENSORS_FILE))
    >>> source = TensorSource.from_directory(directory)
    >>> sorted(source.names()), source.get("wte.weight").shape
    (['wte.weight'], torch.Size([2, 3]))
"""

from __future__ import annotations

import json
import os
import pickle
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import Tensor

from glasslm.hf.files import SAFETENSORS_FILE, SAFETENSORS_INDEX, TORCH_BIN_FILE, TORCH_BIN_INDEX


class TensorSource:
    """Names and lazily-read tensors of a checkpoint, from one or many files.

    Safetensors files are opened with `safe_open` (memory-mapped): a tensor is read only when
    asked for. `.bin` files are loaded with `torch.load(weights_only=True, mmap=True)`.
    """

    def __init__(self, readers: dict[str, Callable[[], Tensor]], source: str):
        self._readers, self.source = readers, source

    def names(self) -> set[str]:
        return set(self._readers)

    def get(self, name: str) -> Tensor:
        return self._readers[name]()

    @classmethod
    def from_directory(cls, directory: str | os.PathLike) -> "TensorSource":
        path = Path(directory)
        if (path / SAFETENSORS_FILE).is_file():
            return cls.from_safetensors([path / SAFETENSORS_FILE], str(path / SAFETENSORS_FILE))
        if (path / SAFETENSORS_INDEX).is_file():
            return cls.from_safetensors(_shard_files(path, SAFETENSORS_INDEX), str(path / SAFETENSORS_INDEX))
        if (path / TORCH_BIN_FILE).is_file():
            return cls.from_torch_bin([path / TORCH_BIN_FILE], str(path / TORCH_BIN_FILE))
        if (path / TORCH_BIN_INDEX).is_file():
            return cls.from_torch_bin(_shard_files(path, TORCH_BIN_INDEX), str(path / TORCH_BIN_INDEX))
        raise FileNotFoundError(
            f"no weights in {path}: expected {SAFETENSORS_FILE}, {SAFETENSORS_INDEX} or {TORCH_BIN_FILE}"
        )

    @classmethod
    def from_safetensors(cls, files: Iterable[Path], source: str) -> "TensorSource":
        from safetensors import safe_open

        readers: dict[str, Callable[[], Tensor]] = {}
        for file in files:
            try:
                handle = safe_open(str(file), framework="pt", device="cpu")
            except Exception as err:  # SafetensorError and friends: name the file, no traceback
                raise ValueError(f"{file} is not a readable safetensors file ({err}); truncated or corrupt?") from None
            for name in handle.keys():
                readers[name] = lambda handle=handle, name=name: handle.get_tensor(name)
        return cls(readers, source)

    @classmethod
    def from_torch_bin(cls, files: Iterable[Path], source: str) -> "TensorSource":
        readers: dict[str, Callable[[], Tensor]] = {}
        for file in files:
            with open(file, "rb") as f:
                if f.read(1) == b"\x80":  # a bare pickle stream, not torch.save's zip archive
                    raise ValueError(f"refusing to load pickled code from {file}: a bare pickle, not a "
                                     "torch.save archive; convert it to safetensors with a tool you trust")
            try:
                # weights_only: the restricted unpickler, which refuses any code a file names.
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except pickle.UnpicklingError as err:
                named = re.search(r"Unsupported global: GLOBAL [\w.]+", str(err))
                reason = named.group(0) if named else "it names code to run"
                raise ValueError(f"refusing to load pickled code from {file}: it holds more than tensors "
                                 f"({reason}); convert it to safetensors with a tool you trust") from None
            except (RuntimeError, OSError, EOFError, ValueError) as err:
                raise ValueError(f"{file} is not a readable PyTorch weights file ({' '.join(str(err).split())}); "
                                 "truncated or corrupt?") from None
            if not isinstance(state, dict) or not all(isinstance(t, Tensor) for t in state.values()):
                raise ValueError(f"{file} does not hold a state dict of tensors")
            for name, tensor in state.items():
                readers[name] = lambda tensor=tensor: tensor
        return cls(readers, source)


def _shard_files(directory: Path, index_name: str) -> list[Path]:
    index = json.loads((directory / index_name).read_text())
    files = sorted(set(index["weight_map"].values()))
    missing = [f for f in files if not (directory / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{directory / index_name} lists shards that do not exist: {missing}")
    return [directory / f for f in files]
