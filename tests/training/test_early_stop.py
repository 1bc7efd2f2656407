"""Early stopping (issue 47): `TrainConfig.early_stop` ends a run after that many evaluations in a row
that did not lower the best validation loss by `early_stop_delta`; `best` keeps the best checkpoint,
and a resumed run stops at the step the uninterrupted one does."""

from __future__ import annotations

import pytest
import torch

from glasslm.core.model import TransformerLM
from glasslm.io.checkpoint import read_pointer
from glasslm.presets import get_preset
from glasslm.training.config import TrainConfig
from glasslm.training.loggers import read_metrics
from glasslm.training.loop import train

pytestmark = pytest.mark.usefixtures("one_thread")


def _model() -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(get_preset("llama-tiny", vocab_size=8, n_layers=1, d_model=32, n_heads=2, n_kv_heads=2,
                                    context_length=16))


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 8, (2000,), generator=torch.Generator().manual_seed(seed))


def _cfg(**overrides) -> TrainConfig:
    # lr 1e-7: the validation loss moves by far less than early_stop_delta, so no evaluation after the
    # first one improves on it, and the run ends after 1 + early_stop evaluations
    settings = dict(max_steps=100, batch_size=4, lr=1e-7, min_lr=0.0, warmup_steps=0, eval_interval=2, eval_iters=2,
                    early_stop=2, progress=False, device="cpu")
    return TrainConfig(**{**settings, **overrides})


def test_a_run_whose_validation_loss_stops_improving_stops_and_keeps_the_best(tmp_path):
    result = train(_model(), _cfg(), _tokens(0), _tokens(1), run_dir=tmp_path / "run")
    assert result.stopped_early and result.step == 6  # evaluations at 2 (the first best), 4 and 6
    assert [step for step, _ in result.val_losses] == [2, 4, 6]
    assert read_pointer(tmp_path / "run", "best").name == f"ckpt-{min(result.val_losses, key=lambda v: v[1])[0]:06d}"
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "val_loss" in r] == [2, 4, 6]
    pattern = torch.arange(2000) % 8  # a sequence the model learns quickly: its loss keeps falling
    learning = train(_model(), _cfg(lr=3e-3, min_lr=3e-4, max_steps=12), pattern, pattern)
    assert not learning.stopped_early and learning.step == 12  # a loss that keeps falling runs on
    assert not train(_model(), _cfg(early_stop=0, max_steps=10), _tokens(0), _tokens(1)).stopped_early


def test_a_resumed_run_stops_where_the_uninterrupted_one_does(tmp_path):
    first = train(_model(), _cfg(max_steps=4), _tokens(0), _tokens(1), run_dir=tmp_path / "run")
    assert first.step == 4 and not first.stopped_early  # one evaluation without improvement so far
    resumed = train(_model(), _cfg(), _tokens(0), _tokens(1), run_dir=tmp_path / "run", resume=tmp_path / "run")
    assert resumed.stopped_early and resumed.step == 6  # the count was saved: one more evaluation, not two
