"""Distributed checkpoints: the tensors a `torchrun` run wrote one shard per process, read back whole.

A checkpoint of a run under torchrun (glasslm.training.checkpointer) keeps its weights and
optimizer state in `distributed/`, written by `torch.distributed.checkpoint` (DCP) with its
safetensors storage: every process writes the part of each tensor it holds (an FSDP2 shard; under
DDP, where every process holds everything, DCP spreads the tensors over the processes), and each
file's safetensors header says which part of which tensor it holds. Nothing there is pickled (DCP's
default format keeps a pickled `.metadata` file, which glasslm never reads).

Reading here assembles whole tensors from the shards in one process, whatever the number of
processes that wrote them: so `glasslm generate/eval/...` load such a checkpoint like any other, and
one process resumes a distributed run. A run of several processes resumes with
glasslm.training.checkpointer.load_shards instead: each process reads only the parts it holds.

Names: the model's weights as `model.<name>`, the optimizer's state as `optimizer.state.<name>.<key>`
(parameters named as in the model's state dict; the param groups are in optimizer.json).

Example (a state written by one process and read back whole):
    >>> import tempfile, torch
    >>> import torch.distributed.checkpoint as dcp
    >>> from torch.distributed.checkpoint import HuggingFaceStorageWriter
    >>> folder = Path(tempfile.mkdtemp())
    >>> _ = dcp.save({"model.w": torch.arange(6.0).reshape(2, 3)}, no_dist=True,
    ...          storage_writer=HuggingFaceStorageWriter(str(folder / SHARDS_DIR), save_distributed=True))
    >>> is_sharded_checkpoint(folder), read_sharded_tensors(folder)["model.w"].tolist()
    (True, [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

SHARDS_DIR = "distributed"  # in a checkpoint directory: DCP's safetensors shards
MODEL_PREFIX = "model."
OPTIMIZER_PREFIX = "optimizer."


def is_sharded_checkpoint(directory: str | os.PathLike) -> bool:
    """Whether `directory` keeps its tensors as a distributed checkpoint's shards."""
    return (Path(directory) / SHARDS_DIR).is_dir()


def read_sharded_tensors(directory: str | os.PathLike, prefix: str = "",
                         device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor under `directory`/distributed whose name starts with `prefix`, whole (the prefix
    kept). Runs in this process alone, also inside a process group. A shard that is missing or
    unreadable is named in the error."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    shards = Path(directory) / SHARDS_DIR
    if not any(shards.glob("*.safetensors")):
        raise FileNotFoundError(f"{shards} holds no safetensors shards: incomplete checkpoint?")
    reader = HuggingFaceStorageReader(str(shards))
    try:
        metadata = reader.read_metadata()
    except Exception as err:  # the reader raises whatever safetensors or json raised
        raise ValueError(f"{shards} is not a readable distributed checkpoint ({err}); truncated or corrupt?") from None
    tensors = {name: torch.empty(meta.size, dtype=meta.properties.dtype)
               for name, meta in metadata.state_dict_metadata.items()
               if name.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
    _check_complete(shards, metadata, tensors)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(shards)), no_dist=True)
    return {name: t.to(device) for name, t in tensors.items()}


def _check_complete(shards: Path, metadata, tensors: dict[str, torch.Tensor]) -> None:
    """Refuse a tensor whose shards do not cover it (a shard file of the checkpoint is missing)."""
    for name, tensor in tensors.items():
        covered = sum(chunk.sizes.numel() for chunk in metadata.state_dict_metadata[name].chunks)
        if covered < tensor.numel():
            raise ValueError(f"{shards}: the shards hold {covered} of the {tensor.numel()} values of {name!r}; "
                             "a shard file is missing (incomplete checkpoint?)")


def strip_prefix(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """`tensors` whose names start with `prefix`, the prefix removed.

    >>> strip_prefix({"model.a": 1, "optimizer.b": 2}, "model.")
    {'a': 1}
    """
    return {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)}
