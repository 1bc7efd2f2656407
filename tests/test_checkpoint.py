"""Checkpoints: exact resume (in process and after SIGKILL/SIGTERM of a real `glasslm train`),
pointer files and pruning, and clear refusals of corrupt or foreign files."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from glasslm.checkpoint import (
    load_checkpoint, load_optimizer_state, optimizer_state_from_files, optimizer_state_to_files,
    prune_checkpoints, resolve_checkpoint, write_pointer,
)
from glasslm.config import get_preset
from glasslm.loggers import read_metrics
from glasslm.tokenizers import CharTokenizer
from glasslm.train import TrainConfig, train

SRC = Path(__file__).resolve().parents[1] / "src"
TINY = dict(vocab_size=16, n_layers=1, d_model=32, n_heads=2, context_length=16)


def tiny_tokens(n: int = 4000) -> torch.Tensor:
    return torch.randint(0, 16, (n,), generator=torch.Generator().manual_seed(0))


def tiny_cfg(**kw) -> TrainConfig:
    base = dict(max_steps=24, lr_decay_steps=24, batch_size=4, warmup_steps=4, eval_interval=8, eval_iters=2, log_interval=1,
                progress=False)
    base.update(kw)
    return TrainConfig(**base)


def test_optimizer_state_round_trip_is_exact():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), betas=(0.9, 0.95), fused=True)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    tensors, scalars = optimizer_state_to_files(opt.state_dict())
    back = optimizer_state_from_files(tensors, scalars)
    fresh = torch.optim.AdamW(model.parameters(), fused=True)
    fresh.load_state_dict(back)
    assert fresh.param_groups[0]["betas"] == (0.9, 0.95)
    for a, b in zip(opt.state.values(), fresh.state.values()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a[key], b[key])


def test_resume_in_process_continues_bit_for_bit(tmp_path):
    tokens = tiny_tokens()
    model_cfg = get_preset("shakespeare-char-cpu", **TINY, dropout=0.1)  # dropout exercises the torch RNG
    full = train(model_cfg, tiny_cfg(), tokens[:3500], tokens[3500:], run_dir=tmp_path / "full")
    first = train(model_cfg, tiny_cfg(max_steps=10), tokens[:3500], tokens[3500:], run_dir=tmp_path / "part")
    assert first.step == 10
    # Same schedule as the full run: lr_decay_steps pins the cosine to 24 steps in both halves.
    second = train(model_cfg, tiny_cfg(), tokens[:3500], tokens[3500:], run_dir=tmp_path / "part",
                   resume=tmp_path / "part")
    assert first.train_losses + second.train_losses == full.train_losses
    assert second.val_losses == [v for v in full.val_losses if v[0] > 10]
    a, b = read_metrics(tmp_path / "full/metrics.jsonl"), read_metrics(tmp_path / "part/metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 25))
    assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]


def test_pointers_keep_last_and_best(tmp_path):
    tokens = tiny_tokens()
    cfg = tiny_cfg(max_steps=20, eval_interval=5, checkpoint_interval=2, keep_last=2)
    result = train(get_preset("shakespeare-char-cpu", **TINY), cfg, tokens[:3500], tokens[3500:], run_dir=tmp_path)
    best_step = min(result.val_losses, key=lambda v: v[1])[0]
    kept = sorted(p.name for p in tmp_path.glob("ckpt-*"))
    assert kept[-2:] == ["ckpt-000018", "ckpt-000020"]
    assert f"ckpt-{best_step:06d}" in kept and len(kept) <= 3
    assert (tmp_path / "latest").read_text().strip() == "ckpt-000020"
    assert resolve_checkpoint(tmp_path, prefer=("best",)).name == f"ckpt-{best_step:06d}"
    model, tokenizer, meta = load_checkpoint(tmp_path / "latest")
    assert meta["step"] == 20 and tokenizer is None
    assert load_optimizer_state(tmp_path / "ckpt-000020")["param_groups"][0]["betas"] == (0.9, 0.99)
    # A pointer is replaced atomically and never names a missing directory silently.
    write_pointer(tmp_path, "latest", "ckpt-999999")
    with pytest.raises(FileNotFoundError, match="ckpt-999999"):
        resolve_checkpoint(tmp_path, prefer=("latest",))
    assert prune_checkpoints(tmp_path, keep_last=0) == []


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("run")
    tokens = tiny_tokens()
    train(get_preset("shakespeare-char-cpu", **TINY), tiny_cfg(max_steps=4, eval_interval=0), tokens[:3500],
          tokens[3500:], run_dir=run, tokenizer=CharTokenizer.from_text("abcdefghijklmnop"))
    return resolve_checkpoint(run, prefer=("latest",))


@pytest.mark.parametrize("damage", ["truncate", "garbage", "pickle", "torch_save"])
@pytest.mark.parametrize("filename", ["model.safetensors", "optimizer.safetensors"])
def test_corrupt_or_foreign_files_are_refused_by_name(saved_checkpoint, tmp_path, damage, filename):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_checkpoint, ckpt)
    path = ckpt / filename
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "garbage":
        path.write_bytes(os.urandom(1000))
    elif damage == "pickle":
        path.write_bytes(pickle.dumps({"weight": [1.0, 2.0]}))
    else:
        torch.save({"weight": torch.ones(2)}, path)
    with pytest.raises(ValueError, match=filename) as err:
        load_checkpoint(ckpt) if filename == "model.safetensors" else load_optimizer_state(ckpt)
    if damage in ("pickle", "torch_save"):
        assert "never unpickles" in str(err.value)


def test_damaged_json_and_missing_files_are_named(saved_checkpoint, tmp_path):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_checkpoint, ckpt)
    (ckpt / "trainer_state.json").write_text('{"step": 4, "best_')
    tokens = tiny_tokens()
    with pytest.raises(ValueError, match="trainer_state.json"):
        train(get_preset("shakespeare-char-cpu", **TINY), tiny_cfg(max_steps=6), tokens[:3500], resume=ckpt)
    (ckpt / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(ckpt)


# ----- real processes: `glasslm train` killed and resumed -----

CLI_ARGS = ["--n-layers", "1", "--d-model", "32", "--n-heads", "2", "--context-length", "16", "--batch-size", "4",
            "--max-steps", "400", "--warmup-steps", "10", "--eval-interval", "100", "--eval-iters", "2",
            "--log-interval", "1", "--checkpoint-interval", "20", "--keep-last", "0", "--progress", "false",
            "--sample-tokens", "0", "--dropout", "0.1"]


def run_cli(args: list[str], **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "glasslm.cli", "train", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "\n"]
    g = torch.Generator().manual_seed(0)
    path.write_text(" ".join(words[i] for i in torch.randint(0, len(words), (6000,), generator=g).tolist()))
    return path


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("full")
    proc = run_cli([*CLI_ARGS, "--data", str(corpus), "--out", str(out)])
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    return read_metrics(out / "metrics.jsonl")


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"run ended before {path} appeared: {proc.communicate()[0]}"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.005)


def comparable(records: list[dict]) -> list[tuple]:
    return [(r["step"], r.get("train_loss"), r.get("val_loss"), r.get("lr"), r.get("grad_norm")) for r in records]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_run_resumes_with_identical_losses(corpus, uninterrupted, tmp_path, sig):
    out = tmp_path / "run"
    proc = run_cli([*CLI_ARGS, "--data", str(corpus), "--out", str(out)])
    wait_for(out / "ckpt-000040", proc)
    proc.send_signal(sig)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == (-signal.SIGKILL if sig == signal.SIGKILL else 128 + signal.SIGTERM), output
    stopped_at = int((out / "latest").read_text().strip().split("-")[1])
    # SIGKILL may land after ckpt-000040 is renamed into place but before `latest` names it:
    # then `latest` still names ckpt-000020, which is just as consistent a place to resume from.
    assert 20 <= stopped_at < 400, "the run should be stopped midway"
    if sig == signal.SIGTERM:
        assert "interrupted after step" in output and f"ckpt-{stopped_at:06d}" in output
        # SIGTERM checkpoints the step it stopped at (not just the last periodic one).
        assert read_metrics(out / "metrics.jsonl")[-1]["step"] == stopped_at
    resumed = run_cli(["--resume", str(out)])
    output, _ = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, output
    assert comparable(read_metrics(out / "metrics.jsonl")) == comparable(uninterrupted)
