"""The training loop: AdamW or Muon, warmup + cosine learning rate, clipping, accumulation, mixed
precision, periodic validation, checkpoints that resume exactly, and data parallelism.

`train()` assembles swappable parts and runs the loop over them: the schedule
(glasslm.training.schedule), the step (.step), the metrics window (.metrics), the evaluator
(.evaluator), the checkpointer (.checkpointer), the stop request (.signals), built over the
model, optimizer and batch sampler (.parts; how batches are drawn is described there).

The model to train is the caller's: a ModelConfig starts from fresh weights, a TransformerLM from
its own (fine-tuning: build it with glasslm.hf.load_model or glasslm.io, then hand it over).

Example (a few steps on a toy corpus):
    >>> import torch
    >>> from glasslm.presets import get_preset
    >>> from glasslm.training.config import TrainConfig
    >>> cfg = get_preset("shakespeare-char-cpu", vocab_size=4, n_layers=1, context_length=8)
    >>> tokens = torch.randint(0, 4, (1000,))
    >>> result = train(cfg, TrainConfig(max_steps=3, eval_interval=0, progress=False), tokens)
    >>> len(result.train_losses)
    3
"""

from __future__ import annotations

import os
import signal
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from jaxtyping import Int
from torch import Tensor

from glasslm.core.config import ModelConfig
from glasslm.core.model import TransformerLM
from glasslm.io.checkpoint import checkpoint_name, resolve_checkpoint
from glasslm.training.batches import BatchSource
from glasslm.training.checkpointer import Checkpointer
from glasslm.training.config import TrainConfig
from glasslm.training.distributed import DistributedContext, any_process, resolve_device
from glasslm.training.estimate import TrainingEstimate, TrainingTooLong, estimate_training, format_duration
from glasslm.training.evaluator import Evaluator
from glasslm.training.loggers import MetricsLogger
from glasslm.training.metrics import MetricsWindow, metrics_loggers
from glasslm.training.parts import TrainingParts
from glasslm.training.result import TrainResult
from glasslm.training.rundir import RunDirError, claim_run_dir
from glasslm.training.schedule import apply_schedule
from glasslm.training.signals import StopRequest
from glasslm.training.step import Objective, next_token_loss, train_step
from glasslm.progress import progress_bar
from glasslm.runtime import keeps_global_rng


@keeps_global_rng
def train(
    model: ModelConfig | TransformerLM,
    cfg: TrainConfig,
    train_tokens: Int[Tensor, "n"] | BatchSource,
    val_tokens: Int[Tensor, "m"] | BatchSource | None = None,
    on_eval: Callable[[int, float, TransformerLM], None] | None = None,
    *,
    run_dir: str | os.PathLike | None = None,
    resume: str | os.PathLike | None = None,
    tokenizer: Any | None = None,
    meta: dict[str, Any] | None = None,
    dist_ctx: DistributedContext | None = None,
    loggers: list[MetricsLogger] | None = None,
    overwrite: bool = False,
    refuse_longer_than_s: float | None = None,
    warn_longer_than_s: float | None = None,
    chat_template: str | None = None,
    objective: Objective = next_token_loss,
) -> TrainResult:
    """Train `model` (a TransformerLM with its weights, or a fresh one from a ModelConfig, seeded by
    cfg.seed) on 1-D token ids (anything `get_batch` indexes), or on a batch source
    (glasslm.training.batches: `SFTBatches` for conversations), minimising `objective` (DPO's: glasslm.training.dpo).
    Only parameters that require gradients are trained (LoRA: the adapters).

    With `run_dir`, checkpoints (ckpt-NNNNNN/ plus `latest` and `best` pointers) and
    metrics.jsonl are written there; each checkpoint holds `tokenizer`, `meta` and `chat_template`
    (the template a chat model is used with, as chat_template.jinja). `resume` (a run or checkpoint directory) continues a run
    exactly where its checkpoint left off, on the learning-rate schedule it had (see
    `schedule_end`). `dist_ctx` comes from `init_distributed()` under torchrun.

    A `run_dir` that already holds files is refused unless it is the resumed run's own directory
    or `overwrite` is set (which removes the previous run's files first); while training, the
    directory is locked against a second writer (glasslm.training.rundir).

    Before the first step, one micro-batch is timed (glasslm.training.estimate; undone, so the run is
    unchanged) and the estimate is shown with the progress. `refuse_longer_than_s` turns it into a
    guard: a run estimated to take longer raises `TrainingTooLong` before anything is written.
    `glasslm train` sets a day unless --yes; here the default is no limit, since a program calling
    train() has chosen its recipe (and the estimate is skipped under torchrun, where timing one
    process's micro-batch alone would need every process to agree first). `warn_longer_than_s` only
    warns, naming a max_steps that fits. `cfg.init_from` only records where a fine-tuned model's
    weights came from: train() never opens it, so a fresh run from a bare ModelConfig with init_from
    set is refused rather than silently started from random weights.
    """
    ctx = dist_ctx or DistributedContext(device=resolve_device(cfg.device))
    resume_dir = resolve_checkpoint(resume, prefer=("latest",)) if resume is not None else None
    if cfg.init_from and resume_dir is None and not isinstance(model, TransformerLM):
        raise ValueError(f"init_from={cfg.init_from!r} is a record, not an instruction: load those weights "
                         "(glasslm.hf.load_model / init_weights_from) and pass the model to train()")
    device = ctx.device if ctx.enabled else resolve_device(cfg.device)
    if cfg.dtype == "float16" and torch.device(device).type != "cuda":
        raise ValueError("dtype float16 (with loss scaling) is for CUDA GPUs; use bfloat16 on CPU")
    parts = TrainingParts.build(model, cfg, ctx, device, resume_dir, (train_tokens, val_tokens), objective)
    estimate = None
    if not ctx.enabled and (refuse_longer_than_s is not None or cfg.progress):
        estimate = estimate_training(parts, refuse_longer_than_s)  # before the run directory is claimed: a refusal leaves nothing
        if refuse_longer_than_s is not None and estimate.seconds > refuse_longer_than_s:
            raise TrainingTooLong(estimate, refuse_longer_than_s)
    with claim_run(run_dir, resume_dir, overwrite, ctx):
        return _train(parts, (estimate, warn_longer_than_s), on_eval, run_dir, resume_dir, (tokenizer, meta, chat_template), loggers)


@contextmanager
def claim_run(run_dir: str | os.PathLike | None, resume_dir: str | os.PathLike | None, overwrite: bool,
              ctx: DistributedContext):
    """Hold `run_dir` for training (glasslm.training.rundir.claim_run_dir) on the main process. Collective:
    if the main process is refused, every process raises, so none waits for it forever."""
    with ExitStack() as claim:
        refused: RunDirError | None = None
        if run_dir is not None and ctx.is_main:
            try:
                claim.enter_context(claim_run_dir(run_dir, resume_dir, overwrite))
            except RunDirError as err:
                refused = err
        if any_process(refused is not None, ctx):
            raise refused or RunDirError(f"the main process refused the run directory {run_dir}")
        yield


def _train(
    parts: TrainingParts, estimated: tuple[TrainingEstimate | None, float | None],
    on_eval: Callable[[int, float, TransformerLM], None] | None, run_dir: str | os.PathLike | None,
    resume_dir: Path | None, saved_with: tuple[Any, dict[str, Any] | None, str | None],
    loggers: list[MetricsLogger] | None,
) -> TrainResult:
    """Assemble the duties around the parts, then run the loop over them. `estimated`: the time
    estimate and the duration past which it warns; `saved_with`: the tokenizer, meta and chat
    template every checkpoint holds."""
    cfg, point, ctx, device = parts.cfg, parts.point, parts.ctx, parts.device
    run_path = Path(run_dir) if run_dir is not None else None
    result = TrainResult(parts.model, step=point.step, best_val_loss=point.best_val_loss)
    duties = _Duties(
        window=MetricsWindow(cfg, ctx, parts.tokens_per_step, point, result, parts.scaler is not None,
                             getattr(parts.objective, "watch", None)),
        evaluator=Evaluator(parts.eval_model, parts.val_source, cfg, ctx, device, parts.tokens_per_step,
                            point.best_val_loss, result, on_eval, parts.objective, point.evals_without_improvement),
        checkpointer=Checkpointer(run_path, cfg, ctx, parts, *saved_with[:2], result, saved_with[2]),
        loggers=metrics_loggers(run_path, loggers, ctx, point.step if resume_dir else None),
        bar=progress_bar(total=cfg.max_steps, initial=point.step, disable=not (cfg.progress and ctx.is_main),
                         dynamic_ncols=True, desc="train", mininterval=1.0),
    )
    if estimated[0] is not None and cfg.progress:
        _show_estimate(parts, duties.bar, *estimated)
    try:
        with StopRequest() as stop:
            _loop(parts, duties, stop, result)
    finally:
        duties.bar.close()
        for logger in duties.loggers:
            logger.close()
    return result


def _show_estimate(parts: TrainingParts, bar: Any, estimate: TrainingEstimate, warn_longer_than_s: float | None) -> None:
    """The estimate, first; with early stopping it is the most the run takes. Past `warn_longer_than_s`,
    a warning naming the max_steps that fits it (the run goes on: the caller chose to warn, not refuse)."""
    cfg = parts.cfg
    early = cfg.early_stop > 0 and parts.val_source is not None
    bar.write(f"estimated training time: {'at most ' if early else ''}{estimate.describe()}"
              + ("; it stops sooner once the held-out loss stops improving" if early else ""))
    bar.set_postfix(estimate=format_duration(estimate.seconds))  # until the first metrics record
    if warn_longer_than_s is not None and estimate.seconds > warn_longer_than_s and estimate.steps > 0 and not early:
        per_step = estimate.seconds / estimate.steps
        fits = parts.point.step + max(1, int(warn_longer_than_s / per_step))
        bar.write(f"warning: this run would take {format_duration(estimate.seconds)}, more than "
                  f"{format_duration(warn_longer_than_s)}; Ctrl-C stops it (saving a checkpoint), and "
                  f"--max-steps {fits} fits {format_duration(warn_longer_than_s)}")


@dataclass
class _Duties:
    """What happens around the steps: the metrics window, evaluator, checkpointer, loggers and progress bar."""

    window: MetricsWindow
    evaluator: Evaluator
    checkpointer: Checkpointer
    loggers: list[MetricsLogger]
    bar: Any  # glasslm.progress.progress_bar: tqdm, or PlainProgress off a terminal


def _loop(parts: TrainingParts, duties: _Duties, stop: StopRequest,
          result: TrainResult) -> None:
    """One `train_step` per step; the metrics window, the evaluator and the checkpointer each decide
    when they have something to do, and a stop request ends the run after a checkpoint."""
    cfg, ctx = parts.cfg, parts.ctx
    window, evaluator, checkpointer, bar = duties.window, duties.evaluator, duties.checkpointer, duties.bar
    # One process: a stop request abandons a long step between micro-batches (processes would
    # have to agree first, so under torchrun the step finishes).
    interrupted = None if ctx.enabled else (lambda: stop.signum is not None)
    for step in range(parts.point.step, cfg.max_steps):
        started = time.perf_counter()
        lr = apply_schedule(parts.optimizer, cfg, step)
        before = _generator_states(parts) if interrupted is not None else None
        stepped = train_step(parts, *parts.next_batch(), interrupted=interrupted)
        if stepped is None:
            _stop_before_step(parts, duties, stop, result, step, before)
            return
        loss, grad_norm, stats = stepped
        done = result.step = step + 1
        window.add(loss, grad_norm, time.perf_counter() - started, stats)
        bar.update(1)
        last = done == cfg.max_steps
        evaluating = evaluator.due(done, last)
        # An evaluation closes the metrics window too, so the train loss printed beside the
        # validation loss is the one metrics.jsonl records for that step.
        logging = done % cfg.log_interval == 0 or last or evaluating
        stop_signal = stop.requested(ctx, logging)
        saving = checkpointer.due(done, last, stop_signal is not None, evaluating)
        if not (logging or evaluating or saving):
            continue
        window.flush(done, checkpointer.last)
        record = window.record(done, lr, bar) if logging else {}
        if evaluating:
            record |= evaluator.run(done, bar, record["train_loss"])
        if record and ctx.is_main:
            for logger in duties.loggers:
                logger.log(record)
        if saving:
            with stop.saving():  # a second Ctrl-C now waits for the checkpoint to be complete
                checkpointer.save(done, evaluator, window)
        if evaluating and evaluator.exhausted() and not last:
            result.stopped_early = True
            if ctx.is_main and cfg.progress:
                bar.write(f"stopping early after step {done}: the held-out loss has not fallen by "
                          f"{cfg.early_stop_delta:g} in {cfg.early_stop} evaluations (best {evaluator.best:.4f})")
            return
        if stop_signal is not None:
            result.stopped_by_signal = stop_signal
            if ctx.is_main and cfg.progress:
                bar.write(f"stopped by signal {signal.Signals(stop_signal).name} after step {done}; "
                          f"checkpoint: {result.checkpoint}")
            return


def _generator_states(parts: TrainingParts) -> tuple[Tensor, ...]:
    """The generators a step draws from (its batch; dropout), to undo an abandoned step's draws."""
    states = (parts.batch_rng.get_state(), torch.get_rng_state())
    if torch.device(parts.device).type == "cuda":
        states += (torch.cuda.get_rng_state(parts.device),)
    return states


def _stop_before_step(parts: TrainingParts, duties: _Duties, stop: StopRequest, result: TrainResult, step: int,
                      before: tuple[Tensor, ...] | None) -> None:
    """A stop request arrived inside step `step + 1`: undo its random draws and save the state after
    step `step` (what an uninterrupted run had then), so a resumed run continues bit for bit."""
    assert before is not None and stop.signum is not None
    parts.batch_rng.set_state(before[0])
    torch.set_rng_state(before[1])
    if len(before) > 2:
        torch.cuda.set_rng_state(before[2], parts.device)
    result.stopped_by_signal = stop.signum
    saved = duties.checkpointer.last
    if step > parts.point.step and duties.checkpointer.run_dir is not None \
            and (saved is None or saved.name != checkpoint_name(step)):
        duties.window.flush(step, duties.checkpointer.last)
        with stop.saving():
            duties.checkpointer.save(step, duties.evaluator, duties.window)
    if parts.cfg.progress:
        duties.bar.write(f"stopped by signal {signal.Signals(stop.signum).name} inside step {step + 1}; "
                         f"checkpoint: {result.checkpoint}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `glasslm train` (python -m glasslm.cli train)")
