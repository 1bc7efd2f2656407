"""Checkpoints: exact resume (in process and after SIGKILL/SIGTERM of a real `glasslm train`),
pointer files and pruning, and clear refusals of corrupt or foreign files."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from glasslm.cli import main
from glasslm.core.model import TransformerLM
from glasslm.io.checkpoint import (
    checkpoint_name, load_checkpoint, load_optimizer_state, optimizer_state_from_files, optimizer_state_to_files,
    prune_checkpoints, remove_stale_staging, resolve_checkpoint, save_checkpoint, write_pointer,
)
from glasslm.presets import get_preset
from glasslm.training.loggers import read_metrics
from glasslm.tokenizers import CharTokenizer
from glasslm.training.config import TrainConfig
from glasslm.training.loop import train

SRC = Path(__file__).resolve().parents[2] / "src"
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


@pytest.mark.parametrize("optimizer,impl", [("adamw", "fast"), ("muon", "fast"), ("muon", "readable")])
def test_resume_in_process_continues_bit_for_bit(tmp_path, optimizer, impl):
    tokens = tiny_tokens()
    # dropout exercises the torch RNG
    model_cfg = get_preset("shakespeare-char-cpu", **TINY, dropout=0.1, impl=impl)
    full = train(model_cfg, tiny_cfg(optimizer=optimizer), tokens[:3500], tokens[3500:], run_dir=tmp_path / "full")
    first = train(model_cfg, tiny_cfg(max_steps=10, optimizer=optimizer), tokens[:3500], tokens[3500:],
                  run_dir=tmp_path / "part")
    assert first.step == 10
    # Same schedule as the full run: lr_decay_steps pins the cosine to 24 steps in both halves.
    second = train(model_cfg, tiny_cfg(optimizer=optimizer), tokens[:3500], tokens[3500:], run_dir=tmp_path / "part",
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
    (ckpt / "glasslm_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="glasslm_config.json"):
        load_checkpoint(ckpt)


# ----- real processes: `glasslm train` killed and resumed -----

# Log and checkpoint intervals that do not align (issue 12): a checkpoint cuts a metrics window in
# two, and the resumed run must still log the same averaged losses as the uninterrupted one.
CLI_ARGS = ["--n-layers", "1", "--d-model", "32", "--n-heads", "2", "--context-length", "16", "--batch-size", "4",
            "--max-steps", "400", "--warmup-steps", "10", "--eval-interval", "100", "--eval-iters", "2",
            "--log-interval", "10", "--checkpoint-interval", "7", "--keep-last", "0", "--no-progress",
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


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_run_resumes_with_identical_losses(corpus, uninterrupted, tmp_path, sig):
    out = tmp_path / "run"
    proc = run_cli([*CLI_ARGS, "--data", str(corpus), "--out", str(out)])
    wait_for(out / "ckpt-000042", proc)
    proc.send_signal(sig)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == (-signal.SIGKILL if sig == signal.SIGKILL else 128 + signal.SIGTERM), output
    stopped_at = int((out / "latest").read_text().strip().split("-")[1])
    # SIGKILL may land after ckpt-000042 is renamed into place but before `latest` names it:
    # then `latest` still names ckpt-000035, which is just as consistent a place to resume from.
    assert 35 <= stopped_at < 400, "the run should be stopped midway"
    if sig == signal.SIGTERM:
        assert "interrupted after step" in output and f"ckpt-{stopped_at:06d}" in output
        # SIGTERM checkpoints the step it stopped at (not just the last periodic one).
        assert (out / f"ckpt-{stopped_at:06d}").is_dir()
    resumed = run_cli(["--resume", str(out)])
    output, _ = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, output
    assert comparable(read_metrics(out / "metrics.jsonl")) == comparable(uninterrupted)


# ----- a second Ctrl-C while saving, a full disk (issue 12) -----

# Runs `glasslm train` in a real process whose safetensors writer is slowed (FAULT=slow:SECONDS) or
# fails with ENOSPC from its Nth call on (FAULT=enospc:N), to hit the moments a test needs.
FAULTY_CLI = """
import errno, os, sys, time
import glasslm.io.checkpoint as checkpoint
kind, arg = os.environ["FAULT"].split(":")
real, calls = checkpoint.save_file, [0]
def faulty(*args, **kwargs):
    calls[0] += 1
    if kind == "slow":
        time.sleep(float(arg))
    elif calls[0] >= int(arg):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real(*args, **kwargs)
checkpoint.save_file = faulty
from glasslm.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_faulty_cli(args: list[str], fault: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "FAULT": fault}
    return subprocess.Popen([sys.executable, "-c", FAULTY_CLI, "train", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_second_ctrl_c_while_saving_waits_for_a_complete_checkpoint(corpus, tmp_path):
    out = tmp_path / "run"
    args = [*CLI_ARGS, "--checkpoint-interval", "0", "--eval-interval", "0", "--max-steps", "100000", "--log-interval",
            "1", "--data", str(corpus), "--out", str(out)]
    proc = run_faulty_cli(args, "slow:0.5")  # each of the 3 safetensors files of a checkpoint takes 0.5 s
    wait_for(out / "metrics.jsonl", proc)
    while not (out / "metrics.jsonl").stat().st_size:  # a step is done: the loop's signal handler is in place
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 60
    while not list(out.glob(".ckpt-*.tmp-*")):  # the checkpoint of the stop step is being staged
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert "stopping as soon as it is complete" in stderr
    latest = resolve_checkpoint(out, prefer=("latest",))
    model, _, meta = load_checkpoint(latest)
    assert f"saved {latest}" in stdout and proc.returncode in (130, 128 + signal.SIGINT)
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name or ".old" in p.name]


def test_replacing_a_checkpoint_never_leaves_the_name_empty(tmp_path, monkeypatch):
    from glasslm.io.checkpoint import save_checkpoint

    model = TransformerLM_tiny()
    target = save_checkpoint(tmp_path / "ckpt-000010", model, meta={"version": 1})
    real_replace, calls = os.replace, []

    def interrupted(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # the old copy is moved aside; a Ctrl-C lands before the new one moves in
            raise KeyboardInterrupt
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(target, model, meta={"version": 2})
    monkeypatch.undo()
    assert load_checkpoint(target)[2] == {"version": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000010"]


def TransformerLM_tiny():
    from glasslm.core.model import TransformerLM

    return TransformerLM(get_preset("shakespeare-char-cpu", **TINY))


@pytest.mark.parametrize("error", ["oserror", "safetensors"])
def test_full_disk_names_the_surviving_checkpoint_and_leaves_nothing_behind(tmp_path, monkeypatch, error):
    import errno

    import glasslm.io.checkpoint as checkpoint
    from safetensors import SafetensorError

    real, calls = checkpoint.save_file, []

    def full_disk(*args, **kwargs):
        calls.append(1)
        if len(calls) > 3:  # the first checkpoint (3 safetensors files) fits, the next does not
            raise (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) if error == "oserror"
                   else SafetensorError("Error while serializing: No space left on device (os error 28)"))
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_file", full_disk)
    tokens = tiny_tokens()
    with pytest.raises(RuntimeError, match=r"could not write .*ckpt-000010: No space left on device.*"
                                           r"previous checkpoint .*ckpt-000005 is intact") as err:
        train(get_preset("shakespeare-char-cpu", **TINY), tiny_cfg(max_steps=12, eval_interval=0, checkpoint_interval=5),
              tokens, run_dir=tmp_path)
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "ckpt-000005", "latest", "metrics.jsonl"]
    assert resolve_checkpoint(tmp_path, prefer=("latest",)).name == "ckpt-000005"


@pytest.fixture
def small_disk(tmp_path):
    """A real 600 KB tmpfs: room for one checkpoint of the CLI_ARGS model (~350 KB), not two."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI and these machines run as root)")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"this machine does not allow mounting a tmpfs: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.slow
def test_a_really_full_disk_stops_training_with_one_line_and_keeps_the_last_checkpoint(corpus, small_disk):
    out = small_disk / "run"
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "glasslm.cli", "train", *CLI_ARGS, "--max-steps", "40",
                           "--eval-interval", "0", "--log-interval", "7", "--data", str(corpus), "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=120)
    stdout, stderr = proc.stdout, proc.stderr
    assert proc.returncode == 1, stdout + stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith(f"glasslm train: error: could not write {out / 'ckpt-0000'}")
    assert "No space left on device; the previous checkpoint" in lines[0]
    kept = lines[0].split("the previous checkpoint ")[1].split(" is intact")[0]
    assert resolve_checkpoint(out, prefer=("latest",)) == Path(kept)
    load_checkpoint(kept)  # that checkpoint loads: a complete one
    assert json.loads((Path(kept) / "trainer_state.json").read_text())["step"] > 0
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name]


@pytest.mark.slow
def test_prepare_onto_a_really_full_disk_is_one_line_and_leaves_nothing(small_disk, tmp_path):
    big = tmp_path / "big.txt"
    big.write_text("the quick brown fox jumps over the lazy dog\n" * 40_000)  # ~3.5 MB of uint16 tokens
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "glasslm.cli", "prepare", str(big), "--out", str(small_disk / "data"),
                           "--quiet"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert "no space left" in done.stderr.lower() and "removed the partial dataset" in done.stderr
    assert list(small_disk.iterdir()) == []


@pytest.mark.slow
def test_full_disk_in_the_command_line_is_one_line(corpus, tmp_path):
    out = tmp_path / "run"
    args = [*CLI_ARGS, "--max-steps", "20", "--eval-interval", "0", "--data", str(corpus), "--out", str(out)]
    proc = run_faulty_cli(args, "enospc:4")  # ckpt-000007 is written, ckpt-000014 finds the disk full
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stdout + stderr
    assert stderr.strip() == (f"glasslm train: error: could not write {out / 'ckpt-000014'}: No space left on device; "
                              f"the previous checkpoint {out / 'ckpt-000007'} is intact and `latest` still names it")
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name]


def test_remove_stale_staging_removes_only_what_a_killed_writer_left(tmp_path):
    model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=3))
    kept = save_checkpoint(tmp_path / checkpoint_name(3), model)
    write_pointer(tmp_path, "latest", kept.name)
    for leftover in (".ckpt-000005.tmp-x1y2", ".ckpt-000004.old-77"):  # a staging and a replaced checkpoint
        (tmp_path / leftover).mkdir()
    for leftover in (".latest.tmp-12", ".best.tmp-9", "notes.tmp-1"):  # pointer files being written; a user file
        (tmp_path / leftover).write_text("x")
    remove_stale_staging(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000003", "latest", "notes.tmp-1"]


# ----- the first Ctrl-C inside a long step, at two threads (issue 26) -----

# `glasslm train` whose forward pass sleeps 1 s per micro-batch once ckpt-000002 exists: step 3 of
# 20 micro-batches then takes over 20 s, so a Ctrl-C surely lands inside it. No OMP_NUM_THREADS, and
# --threads 2, recorded in the run and kept by the resume (the default count follows the machine's
# load, which may change between the three processes).
SLOW_STEP_CLI = """
import os, sys, time
from pathlib import Path
import glasslm.core.model as model_module
slow_after = Path(os.environ["SLOW_AFTER"])
real = model_module.TransformerLM.forward
def forward(self, *args, **kwargs):
    if self.training and slow_after.exists():
        time.sleep(1.0)
    return real(self, *args, **kwargs)
model_module.TransformerLM.forward = forward
from glasslm.cli import main
sys.exit(main(sys.argv[1:]))
"""
LONG_STEP_ARGS = ["--n-layers", "1", "--d-model", "32", "--n-heads", "2", "--context-length", "16", "--batch-size",
                  "1", "--grad-accum-steps", "20", "--max-steps", "4", "--warmup-steps", "2", "--eval-interval",
                  "4", "--eval-iters", "2", "--log-interval", "1", "--checkpoint-interval", "2", "--no-progress",
                  "--sample-tokens", "0", "--dropout", "0.1", "--threads", "2"]


@pytest.mark.slow
def test_first_ctrl_c_stops_inside_a_long_step_and_resumes_identically(corpus, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {"PYTHONPATH": str(SRC)}
    def train_cli(args, slow_after=tmp_path / "never"):
        return subprocess.Popen([sys.executable, "-c", SLOW_STEP_CLI, "train", *args],
                                env=env | {"SLOW_AFTER": str(slow_after)}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    full = train_cli([*LONG_STEP_ARGS, "--data", str(corpus), "--out", str(tmp_path / "full")])
    output, _ = full.communicate(timeout=300)
    assert full.returncode == 0, output

    out = tmp_path / "run"
    proc = train_cli([*LONG_STEP_ARGS, "--data", str(corpus), "--out", str(out)], slow_after=out / "ckpt-000002")
    wait_for(out / "ckpt-000002", proc, timeout=300)
    time.sleep(1.5)  # inside step 3 (over 20 s long)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    stopped_within = time.monotonic() - signalled
    assert proc.returncode == 128 + signal.SIGINT, output
    assert "interrupted after step 2" in output  # not after step 3: stopped inside it
    # One micro-batch (1 s) plus saving a checkpoint, not the rest of a 20 s step (slack for loaded machines).
    assert stopped_within < 10.0, f"took {stopped_within:.1f} s to stop; step 3 alone takes over 20 s"
    assert (out / "latest").read_text().strip() == "ckpt-000002"
    resumed = train_cli(["--resume", str(out)])
    output, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, output
    assert comparable(read_metrics(out / "metrics.jsonl")) == comparable(read_metrics(tmp_path / "full" / "metrics.jsonl"))


# ----- killed after a checkpoint's rename, before its pointers (issue 36, item 9) -----

# Runs `glasslm train` in a real process that SIGKILLs itself the moment ckpt-<KILL_AT_STEP> has been
# renamed into place, before `best` or `latest` is written: the one instant where the run directory
# holds a complete checkpoint that no pointer names (for the first checkpoint: no pointer at all).
KILLED_AFTER_RENAME_CLI = """
import os, signal, sys
import glasslm.training.checkpointer as checkpointer
kill_at, real = f"ckpt-{int(os.environ['KILL_AT_STEP']):06d}", checkpointer.save_checkpoint
def save_then_die(target, *args, **kwargs):
    written = real(target, *args, **kwargs)
    if os.path.basename(target) == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    return written
checkpointer.save_checkpoint = save_then_die
from glasslm.cli import main
sys.exit(main(sys.argv[1:]))
"""
RENAME_ARGS = ["--n-layers", "1", "--d-model", "32", "--n-heads", "2", "--context-length", "16", "--batch-size", "4",
               "--max-steps", "9", "--warmup-steps", "2", "--eval-interval", "3", "--eval-iters", "2",
               "--log-interval", "2", "--checkpoint-interval", "3", "--keep-last", "0", "--no-progress",
               "--sample-tokens", "0", "--dropout", "0.1"]


def train_killed_after_rename(args: list[str], step: int | None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "KILL_AT_STEP": str(step or -1)}
    return subprocess.run([sys.executable, "-c", KILLED_AFTER_RENAME_CLI, "train", *args], env=env,
                          capture_output=True, text=True, timeout=300)


def _advised_command(message: str) -> list[str]:
    """The `glasslm train ...` options an error tells the user to run, as they would type them."""
    advice = re.search(r"--resume (\S+?)[,;]? ", message)
    assert advice, message
    return ["--resume", advice.group(1)]


@pytest.mark.slow  # six short training processes
def test_a_run_killed_between_a_checkpoint_and_its_pointers_resumes_from_every_checkpoint(corpus, tmp_path, capsys):
    # Issue 36: killed after the first checkpoint's rename, the run was stuck: the same command, the
    # --resume DIR it advised and --resume DIR/ckpt-... were each refused.
    full = train_killed_after_rename([*RENAME_ARGS, "--data", str(corpus), "--out", str(tmp_path / "full")], None)
    assert full.returncode == 0, full.stderr
    out, first = tmp_path / "run", [*RENAME_ARGS, "--data", str(corpus), "--out", str(tmp_path / "run")]
    killed = train_killed_after_rename(first, 3)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (out / "ckpt-000003").is_dir() and not (out / "latest").exists() and not (out / "best").exists()
    shutil.copytree(out, tmp_path / "copy", ignore=shutil.ignore_patterns(".lock"))

    assert main(["train", *first]) == 1  # the same command: refused, naming what to do
    refusal = capsys.readouterr().err
    assert "not empty" in refusal
    assert sorted(p.name for p in out.iterdir()) == sorted([".lock", *(p.name for p in (tmp_path / "copy").iterdir())])
    advised = _advised_command(refusal)
    assert advised == ["--resume", str(out)]
    for step in (6, 9):  # the advice, followed; then killed at the same moment of each later checkpoint
        resumed = train_killed_after_rename(advised, step)
        assert resumed.returncode == -signal.SIGKILL, resumed.stderr
        assert ("resuming from ckpt-000003 and writing the pointer again" in resumed.stdout) == (step == 6)
    finished = train_killed_after_rename(advised, None)
    assert finished.returncode == 0 and "writing the pointer again" not in finished.stdout, finished.stderr
    assert comparable(read_metrics(out / "metrics.jsonl")) == comparable(read_metrics(tmp_path / "full" / "metrics.jsonl"))
    for pointer in ("latest", "best"):
        assert (out / pointer).read_text() == (tmp_path / "full" / pointer).read_text(), pointer

    # Resuming the stuck run by its checkpoint's own directory continues there too.
    by_name = train_killed_after_rename(["--resume", str(tmp_path / "copy" / "ckpt-000003")], None)
    assert by_name.returncode == 0, by_name.stderr
    copy = tmp_path / "copy"
    assert comparable(read_metrics(copy / "metrics.jsonl")) == comparable(read_metrics(tmp_path / "full" / "metrics.jsonl"))
    assert (copy / "latest").read_text() == (tmp_path / "full" / "latest").read_text()


def test_saving_the_same_model_again_writes_the_same_bytes(tmp_path):
    # safetensors wrote model.safetensors' metadata keys in an order that varied from save to save
    # (a Rust HashMap), so two saves of one model differed and hashes of bases and caches broke (issue 43).
    model = TransformerLM(get_preset("shakespeare-char-cpu", **TINY))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # trained-looking values, not the init
    tokenizer = CharTokenizer.from_text("abcdefghijklmnop")
    saves = [save_checkpoint(tmp_path / f"save{i}", model, tokenizer, {"step": 3}) for i in range(8)]
    files = {p.name for p in saves[0].iterdir()}
    assert "model.safetensors" in files
    for name in sorted(files):
        contents = {(save / name).read_bytes() for save in saves}
        assert len(contents) == 1, f"{name} differs between saves of the same model"
    header = saves[0].joinpath("model.safetensors").read_bytes()
    metadata = json.loads(header[8:8 + int.from_bytes(header[:8], "little")])["__metadata__"]
    assert list(metadata) == sorted(metadata) == ["format", "library"]
    loaded = load_checkpoint(saves[0])[0].state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
