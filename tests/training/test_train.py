"""The training loop: schedule shape, parameter groups, accumulation, evaluation, mixed precision,
non-finite losses, the metrics log, plotting and config files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import glasslm.training.step as step_module
from glasslm.presets import get_preset
from glasslm.training.loggers import read_metrics
from glasslm.core.model import TransformerLM
from glasslm.training.config import TrainConfig
from glasslm.training.evaluator import evaluate
from glasslm.training.loop import train
from glasslm.training.optim import make_optimizer
from glasslm.training.step import forward_backward
from glasslm.training.optim import cosine_schedule

TINY = dict(vocab_size=16, n_layers=2, d_model=32, n_heads=2, context_length=16)


def tokens(n: int = 4000) -> torch.Tensor:
    return torch.randint(0, 16, (n,), generator=torch.Generator().manual_seed(0))


def cfg(**kw) -> TrainConfig:
    base = dict(max_steps=12, batch_size=4, warmup_steps=2, eval_interval=0, eval_iters=2, log_interval=1,
                progress=False)
    base.update(kw)
    return TrainConfig(**base)


# ----- learning-rate schedule -----

@pytest.mark.parametrize("warmup,decay", [(10, 100), (0, 50), (1, 2), (5, 6)])
def test_lr_schedule_shape(warmup, decay):
    lr, min_lr = 1e-3, 1e-4
    values = [cosine_schedule(s, lr, min_lr, warmup, decay) for s in range(decay + 20)]
    warm = values[: warmup + 1]
    assert all(a < b for a, b in zip(warm, warm[1:])), "warmup rises strictly"
    if warmup:
        assert values[0] == 0.0, "the usual linear warmup starts at 0"
        assert values[1] == pytest.approx(lr / warmup)
    assert values[warmup] == pytest.approx(lr), "peak exactly where the cosine starts"
    cosine = values[warmup:decay + 1]
    assert all(a >= b for a, b in zip(cosine, cosine[1:])), "cosine phase never rises"
    assert all(v == min_lr for v in values[decay:]), "min_lr from decay_steps on"
    assert all(min_lr <= v <= lr for v in values[warmup:])


def test_lr_schedule_midpoint_and_known_values():
    # Halfway through the cosine the rate is halfway between max and min.
    assert cosine_schedule(60, 1.0, 0.0, warmup_steps=10, decay_steps=110) == pytest.approx(0.5)
    assert cosine_schedule(0, 1.0, 0.1, 0, 10) == 1.0


# ----- optimizer -----

def test_weight_decay_only_on_matrices_unless_embeddings_asked_for():
    model = TransformerLM(get_preset("shakespeare-char-cpu-nanogpt", **TINY, bias=True))
    names = {id(p): n for n, p in model.named_parameters()}
    opt = make_optimizer(model, cfg(weight_decay=0.1))
    decayed = {names[id(p)] for p in opt.param_groups[0]["params"]}
    plain = {names[id(p)] for p in opt.param_groups[1]["params"]}
    assert opt.param_groups[0]["weight_decay"] == 0.1 and opt.param_groups[1]["weight_decay"] == 0.0
    assert "blocks.0.attn.qkv.weight" in decayed or any("attn" in n for n in decayed)
    assert not any(n.startswith(("embed.", "pos_embed.")) or "ln" in n or n.endswith("bias") for n in decayed)
    assert {"embed.weight", "pos_embed.weight"} <= plain
    assert decayed | plain == set(names.values())
    opt = make_optimizer(model, cfg(decay_embeddings=True))
    assert "embed.weight" in {names[id(p)] for p in opt.param_groups[0]["params"]}
    assert opt.defaults["fused"] is True


# ----- gradient accumulation -----

def test_accumulated_gradient_equals_large_batch_gradient():
    torch.manual_seed(0)
    # float32: layers.cross_entropy computes in float32 whatever the logits' dtype.
    model = TransformerLM(get_preset("shakespeare-char-cpu", **TINY))
    x = torch.randint(0, 16, (8, 16))
    y = torch.randint(0, 16, (8, 16))
    big = forward_backward(model, x, y, accum_steps=1)
    big_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    accumulated = forward_backward(model, x, y, accum_steps=4)
    assert accumulated.item() == pytest.approx(big.item(), rel=1e-6)
    for p, g in zip(model.parameters(), big_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)
    # Without the 1/accum_steps scaling the gradient would be 4x too large.
    assert not torch.allclose(next(model.parameters()).grad, 4 * big_grads[0])


def test_accumulation_run_matches_big_batch_run():
    data = tokens()
    model_cfg = get_preset("shakespeare-char-cpu", **TINY)
    big = train(model_cfg, cfg(batch_size=8, max_steps=6), data)
    accumulated = train(model_cfg, cfg(batch_size=2, grad_accum_steps=4, max_steps=6), data)
    # The same windows each step (one global batch per step), so only float rounding differs.
    assert accumulated.train_losses == pytest.approx(big.train_losses, rel=1e-5)


# ----- evaluation -----

def test_evaluate_uses_the_same_batches_every_time():
    model = TransformerLM(get_preset("shakespeare-char-cpu", **TINY))
    data = tokens()
    first = evaluate(model, data, cfg(eval_iters=3))
    assert first == evaluate(model, data, cfg(eval_iters=3))
    assert model.training, "evaluate restores training mode"
    assert 2.0 < first < 3.5  # about ln(16) for an untrained model


def test_the_validation_loss_depends_on_the_global_batch_not_on_its_split():
    # The validation windows used to be drawn batch_size x processes at a time, so accumulation changed
    # them: two runs of the same global batch reported different validation losses (issue 43).
    model = TransformerLM(get_preset("shakespeare-char-cpu", **TINY))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.2)
    data = torch.arange(4000) % 7 + (torch.arange(4000) // 97) % 9  # windows that differ in how predictable they are
    whole = evaluate(model, data, cfg(batch_size=12, eval_iters=3))
    for batch, accum in ((6, 2), (4, 3), (3, 4)):
        assert evaluate(model, data, cfg(batch_size=batch, grad_accum_steps=accum, eval_iters=3)) == \
            pytest.approx(whole, rel=1e-6, abs=0), (batch, accum)
    other_windows = evaluate(model, data, cfg(batch_size=6, eval_iters=3))  # half the global batch: other windows
    assert abs(other_windows - whole) > 1e-3


def test_metrics_log_and_periodic_evaluation(tmp_path):
    result = train(get_preset("shakespeare-char-cpu", **TINY), cfg(max_steps=10, eval_interval=5, log_interval=2),
                   tokens()[:3500], tokens()[3500:], run_dir=tmp_path)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [2, 4, 5, 6, 8, 10]  # an evaluation closes the window too
    full = records[-1]
    assert {"step", "tokens", "train_loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s", "val_loss",
            "val_ppl"} <= set(full)
    assert full["tokens"] == 10 * 4 * 16
    assert full["val_ppl"] == pytest.approx(math.exp(full["val_loss"]))
    assert [s for s, _ in result.val_losses] == [5, 10]
    assert records[0]["train_loss"] == pytest.approx(sum(result.train_losses[:2]) / 2)
    assert len(result.train_losses) == 10 and result.step == 10
    assert "train_loss" in records[2] and records[2]["train_loss"] == pytest.approx(result.train_losses[4])


def test_the_printed_train_loss_is_the_one_metrics_jsonl_records(tmp_path, capsys):
    """At each evaluation the console's "train loss" is metrics.jsonl's train_loss for that step
    (the mean since the last record), also where evaluations fall between log steps."""
    train(get_preset("shakespeare-char-cpu", **TINY), cfg(max_steps=12, eval_interval=3, log_interval=4, progress=True),
          tokens()[:3500], tokens()[3500:], run_dir=tmp_path)
    printed = {int(line.split(":")[0].split()[1]): line.split("train loss ")[1].split(",")[0]
               for line in capsys.readouterr().err.splitlines() if line.startswith("step ") and "train loss" in line}
    logged = {r["step"]: f"{r['train_loss']:.4f}" for r in read_metrics(tmp_path / "metrics.jsonl") if "val_loss" in r}
    assert sorted(printed) == [3, 6, 9, 12] and printed == logged


def test_learns_and_grad_clipping_bounds_the_update():
    # A repeating sequence is learnable in a few dozen steps.
    data = torch.arange(16).repeat(300)
    result = train(get_preset("shakespeare-char-cpu", **TINY), cfg(max_steps=60, lr=1e-2, min_lr=1e-3), data)
    assert result.train_losses[-1] < 0.5 * result.train_losses[0]


def test_bfloat16_autocast_trains_with_float32_weights():
    result = train(get_preset("shakespeare-char-cpu", **TINY), cfg(dtype="bfloat16", max_steps=4), tokens())
    assert all(p.dtype == torch.float32 for p in result.model.parameters())
    assert all(math.isfinite(v) for v in result.train_losses)


def test_float16_is_refused_on_cpu():
    with pytest.raises(ValueError, match="CUDA"):
        train(get_preset("shakespeare-char-cpu", **TINY), cfg(dtype="float16"), tokens())


def test_train_starts_from_the_weights_of_a_model_it_is_handed():
    # Fine-tuning is the caller building the model (glasslm.hf.load_model / io) and handing it over:
    # with lr 0 the weights stay, and the first loss is the handed model's, not a fresh seeded one's.
    torch.manual_seed(123)
    pretrained = TransformerLM(get_preset("shakespeare-char-cpu", **TINY))
    start = {k: v.clone() for k, v in pretrained.state_dict().items()}
    frozen = cfg(max_steps=1, lr=0.0, min_lr=0.0, warmup_steps=0)
    result = train(pretrained, frozen, tokens())
    assert result.model is pretrained
    assert all(torch.equal(start[k], v) for k, v in pretrained.state_dict().items())
    fresh = train(get_preset("shakespeare-char-cpu", **TINY), frozen, tokens())
    assert result.train_losses != fresh.train_losses


def test_init_from_is_a_record_that_train_refuses_to_ignore():
    # train() never opens init_from: a bare config with it set would silently start from random weights.
    with pytest.raises(ValueError, match="init_from='some/run' is a record"):
        train(get_preset("shakespeare-char-cpu", **TINY), cfg(init_from="some/run"), tokens())
    model = TransformerLM(get_preset("shakespeare-char-cpu", **TINY))
    assert train(model, cfg(init_from="some/run", max_steps=1), tokens()).step == 1


def test_training_names_checkpoint_files_by_the_io_constants():
    # Knowledge once: glasslm.io.checkpoint owns the file names of a checkpoint.
    from glasslm.io import checkpoint

    names = [checkpoint.WEIGHTS_FILE, checkpoint.CONFIG_FILE, checkpoint.META_FILE, checkpoint.OPTIMIZER_FILE,
             checkpoint.OPTIMIZER_JSON]
    training = Path(step_module.__file__).parent
    for path in training.glob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert not [name for name in names if f'"{name}"' in text or f"'{name}'" in text], path


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, monkeypatch):
    real = step_module.cross_entropy
    calls = {"n": 0}

    def poisoned(logits, targets):
        calls["n"] += 1
        loss = real(logits, targets)
        return loss * float("nan") if calls["n"] == 7 else loss  # step 7 (eval_iters is not reached)

    monkeypatch.setattr(step_module, "cross_entropy", poisoned)  # the training step's loss
    with pytest.raises(FloatingPointError, match=r"step 7: loss nan.*ckpt-000005"):
        train(get_preset("shakespeare-char-cpu", **TINY), cfg(checkpoint_interval=5), tokens(), run_dir=tmp_path)
    assert (tmp_path / "latest").read_text().strip() == "ckpt-000005"
    assert not (tmp_path / "ckpt-000010").exists()


def test_bad_settings_are_refused():
    for bad in (dict(grad_accum_steps=0), dict(min_lr=1.0, lr=0.1), dict(dtype="int8"), dict(keep_last=-1)):
        with pytest.raises(ValueError):
            TrainConfig(**bad)


# ----- command line: config file, plot -----

def test_cli_config_file_and_plot(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from glasslm.cli import main

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be, that is the question\n" * 200)
    config = tmp_path / "run.toml"
    config.write_text(f"""
data = "{corpus}"
out = "{tmp_path / 'run'}"
sample_tokens = 0
[model]
n_layers = 1
d_model = 32
n_heads = 2
context_length = 16
[train]
max_steps = 30
batch_size = 4
eval_interval = 5
eval_iters = 2
progress = false
""")
    assert main(["train", "--config", str(config), "--max-steps", "10"]) == 0  # the flag beats the file
    run = tmp_path / "run"
    saved = json.loads((run / "ckpt-000010" / "trainer_state.json").read_text())["train_config"]
    assert saved["max_steps"] == 10 and saved["batch_size"] == 4
    assert main(["plot", str(run), "--out", str(tmp_path / "loss.png")]) == 0
    png = (tmp_path / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_cli_config_file_errors(tmp_path, capsys):
    from glasslm.cli import main

    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nmax_steps = \n")
    assert main(["train", "--config", str(bad)]) == 1
    bad.write_text("epochs = 3\n")
    assert main(["train", "--config", str(bad)]) == 1
    assert "unknown setting 'epochs'" in capsys.readouterr().err


def test_optional_loggers_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from glasslm.training.loggers import TensorBoardLogger

    logger = TensorBoardLogger(tmp_path)
    logger.log({"step": 1, "train_loss": 2.0})
    logger.close()
    assert list((tmp_path / "tensorboard").glob("events.*"))


# ----- run directories, resumed schedules and devices through the real command line (issue 12) -----

import os
import shutil
import signal
import subprocess
import sys
import time

SRC = Path(__file__).resolve().parents[2] / "src"
RUN_ARGS = ["--n-layers", "1", "--d-model", "32", "--n-heads", "2", "--context-length", "16", "--batch-size", "4",
            "--warmup-steps", "2", "--eval-interval", "10", "--eval-iters", "2", "--log-interval", "1",
            "--no-progress", "--sample-tokens", "0", "--threads", "1", "--lr", "1e-2", "--min-lr", "1e-3"]


def glasslm(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "glasslm.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120)


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory) -> tuple[Path, Path]:
    """(corpus, run directory of a finished 20-step run); tests copy the run before changing it."""
    root = tmp_path_factory.mktemp("cli")
    corpus = root / "corpus.txt"
    corpus.write_text("now is the winter of our discontent made glorious summer\n" * 60)
    done = glasslm("train", *RUN_ARGS, "--data", str(corpus), "--max-steps", "20", "--out", str(root / "run"))
    assert done.returncode == 0, done.stderr
    return corpus, root / "run"


def one_line_error(done: subprocess.CompletedProcess, command: str = "train") -> str:
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"glasslm {command}: error: "), done.stderr
    return lines[0]


@pytest.mark.slow
def test_cli_refuses_an_out_holding_a_run_unless_resumed_or_overwritten(cli_run, tmp_path):
    corpus, finished = cli_run
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    before = snapshot(run)
    error = one_line_error(glasslm("train", *RUN_ARGS, "--data", str(corpus), "--max-steps", "3", "--out", str(run)))
    assert "not empty" in error and "--resume" in error and "--overwrite" in error
    assert snapshot(run) == before, "a refused run changes nothing"
    (tmp_path / "file").write_text("x")
    assert "is a file" in one_line_error(glasslm("train", *RUN_ARGS, "--data", str(corpus), "--out",
                                                 str(tmp_path / "file")))
    done = glasslm("train", *RUN_ARGS, "--data", str(corpus), "--max-steps", "3", "--out", str(run), "--overwrite")
    assert done.returncode == 0, done.stderr
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]
    assert sorted(p.name for p in run.glob("ckpt-*")) == ["ckpt-000003"]
    assert (run / "latest").read_text().strip() == (run / "best").read_text().strip() == "ckpt-000003"


@pytest.mark.slow
def test_cli_resume_keeps_the_schedule_and_extending_it_is_explicit(cli_run, tmp_path):
    _, finished = cli_run
    first = read_metrics(finished / "metrics.jsonl")
    for extend in (False, True):
        run = tmp_path / f"run-{extend}"
        shutil.copytree(finished, run)
        done = glasslm("train", "--resume", str(run), "--max-steps", "26", *(["--extend-schedule"] if extend else []))
        assert done.returncode == 0, done.stderr
        records = read_metrics(run / "metrics.jsonl")
        assert records[:20] == first, "resuming leaves the earlier records alone"
        lrs = [r["lr"] for r in records[20:]]
        if extend:  # the cosine now ends at 26: the rate rises back up, as asked
            assert lrs == pytest.approx([cosine_schedule(s, 1e-2, 1e-3, 2, 26) for s in range(20, 26)])
            assert lrs[0] > 1e-3
        else:  # the run's schedule ended at step 20: the rate stays at min_lr
            assert lrs == [1e-3] * 6
            assert "schedule ends at step 20" in done.stdout
    saved = json.loads((tmp_path / "run-False" / "ckpt-000026" / "trainer_state.json").read_text())
    assert saved["train_config"]["lr_decay_steps"] == 20, "the schedule is recorded, so a later resume keeps it"


def test_resumed_run_continues_its_schedule_in_process(tmp_path):
    data = tokens()
    model_cfg = get_preset("shakespeare-char-cpu", **TINY)
    train(model_cfg, cfg(max_steps=8, lr=1e-2, min_lr=1e-3), data, run_dir=tmp_path)
    train(model_cfg, cfg(max_steps=12, lr=1e-2, min_lr=1e-3), data, run_dir=tmp_path, resume=tmp_path)
    lrs = [r["lr"] for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert lrs[:8] == pytest.approx([cosine_schedule(s, 1e-2, 1e-3, 2, 8) for s in range(8)])
    assert lrs[8:] == [1e-3] * 4


@pytest.mark.slow
def test_two_writers_on_one_run_directory_are_refused(cli_run, tmp_path):
    import fcntl

    corpus, _ = cli_run
    run = tmp_path / "run"
    run.mkdir()
    with open(run / ".lock", "w") as held:  # what a running `glasslm train` holds
        held.write(f"{os.getpid()}\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        before = snapshot(run)
        error = one_line_error(glasslm("train", *RUN_ARGS, "--data", str(corpus), "--max-steps", "2",
                                       "--out", str(run)))
        assert f"in use by another training process (pid {os.getpid()})" in error
        assert snapshot(run) == before
    from glasslm.training.rundir import RunLock

    with RunLock(run), RunLock(run):  # re-entrant within one process; released on exit
        pass
    with RunLock(run):
        pass


@pytest.mark.slow
def test_a_second_glasslm_train_on_a_running_run_is_refused(cli_run, tmp_path):
    """Two real processes: the second, even with --overwrite, is refused while the first trains on."""
    corpus, _ = cli_run
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([sys.executable, "-m", "glasslm.cli", "train", *RUN_ARGS, "--data", str(corpus),
                              "--max-steps", "100000", "--out", str(run)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.05)
        for extra in (["--overwrite"], []):
            error = one_line_error(glasslm("train", *RUN_ARGS, "--data", str(corpus), "--max-steps", "2",
                                           "--out", str(run), *extra))
            assert f"in use by another training process (pid {first.pid})" in error
        error = one_line_error(glasslm("train", "--resume", str(run), "--max-steps", "5"))
        assert f"in use by another training process (pid {first.pid})" in error
        assert first.poll() is None  # the first run never noticed
    finally:
        first.send_signal(signal.SIGTERM)
        _, stderr = first.communicate(timeout=60)
    assert first.returncode == 128 + signal.SIGTERM, stderr
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps))  # one writer's records only: nothing interleaved or repeated
    from glasslm.io.checkpoint import resolve_checkpoint

    at = json.loads((resolve_checkpoint(run, prefer=("latest",)) / "trainer_state.json").read_text())["step"]
    resumed = glasslm("train", "--resume", str(run), "--max-steps", str(at + 2))
    assert resumed.returncode == 0, resumed.stderr  # the lock was released with the first process


def test_default_device_is_the_best_available(monkeypatch):
    from glasslm.training.distributed import resolve_device

    assert TrainConfig().device == "auto"
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"
    monkeypatch.setenv("LOCAL_RANK", "1")  # under torchrun each process takes its own GPU
    assert resolve_device("auto") == "cuda:1"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert resolve_device("auto") == "mps"
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        resolve_device("gpu")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_device_is_a_one_line_error(cli_run):
    corpus, run = cli_run
    for command, args in (("train", [*RUN_ARGS, "--data", str(corpus), "--out", str(run.parent / "never")]),
                          ("generate", ["--checkpoint", str(run), "--max-new-tokens", "2"])):
        error = one_line_error(glasslm(command, *args, "--device", "cuda"), command)
        assert "device 'cuda' is not available" in error and "corrupt" not in error
    assert not (run.parent / "never").exists()


def test_cli_says_which_newton_schulz_precision_muon_chose_for_this_cpu(cli_run, tmp_path):
    from glasslm.runtime import cpu_has_bf16

    corpus, _ = cli_run
    done = glasslm("train", *RUN_ARGS, "--data", str(corpus), "--max-steps", "2", "--optimizer", "muon",
                   "--out", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr
    expected = "bfloat16" if cpu_has_bf16() else "float32"
    said = [line for line in done.stdout.splitlines() if line.startswith("Muon's Newton–Schulz in ")]
    assert said and said[0].startswith(f"Muon's Newton–Schulz in {expected}: "), done.stdout
    stated = glasslm("train", *RUN_ARGS, "--data", str(corpus), "--max-steps", "2", "--optimizer", "muon",
                     "--muon-ns-dtype", "bfloat16", "--out", str(tmp_path / "stated"))
    assert stated.returncode == 0 and "Newton–Schulz in" not in stated.stdout, "a stated precision needs no line"
