"""The training-time estimate (timed before the first step) and the refusal of a run too long for the device."""

import os
import subprocess
import sys
import time

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


@pytest.fixture
def one_thread():
    """Tiny models on one thread: on a loaded machine a second thread waits for a core at every
    matmul, and these tests' timings would be the waits (issue 32)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_timing_the_first_micro_batch_leaves_the_run_unchanged(optimizer, tmp_path, monkeypatch, one_thread):
    # progress=True estimates (micro-batches forward and backward, optimizer steps, all undone);
    # progress=False does not. Resumed, the optimizer has state that the timed steps must not keep.
    monkeypatch.setattr("glasslm.training.estimate.PROBE_S", 0.0)  # a warm-up and one timed call each suffice here
    cfg = get_preset("shakespeare-char-cpu", **TINY, dropout=0.1)  # dropout: the probe draws random numbers too
    settings = dict(batch_size=4, grad_accum_steps=2, eval_interval=0, eval_iters=1, optimizer=optimizer,
                    checkpoint_interval=2)
    train(cfg, TrainConfig(max_steps=2, progress=False, **settings), TOKENS, TOKENS, run_dir=tmp_path / "first")
    runs = [train(cfg, TrainConfig(max_steps=5, progress=progress, **settings), TOKENS, TOKENS,
                  resume=tmp_path / "first" if resumed else None)
            for resumed in (False, True) for progress in (True, False)]
    for timed, untimed in (runs[:2], runs[2:]):
        assert timed.train_losses == untimed.train_losses
        assert torch.equal(_params(timed.model), _params(untimed.model))


def _estimate(model, cfg: TrainConfig, data=(TOKENS, TOKENS)):
    from glasslm.training.distributed import DistributedContext
    from glasslm.training.estimate import estimate_training
    from glasslm.training.parts import TrainingParts

    return estimate_training(TrainingParts.build(model, cfg, DistributedContext(device="cpu"), "cpu", None, data))


def test_the_first_call_is_a_warm_up_and_the_optimizer_step_is_timed(one_thread):
    # A model whose first forward pass stalls (as a cold first micro-batch does, more so on a loaded
    # machine) and whose third does too: the warm-up leaves the first out, the median the third.
    from glasslm.core.model import TransformerLM

    class StallingModel(TransformerLM):
        calls = 0

        def forward(self, *args, **kwargs):
            StallingModel.calls += 1
            if StallingModel.calls in (1, 3):
                time.sleep(0.6)
            return super().forward(*args, **kwargs)

    cfg = TrainConfig(max_steps=10, batch_size=4, eval_interval=0, eval_iters=1, optimizer="muon", progress=False)
    estimate = _estimate(StallingModel(get_preset("shakespeare-char-cpu", **TINY)), cfg)
    assert StallingModel.calls >= 4 and estimate.micro_batch_s < 0.3, (StallingModel.calls, estimate)
    assert estimate.optimizer_s > 0 and "optimizer step" in estimate.describe()
    assert estimate.seconds == pytest.approx(10 * (estimate.micro_batch_s + estimate.optimizer_s)
                                             + 1 * 1 * estimate.micro_batch_s / 3)


def test_fine_tuning_estimates_the_held_out_batches_it_evaluates():
    # A conversation source evaluates each held-out conversation once, not eval_iters batches.
    from glasslm.data.sft import encode_conversation
    from glasslm.tokenizers import CharTokenizer
    from glasslm.training.batches import SFTBatches

    tokenizer = CharTokenizer.from_text("abcdu:;")
    template = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
    conversation = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "cd"}]
    source = SFTBatches([encode_conversation(tokenizer, template, conversation)] * 10, context_length=8)
    cfg = TrainConfig(max_steps=4, batch_size=4, eval_interval=2, eval_iters=50, progress=False)
    estimate = _estimate(get_preset("shakespeare-char-cpu", **TINY), cfg, (source, source))
    assert estimate.evaluations == 3 and estimate.eval_batches == 3  # ceil(10 / 4), not 50


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
    monkeypatch.setattr("glasslm.training.estimate.time_optimizer_step", lambda parts: 0.0)
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
