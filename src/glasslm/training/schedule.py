"""The learning-rate schedule: linear warmup to the peak, cosine decay to min_lr, then min_lr.

Example:
    >>> from glasslm.training.config import TrainConfig
    >>> cfg = TrainConfig(max_steps=100, lr=1.0, min_lr=0.1, warmup_steps=10)
    >>> scheduled_lr(cfg, 0) < scheduled_lr(cfg, 10) == 1.0 > scheduled_lr(cfg, 50)
    True
"""

from __future__ import annotations

from typing import Any

import torch

from glasslm.training.config import TrainConfig
from glasslm.training.optim import cosine_schedule


def scheduled_lr(cfg: TrainConfig, step: int) -> float:
    """`cfg`'s learning rate at 0-based `step`; the one place lr_decay_steps None (or 0) means max_steps.

    >>> round(scheduled_lr(TrainConfig(max_steps=100, lr=1.0, min_lr=0.1, warmup_steps=0, lr_decay_steps=0), 50), 3)
    0.55
    """
    return cosine_schedule(step, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.lr_decay_steps or cfg.max_steps)


def schedule_end(cfg: TrainConfig, resumed_config: dict[str, Any] | None = None) -> int:
    """The step where the cosine decay ends (min_lr from there on).

    An explicit `lr_decay_steps` wins. Otherwise a fresh run decays over `max_steps`, and a
    resumed run keeps the end its checkpoint's run had: raising max_steps on resume trains longer
    at min_lr instead of re-stretching the cosine (which would raise the learning rate mid-run).
    To stretch it, set lr_decay_steps explicitly (`glasslm train --resume ... --extend-schedule`).

    >>> schedule_end(TrainConfig(max_steps=400), resumed_config={"max_steps": 300, "lr_decay_steps": None})
    300
    """
    if cfg.lr_decay_steps:
        return cfg.lr_decay_steps
    if resumed_config is not None:
        return resumed_config.get("lr_decay_steps") or resumed_config["max_steps"]
    return cfg.max_steps


def apply_schedule(optimizer: torch.optim.Optimizer, cfg: TrainConfig, step: int) -> float:
    """Set every group's rate for `step`: its peak (`initial_lr`, else cfg.lr) times the schedule's
    fraction of cfg.lr, so Muon's and AdamW's groups warm up and decay together. Returns cfg.lr's value.

    >>> model = torch.nn.Linear(2, 2)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    >>> apply_schedule(optimizer, TrainConfig(max_steps=10, lr=1.0, warmup_steps=0), 0)
    1.0
    >>> optimizer.param_groups[0]["lr"]
    1.0
    """
    lr = scheduled_lr(cfg, step)
    for group in optimizer.param_groups:
        group["lr"] = group.get("initial_lr", cfg.lr) * (lr / cfg.lr if cfg.lr > 0 else 0.0)
    return lr
