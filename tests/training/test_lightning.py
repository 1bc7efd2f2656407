import math

import pytest
import torch

lightning = pytest.importorskip("lightning")

from glasslm.presets import get_preset# noqa: E402
from glasslm.training.lightning import GlassLMModule, token_loader  # noqa: E402
from glasslm.training.config import TrainConfig
from glasslm.training.optim import cosine_schedule  # noqa: E402

VOCAB, CONTEXT = 8, 16


def tiny_config():
    return get_preset("shakespeare-char-cpu", vocab_size=VOCAB, n_layers=1, d_model=32, n_heads=2,
                      context_length=CONTEXT)


def pattern_tokens(n=2000):
    # A fixed cycle through a permutation of the vocabulary: each token determines the next one.
    cycle = torch.tensor([3, 0, 6, 1, 7, 2, 5, 4])
    return cycle.repeat(n // len(cycle))


def make_trainer(max_steps, **kwargs):
    return lightning.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, **kwargs)


def test_lightning_trains_the_glasslm_model():
    torch.manual_seed(0)
    steps = 30
    cfg = TrainConfig(max_steps=steps, batch_size=8, lr=1e-2, min_lr=1e-3, warmup_steps=3)
    module = GlassLMModule(tiny_config(), cfg)
    before = {k: v.clone() for k, v in module.model.state_dict().items()}
    tokens = pattern_tokens()
    train = token_loader(tokens, cfg.batch_size, CONTEXT, seed=1)
    val = token_loader(tokens, cfg.batch_size, CONTEXT, seed=2, num_batches=2)

    trainer = make_trainer(steps, val_check_interval=steps, gradient_clip_val=cfg.grad_clip)
    trainer.fit(module, train, val)

    losses = [loss.item() for loss in module.train_losses]
    assert len(losses) == steps
    assert losses[0] == pytest.approx(math.log(VOCAB), abs=0.3)  # starts near uniform
    assert losses[-1] < losses[0] - 0.5, losses
    assert trainer.callback_metrics["val_loss"] < losses[0] - 0.5
    changed = [k for k, v in module.model.state_dict().items() if not torch.equal(v, before[k])]
    assert "embed.weight" in changed and any(k.startswith("blocks.0.") for k in changed)
    # The scheduler followed cosine_schedule, once per optimizer step, in both parameter groups.
    expected = cosine_schedule(steps, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.max_steps)
    assert [g["lr"] for g in trainer.optimizers[0].param_groups] == pytest.approx([expected, expected])
    assert [g["weight_decay"] for g in trainer.optimizers[0].param_groups] == [cfg.weight_decay, 0.0]


def test_scheduler_follows_lr_at_step_by_step():
    cfg = TrainConfig(max_steps=6, lr=1.0, min_lr=0.1, warmup_steps=2)
    module = GlassLMModule(tiny_config(), cfg)
    scheduler = module.configure_optimizers()["lr_scheduler"]["scheduler"]
    seen = []
    for _ in range(8):
        seen.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([cosine_schedule(s, 1.0, 0.1, 2, 6) for s in range(8)])


def test_token_loader_is_reproducible_from_its_seed():
    tokens = torch.arange(100)
    first = list(token_loader(tokens, 4, CONTEXT, seed=5, num_batches=3))
    again = list(token_loader(tokens, 4, CONTEXT, seed=5, num_batches=3))
    other = list(token_loader(tokens, 4, CONTEXT, seed=6, num_batches=3))
    assert len(first) == 3
    for (x, y), (x2, y2) in zip(first, again):
        assert x.shape == (4, CONTEXT) and torch.equal(x, x2) and torch.equal(y, y2)
        assert torch.equal(y[:, :-1], x[:, 1:])
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(first, other))
