"""The training-time estimate (timed before the first step) and the refusal of a run too long for the device."""

import os
import subprocess
import sys

import pytest
import torch

from glasslm.cli import main
from glasslm.presets import get_preset
from glasslm.training.config import TrainConfig
from glasslm.training.estimate import TrainingTooLong
from glasslm.training.loop import train

TINY = dict(vocab_size=16, n_layers=1, d_model=16, n_heads=2, context_length=8)
TOKENS = torch.arange(16).repeat(200)


def _params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_timing_the_first_micro_batch_leaves_the_run_unchanged():
    # progress=True estimates (one micro-batch forward and backward, undone); progress=False does not.
    cfg = get_preset("shakespeare-char-cpu", **TINY, dropout=0.1)  # dropout: the probe draws random numbers too
    runs = [train(cfg, TrainConfig(max_steps=4, batch_size=4, grad_accum_steps=2, eval_interval=0, eval_iters=1,
                                   progress=progress), TOKENS, TOKENS) for progress in (True, False)]
    assert runs[0].train_losses == runs[1].train_losses
    assert torch.equal(_params(runs[0].model), _params(runs[1].model))


def test_a_run_estimated_over_the_limit_is_refused_before_anything_is_written(tmp_path):
    old = tmp_path / "old"
    train(get_preset("shakespeare-char-cpu", **TINY), TrainConfig(max_steps=2, eval_interval=0, eval_iters=1,
                                                                  progress=False), TOKENS, TOKENS, run_dir=old)
    before = sorted(p.name for p in old.rglob("*"))
    huge = TrainConfig(max_steps=10**9, eval_interval=0, eval_iters=1, progress=False)
    for run_dir, overwrite in ((tmp_path / "new", False), (old, True)):
        with pytest.raises(TrainingTooLong) as refused:
            train(get_preset("shakespeare-char-cpu", **TINY), huge, TOKENS, TOKENS, run_dir=run_dir,
                  overwrite=overwrite, refuse_longer_than_s=3600.0)
        assert refused.value.estimate.steps == 10**9 and refused.value.estimate.seconds > 3600.0
        assert "nothing was written" in str(refused.value)
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in old.rglob("*")) == before  # --overwrite did not clear the old run


def _cli_run(tmp_path, *extra):
    return ["train", "--data", str(tmp_path / "text.txt"), "--out", str(tmp_path / "run"), "--n-layers", "1",
            "--d-model", "16", "--n-heads", "2", "--eval-iters", "1", "--sample-tokens", "0", *extra]


def test_train_refuses_a_run_over_a_day_and_yes_starts_it(tmp_path, shakespeare_text, capsys, monkeypatch):
    (tmp_path / "text.txt").write_text(shakespeare_text[:5000])
    # 10^9 steps of any model take more than a day; for --yes, a day is made a microsecond instead.
    assert main(_cli_run(tmp_path, "--preset", "llama-tiny", "--max-steps", str(10**9))) == 1
    err = capsys.readouterr().err
    assert "would take about" in err and "steps x 1 micro-batch x" in err and "timed on cpu" in err, err
    assert "nothing was written" in err and "--yes" in err and "--max-steps" in err
    for preset in ("shakespeare-char-cpu", "shakespeare-char-cpu-nanogpt"):  # CPU-sized, with the data and --out typed
        assert f"glasslm train --preset {preset} --data {tmp_path / 'text.txt'} --out {tmp_path / 'run'} (" in err
    assert not (tmp_path / "run").exists()  # no run directory, no lock
    monkeypatch.setattr("glasslm.training.estimate.DAY_S", 1e-6)
    assert main(_cli_run(tmp_path, "--max-steps", "3")) == 1
    assert "would take" in capsys.readouterr().err and not (tmp_path / "run").exists()
    assert main(_cli_run(tmp_path, "--max-steps", "3", "--yes")) == 0
    assert (tmp_path / "run" / "ckpt-000003").is_dir()


def test_progress_to_a_file_is_lines_with_the_estimate_first(tmp_path, shakespeare_text):
    (tmp_path / "text.txt").write_text(shakespeare_text[:5000])
    log = tmp_path / "stderr.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with open(log, "w") as stderr:
        done = subprocess.run([sys.executable, "-m", "glasslm", *_cli_run(tmp_path, "--max-steps", "30")],
                              stderr=stderr, stdout=subprocess.PIPE, env=env, timeout=300)
    assert done.returncode == 0
    text = log.read_text()
    assert "\r" not in text  # no tqdm frames in a log
    lines = text.splitlines()
    estimate = next(i for i, line in enumerate(lines) if line.startswith("estimated training time: about"))
    progress = [i for i, line in enumerate(lines) if line.startswith("train ")]
    assert progress and estimate < progress[0], text
    assert lines[progress[-1]].startswith("train 30/30 (100%)"), text


def test_a_run_far_past_the_limit_is_refused_from_one_row(tmp_path):
    # One row, scaled by the rows, decides when it is already far past the limit; near it, the whole
    # micro-batch is timed (a gpt2-small micro-batch takes minutes on a CPU, its row seconds).
    cfg = get_preset("shakespeare-char-cpu", **TINY)
    far = TrainConfig(max_steps=10**9, batch_size=8, eval_interval=0, eval_iters=1, progress=False)
    with pytest.raises(TrainingTooLong) as refused:
        train(cfg, far, TOKENS, TOKENS, run_dir=tmp_path / "far", refuse_longer_than_s=3600.0)
    estimate = refused.value.estimate
    assert estimate.timed_rows == 1 and estimate.rows == 8 and "1 row(s) timed on cpu" in estimate.describe()
    assert not (tmp_path / "far").exists()


def test_near_the_limit_the_whole_micro_batch_decides(tmp_path, monkeypatch):
    # Timings made up: one row 1 s, the whole micro-batch of 8 rows 5 s (not 8: rows scale sublinearly).
    monkeypatch.setattr("glasslm.training.estimate.time_micro_batch", lambda parts, rows=None: 1.0 if rows else 5.0)
    cfg, run = get_preset("shakespeare-char-cpu", **TINY), TrainConfig(max_steps=2, batch_size=8, eval_interval=0,
                                                                      eval_iters=1, progress=False)
    # One row says 2 x 8 x 1 s + one evaluation (a third of 8 s): 18.7 s; the micro-batch 2 x 5 + 5/3 = 11.7 s.
    for limit, timed_rows in ((5.0, 1), (11.0, None)):
        with pytest.raises(TrainingTooLong) as refused:
            train(cfg, run, TOKENS, TOKENS, run_dir=tmp_path / "run", refuse_longer_than_s=limit)
        assert refused.value.estimate.timed_rows == timed_rows, limit
        assert refused.value.estimate.seconds == pytest.approx(18.667 if timed_rows else 11.667, abs=1e-3)
    assert train(cfg, run, TOKENS, TOKENS, run_dir=tmp_path / "run", refuse_longer_than_s=12.0).step == 2


def test_yes_is_a_consent_flag_without_a_negative(capsys):
    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "  --yes  " in out and "--no-yes" not in out
