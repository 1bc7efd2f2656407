"""What `train()` returns.

Example:
    >>> TrainResult(model=None).step
    0
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from glasslm.core.model import TransformerLM


@dataclass
class TrainResult:
    """The trained model and the run's record; the loop's parts fill it in as they go."""

    model: TransformerLM
    train_losses: list[float] = field(default_factory=list)  # one per step run in this call
    val_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)
    tokens_per_second: float = 0.0
    step: int = 0  # optimizer steps done, counting those before a resume
    best_val_loss: float = math.inf
    checkpoint: Path | None = None  # the last checkpoint written
    stopped_by_signal: int | None = None  # SIGINT/SIGTERM number if the run was interrupted
    stopped_early: bool = False  # the validation loss stopped improving (TrainConfig.early_stop)
    last_metrics: dict = field(default_factory=dict)  # the last metrics record, validation fields merged in
