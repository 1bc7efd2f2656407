"""A distributed checkpoint is loaded per process (glasslm.training.checkpointer.load_shards):
under FSDP2 at 2 and 4 processes each process reads only its shards of the weights and optimizer
state (torch.distributed.checkpoint's load planner), so its peak memory while loading is measured
far below the whole state that every process used to read (read_sharded_tensors), and the sharded
model and optimizer hold exactly the saved tensors."""

from __future__ import annotations

import gc
import json
import math
import os
import threading
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import HuggingFaceStorageReader

from glasslm.io.checkpoint import OPTIMIZER_JSON, optimizer_state_to_files
from glasslm.io.sharded import MODEL_PREFIX, OPTIMIZER_PREFIX, SHARDS_DIR, read_sharded_tensors
from glasslm.presets import get_preset
from glasslm.training.config import TrainConfig
from test_distributed import free_port, join_group

pytestmark = [pytest.mark.slow, pytest.mark.alone]  # 2 and 4 processes in lockstep

# 4.0M parameters: 15.3 MiB of weights + 30.6 MiB of AdamW moments in float32, 45.9 MiB in all;
# large beside the few MiB a process's memory moves by on its own.
CONFIG = dict(vocab_size=256, n_layers=4, d_model=384, n_heads=6, context_length=64)
CFG = TrainConfig(fsdp=True, optimizer="adamw")


def build(seed: int):
    from glasslm.core.model import TransformerLM
    from glasslm.training.optim import make_optimizer

    torch.manual_seed(seed)
    model = TransformerLM(get_preset("shakespeare-char-cpu", **CONFIG))
    return model, make_optimizer


def save_reference(folder: Path) -> dict[str, torch.Tensor]:
    """A trained-looking state (one AdamW step on random gradients) saved as a distributed checkpoint
    of one writer; the whole tensors, by checkpoint name."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, make_optimizer = build(0)
    optimizer = make_optimizer(model, CFG, fused=False)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    tensors, scalars = optimizer_state_to_files(get_optimizer_state_dict(model, optimizer))
    state = {**{MODEL_PREFIX + n: t for n, t in model.state_dict().items()},
             **{OPTIMIZER_PREFIX + n: t for n, t in tensors.items()}}
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(folder / SHARDS_DIR), save_distributed=True),
             no_dist=True)
    (folder / OPTIMIZER_JSON).write_text(json.dumps(scalars))
    return {name: t.clone() for name, t in state.items()}


class PeakAnonymous:
    """The peak of this process's anonymous resident memory (what tensors take; mapped file pages,
    which the safetensors reader maps and the page cache shares between processes, left out) above
    its level at the start, sampled from /proc/self/statm every 0.2 ms while inside the block."""

    def __enter__(self):
        self.peak, self.running = 0, True
        self.start = self.anonymous()
        self.sampler = threading.Thread(target=self._sample)
        self.sampler.start()
        return self

    def __exit__(self, *exc):
        self.running = False
        self.sampler.join()
        self.peak = max(self.peak, self.anonymous() - self.start)

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, self.anonymous() - self.start)
            time.sleep(0.0002)

    @staticmethod
    def anonymous() -> int:
        resident, shared = (int(v) for v in Path("/proc/self/statm").read_text().split()[1:3])
        return (resident - shared) * PAGE


PAGE = os.sysconf("SC_PAGE_SIZE")


def counting_reads(reads: list[int]):
    """HuggingFaceStorageReader.read_data, adding each read's bytes to `reads`."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    original = HuggingFaceStorageReader.read_data

    def read_data(self, plan, planner):
        for item in plan.items:
            meta = self.storage_data[item.storage_index]
            reads.append(math.prod(item.lengths) * meta.dtype.itemsize)
        return original(self, plan, planner)
    return read_data


def _worker(rank: int, world_size: int, port: int, folder: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from glasslm.training.checkpointer import load_shards
    from glasslm.training.distributed import shutdown_distributed
    from glasslm.training.parts import wrap

    ctx = join_group(rank, world_size, port)
    try:
        model, make_optimizer = build(1)  # other weights than the saved ones
        wrap(model, CFG, ctx, "cpu", fsdp=True)
        optimizer = make_optimizer(model, CFG, fused=False)
        gc.collect()
        reads: dict[str, list[int]] = {"per_process": [], "whole": []}
        with mock.patch.object(HuggingFaceStorageReader, "read_data", counting_reads(reads["per_process"])), \
                PeakAnonymous() as per_process:
            load_shards(model, optimizer, Path(folder))
        with mock.patch.object(HuggingFaceStorageReader, "read_data", counting_reads(reads["whole"])), \
                PeakAnonymous() as whole:
            read_sharded_tensors(folder)  # what every process read before
        weights = {MODEL_PREFIX + n: t.full_tensor() for n, t in get_model_state_dict(model).items()}
        moments, _ = optimizer_state_to_files(get_optimizer_state_dict(model, optimizer))
        local = sum(t.to_local().numel() * t.element_size() for t in [*get_model_state_dict(model).values(),
                                                                       *moments.values()] if hasattr(t, "to_local"))
        full = {**weights, **{OPTIMIZER_PREFIX + n: t.full_tensor() if hasattr(t, "full_tensor") else t
                              for n, t in moments.items()}}
        if rank == 0:
            save_file({n: t.contiguous() for n, t in full.items()}, str(Path(folder) / "loaded.safetensors"))
        Path(folder, f"rank{rank}.json").write_text(json.dumps(
            {"per_process": per_process.peak, "whole": whole.peak, "local": local,
             "read": sum(reads["per_process"]), "read_whole": sum(reads["whole"])}))
    finally:
        shutdown_distributed()


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_process_loads_only_its_shards(tmp_path, world_size, monkeypatch):
    reference = save_reference(tmp_path)
    state_bytes = sum(t.numel() * t.element_size() for t in reference.values())
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # a freed tensor leaves resident memory at once
    mp.spawn(_worker, args=(world_size, free_port(), str(tmp_path)), nprocs=world_size, join=True)
    loaded = load_file(str(tmp_path / "loaded.safetensors"))
    assert loaded.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(loaded[name], tensor), name
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]
    print(f"{world_size} processes, state {state_bytes / 2**20:.1f} MiB: per-process load peaks "
          f"{[round(r['per_process'] / 2**20, 1) for r in ranks]} MiB, whole reads "
          f"{[round(r['whole'] / 2**20, 1) for r in ranks]} MiB")
    small = [t.numel() * t.element_size() for n, t in reference.items() if t.dim() == 0]  # AdamW's step counts
    for rank in ranks:
        assert rank["read_whole"] == state_bytes, "the whole read reads everything"
        # Only the process's own shards (every process reads the scalar step counts whole).
        assert rank["read"] == rank["local"] + sum(small)
        assert rank["local"] <= state_bytes / world_size + 2**20
        assert rank["whole"] > 0.9 * state_bytes
        # Its shard of the moments and, while torch's get_optimizer_state_dict makes them, of zero
        # gradients (a third of the state), plus a few MiB of reading: 32 MiB at 2, 17 at 4 here.
        assert rank["per_process"] < 4 / 3 * state_bytes / world_size + 4 * 2**20
        assert rank["per_process"] < 0.8 * rank["whole"]
