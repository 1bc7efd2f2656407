"""Each process reads only its own rows of the global batch: at 2 and 4 processes (gloo, DDP) a
process reads batch_size windows a step from the token stream, not the global batch, and the
processes' windows, put together in rank order, are exactly the windows one process accumulating
the same global batch reads, step by step (training and validation); the losses are the same."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from glasslm.presets import get_preset
from glasslm.training.config import TrainConfig
from glasslm.training.loop import train
from test_distributed import TINY, data, free_port, join_group

pytestmark = [pytest.mark.slow, pytest.mark.alone]  # processes in lockstep: nothing beside them under xdist

BATCH = 2


class CountingTokens:
    """A token stream (as a memory-mapped token file is read: numpy indexing) that records the
    first position of every window read from it, a list per read."""

    def __init__(self, tokens: torch.Tensor):
        self.array, self.reads = tokens.numpy(), []

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, index: np.ndarray) -> np.ndarray:
        self.reads.append(index[:, 0].tolist())  # index: (windows, context + 1) positions
        return self.array[index]


def cfg(accum: int) -> TrainConfig:
    return TrainConfig(max_steps=3, batch_size=BATCH, grad_accum_steps=accum, warmup_steps=1, eval_interval=3,
                       eval_iters=1, log_interval=1, progress=False, optimizer="adamw")


def run(world_size: int, rank: int = 0, ctx=None) -> dict:
    tokens = data()
    train_tokens, val_tokens = CountingTokens(tokens[:3500]), CountingTokens(tokens[3500:])
    accum = 1 if ctx is not None else world_size  # one process accumulates the same global batch
    result = train(get_preset("shakespeare-char-cpu", **TINY), cfg(accum), train_tokens, val_tokens, dist_ctx=ctx)
    return {"train_reads": train_tokens.reads, "val_reads": val_tokens.reads, "losses": result.train_losses,
            "val": [v for _, v in result.val_losses]}


def _worker(rank: int, world_size: int, port: int, out: str) -> None:
    from glasslm.training.distributed import shutdown_distributed

    ctx = join_group(rank, world_size, port)
    try:
        Path(out, f"rank{rank}.json").write_text(json.dumps(run(world_size, rank, ctx)))
    finally:
        shutdown_distributed()


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_process_reads_only_its_rows_of_the_one_process_windows(tmp_path, world_size):
    torch.set_num_threads(1)
    one = run(world_size)
    mp.spawn(_worker, args=(world_size, free_port(), str(tmp_path)), nprocs=world_size, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]
    for rank in ranks:
        assert [len(read) for read in rank["train_reads"]] == [BATCH] * 3, \
            f"a step reads this process's {BATCH} rows, not the global batch's {BATCH * world_size}"
        assert [len(read) for read in rank["val_reads"]] == [BATCH], "validation too: its share of one global batch"
    assert [len(read) for read in one["train_reads"]] == [BATCH * world_size] * 3
    for step, whole in enumerate(one["train_reads"]):  # rank order puts each step's windows back together
        assert sum((rank["train_reads"][step] for rank in ranks), []) == whole
    assert sum((rank["val_reads"][0] for rank in ranks), []) == sum(one["val_reads"], []), \
        "the one process validates on the same windows, batch_size rows at a time"
    assert ranks[0]["losses"] == pytest.approx(one["losses"], rel=1e-6)
    assert ranks[0]["val"] == pytest.approx(one["val"], rel=1e-6)
