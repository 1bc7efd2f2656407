"""Library calls leave the process as they found it: RNGs, thread counts, matplotlib, environment, oneDNN."""

import json
import os
import random
import sys
import types

import numpy as np
import pytest
import torch

from glasslm.presets import get_preset
from glasslm.core.model import TransformerLM
from glasslm.training.config import TrainConfig
from glasslm.training.loop import train


def test_train_leaves_global_generators_and_thread_count_alone():
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    torch_state, python_state, numpy_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    threads = torch.get_num_threads()
    cfg = get_preset("shakespeare-char-cpu", vocab_size=8, n_layers=1, d_model=16, n_heads=2, context_length=8,
                     dropout=0.1)
    train(cfg, TrainConfig(max_steps=2, batch_size=2, eval_iters=1, progress=False, threads=threads + 1),
          torch.randint(0, 8, (100,), generator=torch.Generator().manual_seed(0)))
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert random.getstate() == python_state
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), numpy_state))
    assert torch.get_num_threads() == threads  # threads are the command line's to set


def test_training_is_still_seeded():
    cfg = get_preset("shakespeare-char-cpu", vocab_size=8, n_layers=1, d_model=16, n_heads=2, context_length=8,
                     dropout=0.1)
    tokens = torch.arange(100) % 8
    runs = [train(cfg, TrainConfig(max_steps=3, batch_size=2, eval_iters=1, progress=False), tokens).train_losses
            for _ in range(2)]
    torch.rand(5)  # moving the caller's stream between runs changes nothing
    assert runs[0] == runs[1]


def test_plot_keeps_matplotlib_backend_and_pyplot_state(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    from glasslm.training.plot import plot_run

    rows = [{"step": s, "tokens": 8 * s, "train_loss": 4 / s, "val_loss": 4.1 / s} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = matplotlib.get_backend()
    matplotlib.use("svg")  # any backend but Agg, which the old code forced
    try:
        path = plot_run(tmp_path)
        assert matplotlib.get_backend() == "svg"
        import matplotlib.pyplot as plt

        assert plt.get_fignums() == []
    finally:
        matplotlib.use(before)
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_wandb_logger_sets_no_environment_variable(tmp_path, monkeypatch):
    from glasslm.training.loggers import WandbLogger

    calls = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: calls.append(kwargs) or types.SimpleNamespace(log=None, finish=None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    WandbLogger(tmp_path, {"lr": 1e-3})
    assert "WANDB_MODE" not in os.environ and calls[0]["mode"] == "offline"
    monkeypatch.setenv("WANDB_MODE", "online")
    WandbLogger(tmp_path, {})
    assert calls[1]["mode"] == "online"


def test_bf16_decoding_restores_the_onednn_switch():
    from glasslm.generation import generate_tokens

    model = TransformerLM(get_preset("llama-tiny", n_layers=1)).to(torch.bfloat16).eval()
    for enabled in (True, False):
        torch.backends.mkldnn.enabled = enabled
        try:
            list(generate_tokens(model, [1, 2, 3], max_new_tokens=3, temperature=0.0))  # one row: the gemv path
            assert torch.backends.mkldnn.enabled is enabled
        finally:
            torch.backends.mkldnn.enabled = True


def test_out_of_range_ids_on_cpu_are_still_a_clear_error():
    model = TransformerLM(get_preset("llama-tiny", n_layers=1))
    with pytest.raises(ValueError, match="token id 512 is outside the vocabulary"):
        model(torch.tensor([[1, 512]]))


def test_check_tokens_reads_nothing_back_from_an_accelerator():
    # On a meta tensor any read-back raises; check_tokens must validate shape and dtype without one.
    model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=8, n_layers=1, d_model=16, n_heads=2,
                                     context_length=8))
    model.check_tokens(torch.empty(2, 3, dtype=torch.long, device="meta"))
    with pytest.raises(ValueError, match="2-D"):
        model.check_tokens(torch.empty(3, dtype=torch.long, device="meta"))
    with pytest.raises(ValueError, match="outside the vocabulary"):  # on the CPU the ids are checked
        model.check_tokens(torch.tensor([[0, 8]]))


@pytest.mark.parametrize("log_interval", [5, 20])
def test_training_syncs_with_the_host_per_log_record_not_per_step(monkeypatch, log_interval):
    """Losses stay on the device between metrics records: read-backs grow with records, not steps."""
    reads = []
    for method in ("item", "tolist"):
        original = getattr(torch.Tensor, method)

        def counted(self, *args, _original=original, _method=method, **kwargs):
            reads.append(_method)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counted)
    cfg = get_preset("shakespeare-char-cpu", vocab_size=8, n_layers=1, d_model=16, n_heads=2, context_length=8)
    steps = 40
    train(cfg, TrainConfig(max_steps=steps, batch_size=2, eval_iters=1, eval_interval=0, log_interval=log_interval,
                           warmup_steps=2, progress=False),
          torch.randint(0, 8, (200,), generator=torch.Generator().manual_seed(0)))
    records = steps // log_interval
    # Each record reads its window once (losses and gradient norms); the one evaluation at the end
    # and the end-of-run summary add a few more. A per-step read-back would give at least 40.
    assert len(reads) <= 2 * records + 4, reads
    assert len(reads) < steps
