"""Validation: the mean loss over a fixed set of validation windows, and when to measure it.

Example:
    >>> import torch
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.presets import get_preset
    >>> from glasslm.training.config import TrainConfig
    >>> model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=4, n_layers=1, context_length=8))
    >>> cfg = TrainConfig(eval_iters=2, batch_size=2, device="cpu")
    >>> tokens = torch.randint(0, 4, (100,))
    >>> evaluate(model, tokens, cfg) == evaluate(model, tokens, cfg)  # the same windows every time
    True
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor, nn

from glasslm.core.config import ModelConfig
from glasslm.core.model import TransformerLM
from glasslm.training.batches import BatchSource, as_batch_source
from glasslm.training.config import TrainConfig
from glasslm.training.distributed import DistributedContext, all_reduce_mean, resolve_device
from glasslm.training.metrics import shown_stats
from glasslm.training.result import TrainResult
from glasslm.training.step import Objective, autocast_context, next_token_loss


def evaluate(
    model: nn.Module, tokens: Tensor | BatchSource, cfg: TrainConfig, generator: torch.Generator | None = None,
    ctx: DistributedContext | None = None, device: str | None = None,
) -> float:
    """Mean loss over cfg.eval_iters batches of validation windows (a token stream), or over the
    batches a batch source gives (fine-tuning: every held-out conversation's assistant tokens).

    With no generator the batches come from a fresh generator seeded with seed + 1, i.e. the
    same windows at every evaluation: the curve then shows the model changing, not the sample.
    Each draw of windows is the step's global batch (batch_size x grad_accum_steps x processes rows),
    evaluated in batches of batch_size rows per process, so every split of the same global batch
    (processes, accumulation) validates on the same windows and reports the same loss, to float
    rounding; each process takes its slice of each batch.
    """
    return evaluate_objective(model, tokens, cfg, generator, ctx, device)[0]


@torch.no_grad()
def evaluate_objective(
    model: nn.Module, tokens: Tensor | BatchSource, cfg: TrainConfig, generator: torch.Generator | None = None,
    ctx: DistributedContext | None = None, device: str | None = None, objective: Objective = next_token_loss,
) -> tuple[float, dict[str, float]]:
    """(mean loss, mean of each of the objective's statistics) over the validation batches, as `evaluate`."""
    ctx = ctx or DistributedContext()
    device = device or resolve_device(cfg.device)
    generator = generator or torch.Generator().manual_seed(cfg.seed + 1)
    source = as_batch_source(tokens, config_of(model).context_length)
    was_training = model.training
    model.eval()
    totals: dict[str, Tensor] = {}  # the loss under "", then the statistics
    weights = 0.0
    rows = cfg.batch_size * ctx.world_size  # one micro-batch on every process
    for x, y, weight in source.eval_batches(rows, cfg.eval_iters, generator, per_draw=rows * cfg.grad_accum_steps,
                                            share=(ctx.rank, ctx.world_size)):
        x, y = x.to(device), y.to(device)  # this process's rows of the batch
        with autocast_context(cfg, device):
            loss, stats = objective(model, x, y)  # x, y: (rows, seq)
        for name, value in {"": loss, **stats}.items():
            totals[name] = totals.get(name, 0.0) + value.float() * weight
        weights += weight
    model.train(was_training)
    means = all_reduce_mean(torch.stack(list(totals.values())) / weights, ctx).tolist()
    return means[0], dict(zip(list(totals)[1:], means[1:]))


def config_of(model: nn.Module) -> ModelConfig:
    """The ModelConfig of a model, through its DDP (.module) and torch.compile (._orig_mod) wrappers."""
    while not hasattr(model, "config"):
        model = getattr(model, "module", None) or model._orig_mod
    return model.config


class Evaluator:
    """Validation loss every `eval_interval` steps and at the end; keeps the best one, and counts the
    evaluations since the loss last fell by `early_stop_delta` (early stopping: `exhausted`)."""

    def __init__(self, model: nn.Module, tokens: BatchSource | None, cfg: TrainConfig, ctx: DistributedContext,
                 device: str, tokens_per_step: int, best: float, result: TrainResult,
                 on_eval: Callable[[int, float, TransformerLM], None] | None, objective: Objective = next_token_loss,
                 without_improvement: int = 0):
        self.model, self.tokens, self.cfg, self.ctx, self.device = model, tokens, cfg, ctx, device
        self.tokens_per_step, self.best, self.result, self.on_eval = tokens_per_step, best, result, on_eval
        self.objective = objective
        self.last: float | None = None  # the latest validation loss
        self.improved_at: int | None = None  # the step whose evaluation set the current best
        self.without_improvement = without_improvement  # evaluations since the best fell by early_stop_delta

    def exhausted(self) -> bool:
        """Whether early stopping ends the run: `early_stop` evaluations in a row without improvement."""
        return self.cfg.early_stop > 0 and self.without_improvement >= self.cfg.early_stop

    def due(self, done: int, last: bool) -> bool:
        interval = self.cfg.eval_interval
        return self.tokens is not None and (last or (interval > 0 and done % interval == 0))

    def run(self, done: int, bar: Any, train_loss: float) -> dict[str, Any]:
        """Evaluate now; returns the fields it adds to the step's metrics record. `train_loss` is
        that record's (the mean since the last record), printed beside the validation loss."""
        assert self.tokens is not None
        loss, stats = evaluate_objective(self.model, self.tokens, self.cfg, ctx=self.ctx, device=self.device,
                                         objective=self.objective)
        self.last = loss
        self.result.val_losses.append((done, loss))
        if loss < self.best:
            self.improved_at = done
        improved = loss < self.best - self.cfg.early_stop_delta
        self.without_improvement = 0 if improved else self.without_improvement + 1
        self.best = self.result.best_val_loss = min(self.best, loss)
        if self.ctx.is_main and self.cfg.progress:
            shown = "".join(f", val {name} {value}" for name, value in shown_stats(stats).items())
            bar.write(f"step {done}: train loss {train_loss:.4f}, val loss {loss:.4f}{shown}")
        if self.on_eval is not None:
            self.on_eval(done, loss, self.result.model)
        record = {"step": done, "tokens": done * self.tokens_per_step, "val_loss": loss}
        if self.objective is next_token_loss:  # a perplexity only where the loss is a next-token cross-entropy
            record["val_ppl"] = math.exp(min(loss, 50.0))
        record |= {f"val_{name}": value for name, value in stats.items()}
        self.result.last_metrics |= record
        return record
