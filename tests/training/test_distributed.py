"""Data parallelism on CPU with gloo: 2 processes with batch B follow the same loss trajectory as
1 process with batch 2B (the same global batch), with DDP and with FSDP2, and resume bit for bit;
`torchrun` drives the CLI and resumes across the same world size."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from glasslm.presets import get_preset
from glasslm.training.loggers import read_metrics
from glasslm.training.config import TrainConfig
from glasslm.training.loop import train

pytestmark = [pytest.mark.slow,  # the long runs: `pytest -m "not slow"` leaves them out
              pytest.mark.alone]  # two processes in lockstep (gloo): under xdist, no other test beside them

SRC = Path(__file__).resolve().parents[2] / "src"
TINY = dict(vocab_size=16, n_layers=2, d_model=32, n_heads=2, context_length=16)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def data() -> torch.Tensor:
    return torch.randint(0, 16, (4000,), generator=torch.Generator().manual_seed(0))


def run_cfg(batch_size: int, **kw) -> TrainConfig:
    return TrainConfig(max_steps=8, batch_size=batch_size, warmup_steps=2, eval_interval=4, eval_iters=2,
                       log_interval=1, progress=False, **kw)


def join_group(rank: int, world_size: int, port: int):
    """In a spawned process: the torchrun variables for `rank`, one thread, the gloo group joined."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from glasslm.training.distributed import init_distributed

    return init_distributed("cpu")


def _worker(rank: int, world_size: int, port: int, out: str, fsdp: bool, checkpointing: bool = False) -> None:
    from glasslm.training.distributed import shutdown_distributed

    ctx = join_group(rank, world_size, port)
    try:
        tokens = data()
        cfg = run_cfg(4, fsdp=fsdp, activation_checkpointing=checkpointing)
        result = train(get_preset("shakespeare-char-cpu", **TINY), cfg, tokens[:3500], tokens[3500:],
                       dist_ctx=ctx, run_dir=Path(out) / "run")
        # Resume (same world size) from the step-4 checkpoint the run above wrote.
        resumed = train(get_preset("shakespeare-char-cpu", **TINY), cfg, tokens[:3500],
                        tokens[3500:], dist_ctx=ctx, run_dir=Path(out) / "resumed",
                        resume=Path(out) / "run" / "ckpt-000004")
        Path(out, f"rank{rank}.json").write_text(json.dumps(
            {"train": result.train_losses, "val": result.val_losses, "resumed": resumed.train_losses,
             "weights": {k: v.sum().item() for k, v in result.model.state_dict().items()} if not fsdp else {}}))
    finally:
        shutdown_distributed()


@pytest.fixture(scope="module")
def single_process() -> dict:
    torch.set_num_threads(1)
    tokens = data()
    result = train(get_preset("shakespeare-char-cpu", **TINY), run_cfg(8), tokens[:3500], tokens[3500:])
    return {"train": result.train_losses, "val": result.val_losses,
            "weights": {k: v.sum().item() for k, v in result.model.state_dict().items()}}


@pytest.mark.parametrize("fsdp,checkpointing", [(False, False), (True, False), (True, True)],
                         ids=["ddp", "fsdp2", "fsdp2-activation-checkpointing"])
def test_two_processes_match_one_process_with_the_same_global_batch(tmp_path, single_process, fsdp, checkpointing):
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path), fsdp, checkpointing), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["train"] == ranks[1]["train"], "every rank reports the all-reduced loss"
    assert ranks[0]["resumed"] == ranks[0]["train"][4:], "resuming continues bit for bit"
    assert ranks[0]["train"] == pytest.approx(single_process["train"], rel=1e-5)
    assert [v for _, v in ranks[0]["val"]] == pytest.approx([v for _, v in single_process["val"]], rel=1e-5)
    if not fsdp:
        assert ranks[0]["weights"] == ranks[1]["weights"], "DDP keeps replicas identical"
        assert ranks[0]["weights"] == pytest.approx(single_process["weights"], rel=1e-4, abs=1e-5)
    # Only rank 0 wrote the run directory, and its checkpoint loads like any other.
    from glasslm.io.checkpoint import load_checkpoint

    model, _, meta = load_checkpoint(tmp_path / "run")
    assert meta["step"] == 8 and model.num_parameters() > 0


def torchrun(args: list[str], nproc: int = 2) -> str:
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", "-m", "glasslm.cli", "train", *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_torchrun_cli_trains_and_resumes(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("all the world's a stage, and all the men and women merely players\n" * 100)
    common = ["--data", str(corpus), "--n-layers", "1", "--d-model", "32", "--n-heads", "2", "--context-length", "16",
              "--eval-interval", "5", "--eval-iters", "2", "--log-interval", "1", "--no-progress",
              "--sample-tokens", "0", "--lr-decay-steps", "20", "--warmup-steps", "2",
              # The default recipe's Muon: in float32, as bf16 would turn the all-reduce's rounding into 1e-4 differences.
              "--muon-ns-dtype", "float32"]
    output = torchrun([*common, "--batch-size", "3", "--max-steps", "10", "--out", str(tmp_path / "ddp")])
    assert output.count("done: val loss") == 1, "only rank 0 prints"
    assert "2 processes" in output
    torchrun(["--resume", str(tmp_path / "ddp"), "--max-steps", "20"])
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "glasslm", "train", *common, "--batch-size", "6", "--max-steps", "20",
                    "--out", str(tmp_path / "one")], env=env, check=True, capture_output=True, timeout=120)
    two = read_metrics(tmp_path / "ddp" / "metrics.jsonl")
    one = read_metrics(tmp_path / "one" / "metrics.jsonl")
    assert [r["step"] for r in two] == [r["step"] for r in one] == list(range(1, 21))
    assert [r["train_loss"] for r in two] == pytest.approx([r["train_loss"] for r in one], rel=1e-5)


def test_fsdp_run_still_prints_its_sample(tmp_path):
    # Under FSDP the trained weights are shards; the sample used to be skipped without a word (issue 12).
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quality of mercy is not strained\n" * 60)
    output = torchrun(["--data", str(corpus), "--n-layers", "1", "--d-model", "32", "--n-heads", "2",
                       "--context-length", "16", "--batch-size", "2", "--max-steps", "2", "--eval-iters", "1",
                       "--no-progress", "--fsdp", "--sample-tokens", "12", "--out", str(tmp_path / "fsdp")])
    assert output.count("--- sample ---") == 1, output
    assert len(output.split("--- sample ---")[1].strip()) > 0
