"""The metrics window: per-step losses gathered between two metrics records, and where records go.

Example (a window that is never flushed has no losses to report yet):
    >>> from glasslm.training.config import TrainConfig
    >>> from glasslm.training.distributed import DistributedContext
    >>> from glasslm.training.result import TrainResult
    >>> from glasslm.training.trainer_state import ResumePoint
    >>> window = MetricsWindow(TrainConfig(), DistributedContext(), 64, ResumePoint(), TrainResult(None), False)
    >>> window.losses
    []
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from glasslm.io.checkpoint import remove_stale_staging
from glasslm.training.config import TrainConfig
from glasslm.training.distributed import DistributedContext, all_reduce_mean
from glasslm.training.loggers import METRICS_FILE, JSONLLogger, MetricsLogger
from glasslm.training.result import TrainResult
from glasslm.training.trainer_state import ResumePoint


# The objective's statistics the progress shows beside the loss, under short names (metrics.jsonl keeps
# the full ones): DPO/SimPO/ORPO's rewards (TRL's names) and GRPO's reward and KL.
PROGRESS_STATS = {"rewards/chosen": "chosen", "rewards/rejected": "rejected", "rewards/margins": "margin",
                  "rewards/accuracies": "accuracy", "reward": "reward", "kl": "kl"}


def shown_stats(stats: dict[str, float]) -> dict[str, str]:
    """{short name: value as shown} of the PROGRESS_STATS among `stats`, in PROGRESS_STATS's order.

    >>> shown_stats({"rewards/margins": 0.5, "rewards/chosen": -0.01179, "nll_loss": 2.0})
    {'chosen': '-0.0118', 'margin': '0.5000'}
    """
    return {short: f"{stats[name]:.4f}" for name, short in PROGRESS_STATS.items() if stats.get(name) is not None}


class MetricsWindow:
    """Per-step losses between two metrics records: kept on the device until a log, eval or
    checkpoint step needs them (one host sync then), checked for non-finite values, averaged."""

    def __init__(self, cfg: TrainConfig, ctx: DistributedContext, tokens_per_step: int, point: ResumePoint,
                 result: TrainResult, loss_scaling: bool, watch: Callable[[dict[str, Any]], str | None] | None = None):
        self.cfg, self.ctx, self.tokens_per_step, self.result = cfg, ctx, tokens_per_step, result
        self.watch = watch  # the objective's look at each record: a warning to print, or None
        self.loss_scaling = loss_scaling  # fp16: an infinite gradient only skips its step
        self.pending: list[tuple[Tensor, Tensor, dict[str, Tensor]]] = []
        self.stats: dict[str, list[float]] = {}  # the objective's statistics, per step of the window
        self.losses: list[float] = list(point.log_window_losses)  # resumed mid-window: its earlier steps
        self.grad_norm = math.nan
        self.seconds, self.steps_timed, self.total_seconds = 0.0, 0, 0.0
        self.clock_start, self.elapsed_before = time.perf_counter(), point.elapsed_s

    def add(self, loss: Tensor, grad_norm: Tensor, seconds: float, stats: dict[str, Tensor] | None = None) -> None:
        self.pending.append((loss, grad_norm, stats or {}))
        self.seconds += seconds
        self.steps_timed += 1

    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.clock_start

    def flush(self, done: int, last_checkpoint: Path | None) -> None:
        """Bring pending losses to the host and stop on a non-finite loss or gradient norm."""
        if not self.pending:
            return
        losses = all_reduce_mean(torch.stack([loss for loss, _, _ in self.pending]), self.ctx).tolist()
        norms = torch.stack([norm for _, norm, _ in self.pending]).tolist()
        for stats in (stats for _, _, stats in self.pending if stats):
            values = all_reduce_mean(torch.stack(list(stats.values())), self.ctx).tolist()
            for name, value in zip(stats, values):
                self.stats.setdefault(name, []).append(value)
        first = done - len(losses) + 1  # steps are counted from 1, as in the metrics log
        for i, (loss, norm) in enumerate(zip(losses, norms)):
            if not math.isfinite(loss) or (not self.loss_scaling and not math.isfinite(norm)):
                raise FloatingPointError(
                    f"training stopped at step {first + i}: loss {loss}, gradient norm {norm} is not finite "
                    f"(lower the learning rate?). Last good checkpoint: {last_checkpoint or 'none written'}")
        self.result.train_losses.extend(losses)
        self.losses.extend(losses)
        self.grad_norm = norms[-1]
        self.pending.clear()

    def record(self, done: int, lr: float, bar: Any) -> dict[str, Any]:
        """The metrics record closing the window (which then starts afresh)."""
        self.total_seconds += self.seconds
        tokens_per_s = self.tokens_per_step * self.steps_timed / max(self.seconds, 1e-9)
        self.result.tokens_per_second = (self.tokens_per_step * len(self.result.train_losses)
                                         / max(self.total_seconds, 1e-9))
        record = {"step": done, "tokens": done * self.tokens_per_step, "train_loss": sum(self.losses) / len(self.losses),
                  "lr": lr, "grad_norm": self.grad_norm, "tokens_per_s": tokens_per_s, "elapsed_s": self.elapsed()}
        record |= {name: sum(values) / len(values) for name, values in self.stats.items()}
        bar.set_postfix(loss=f"{record['train_loss']:.4f}", **shown_stats(record), lr=f"{lr:.2e}",
                        tok_s=f"{tokens_per_s:,.0f}", refresh=False)  # redrawn at tqdm's own pace; the loss is the record's
        warning = self.watch(record) if self.watch is not None else None
        if warning and self.ctx.is_main:
            bar.write(warning)
        self.result.last_metrics = dict(record)
        self.losses.clear()
        self.stats.clear()
        self.seconds, self.steps_timed = 0.0, 0
        return record


def metrics_loggers(run_path: Path | None, loggers: list[MetricsLogger] | None, ctx: DistributedContext,
                    resumed_at: int | None) -> list[MetricsLogger]:
    """metrics.jsonl (cut back to the resumed step) first, then any others; only the main process logs."""
    loggers = list(loggers or [])
    if run_path is not None and ctx.is_main:
        remove_stale_staging(run_path)  # safe: the run directory is locked (see train)
        loggers.insert(0, JSONLLogger(run_path / METRICS_FILE, keep_up_to_step=resumed_at))
    return loggers
