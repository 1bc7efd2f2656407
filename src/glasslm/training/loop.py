"""The training loop: AdamW, warmup + cosine learning rate, clipping, accumulation, mixed precision,
periodic validation, checkpoints that resume exactly, and data parallelism.

Example (a few steps on a toy corpus):
    >>> import torch
    >>> from glasslm.presets import get_preset
    >>> from glasslm.training.config import TrainConfig
    >>> from glasslm.training.loop import train
    >>> cfg = get_preset("shakespeare-char-cpu", vocab_size=4, n_layers=1, context_length=8)
    >>> tokens = torch.randint(0, 4, (1000,))
    >>> result = train(cfg, TrainConfig(max_steps=3, eval_interval=0, progress=False), tokens)
    >>> len(result.train_losses)
    3

How the data is drawn (this is what makes resuming and data parallelism exact): every optimizer
step draws one *global* batch of batch_size x grad_accum_steps x world_size windows from a single
generator seeded by `seed`. Process r takes the r-th contiguous slice and splits it into
grad_accum_steps micro-batches. So the windows seen at step s depend only on s and the global batch
size: 2 processes with batch 6 see exactly what 1 process with batch 12 sees, and a resumed run
(generator state restored from the checkpoint) sees what the uninterrupted run saw.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import random
import signal
import sys
import threading
import time
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
import torch
from jaxtyping import Int
from torch import Tensor, nn
from tqdm.auto import tqdm

from glasslm.io.build import load_weights
from glasslm.io.checkpoint import (
    OPTIMIZER_FILE, OPTIMIZER_JSON, CheckpointWriteError, checkpoint_name, load_config, load_optimizer_state,
    optimizer_state_to_files, prune_checkpoints, read_pointer, read_safetensors,
    remove_stale_staging, resolve_checkpoint, save_checkpoint, write_pointer,
)
from glasslm.core.config import ModelConfig
from glasslm.data import get_batch
from glasslm.training.distributed import DistributedContext, all_reduce_mean, any_process, barrier, resolve_device
from glasslm.core.layers import cross_entropy
from glasslm.training.optim import clip_grad_norm, cosine_schedule, make_optimizer
from glasslm.training.loggers import METRICS_FILE, JSONLLogger, MetricsLogger
from glasslm.core.model import TransformerLM
from glasslm.training.rundir import RunDirError, claim_run_dir
from glasslm.training.config import TrainConfig
from glasslm.training.trainer_state import (
    TRAINER_STATE_JSON, TRAINER_STATE_TENSORS, ResumePoint, load_resume_point, seed_processes, trainer_state_files,
)

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


def autocast_context(cfg: TrainConfig, device: str | None = None):
    """bf16/fp16 autocast for the forward pass (matmuls in low precision, reductions in fp32)."""
    if cfg.dtype == "float32":
        return nullcontext()
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float16
    return torch.autocast(device_type=torch.device(device or resolve_device(cfg.device)).type, dtype=dtype)


def rank_slice(batch: Tensor, rank: int, world_size: int) -> Tensor:
    """Process `rank`'s contiguous share of a global batch (rows)."""
    return batch.tensor_split(world_size)[rank]


def forward_backward(
    model: nn.Module, x: Int[Tensor, "b t"], y: Int[Tensor, "b t"], accum_steps: int,
    autocast=nullcontext, scaler: torch.amp.GradScaler | None = None, no_sync: Callable | None = None,
) -> Tensor:
    """Accumulate the gradient of the mean loss over all rows of (x, y) in `accum_steps` chunks.

    Each chunk's loss is divided by accum_steps, so the summed gradient equals the gradient of
    one big batch (chunks must be equal-sized). Returns the (detached) mean loss.
    `no_sync` (DDP's) skips the gradient all-reduce on every chunk but the last.
    """
    total: Tensor | None = None
    for i, (xc, yc) in enumerate(zip(x.tensor_split(accum_steps), y.tensor_split(accum_steps))):
        sync = no_sync() if no_sync is not None and i < accum_steps - 1 else nullcontext()
        with sync:
            with autocast():
                loss = cross_entropy(model(xc), yc) / accum_steps
            (scaler.scale(loss) if scaler is not None else loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
    assert total is not None
    return total


@torch.no_grad()
def evaluate(
    model: nn.Module, tokens: Tensor, cfg: TrainConfig, generator: torch.Generator | None = None,
    ctx: DistributedContext | None = None, device: str | None = None,
) -> float:
    """Mean loss over cfg.eval_iters batches of validation windows.

    With no generator the batches come from a fresh generator seeded with seed + 1, i.e. the
    same windows at every evaluation: the curve then shows the model changing, not the sample.
    Each process takes its slice of each global batch, so the mean matches a single process.
    """
    ctx = ctx or DistributedContext()
    device = device or resolve_device(cfg.device)
    generator = generator or torch.Generator().manual_seed(cfg.seed + 1)
    context_length = _config_of(model).context_length
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    for _ in range(cfg.eval_iters):
        x, y = get_batch(tokens, cfg.batch_size * ctx.world_size, context_length, generator=generator)
        x, y = rank_slice(x, ctx.rank, ctx.world_size).to(device), rank_slice(y, ctx.rank, ctx.world_size).to(device)
        with autocast_context(cfg, device):
            total += cross_entropy(model(x), y).float()
    model.train(was_training)
    return all_reduce_mean(total / cfg.eval_iters, ctx).item()


def _config_of(model: nn.Module) -> ModelConfig:
    while not hasattr(model, "config"):  # unwrap DDP (.module) and torch.compile (._orig_mod)
        model = getattr(model, "module", None) or model._orig_mod
    return model.config


@dataclass
class TrainResult:
    model: TransformerLM
    train_losses: list[float] = field(default_factory=list)  # one per step run in this call
    val_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)
    tokens_per_second: float = 0.0
    step: int = 0  # optimizer steps done, counting those before a resume
    best_val_loss: float = math.inf
    checkpoint: Path | None = None  # the last checkpoint written
    stopped_by_signal: int | None = None  # SIGINT/SIGTERM number if the run was interrupted


class _StopRequest:
    """Turns SIGINT/SIGTERM into a flag the loop checks after each step (to checkpoint first).

    A second SIGINT stops at once (KeyboardInterrupt), except while a checkpoint is being saved:
    then it only says it will stop when the checkpoint is complete, so pointers never name a
    half-written or half-replaced checkpoint. (A save that hangs still yields to SIGKILL.)
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._saving = False

    def __enter__(self) -> "_StopRequest":
        if threading.current_thread() is threading.main_thread():  # signal handlers need the main thread
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
        elif self._saving:
            print("saving a checkpoint; stopping as soon as it is complete", file=sys.stderr, flush=True)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt

    @contextmanager
    def saving(self):
        self._saving = True
        try:
            yield
        finally:
            self._saving = False

    def requested(self, ctx: DistributedContext, log_step: bool) -> int | None:
        """The signal to stop for, if any process got one (then every process stops at this step).

        Processes compare notes only at log steps: an all-reduce + `.item()` on every step would be
        a host sync on the hot path."""
        if not ctx.enabled:
            return self.signum
        if not log_step:
            return None
        return (self.signum or signal.SIGTERM) if any_process(self.signum is not None, ctx) else None

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def keeps_global_rng(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run `fn` with torch's, Python's and NumPy's global generators put back afterwards.

    Training seeds them (dropout has no generator argument, so it draws from torch's), but the
    caller's own random stream must not be reset by calling a library function.
    """
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        python_state, numpy_state = random.getstate(), np.random.get_state()
        cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=cuda):
            try:
                return fn(*args, **kwargs)
            finally:
                random.setstate(python_state)
                np.random.set_state(numpy_state)
    return wrapper


@keeps_global_rng
def train(
    model_config: ModelConfig | TransformerLM,
    cfg: TrainConfig,
    train_tokens: Int[Tensor, "n"],
    val_tokens: Int[Tensor, "m"] | None = None,
    on_eval: Callable[[int, float, TransformerLM], None] | None = None,
    *,
    run_dir: str | os.PathLike | None = None,
    resume: str | os.PathLike | None = None,
    tokenizer: Any | None = None,
    meta: dict[str, Any] | None = None,
    dist_ctx: DistributedContext | None = None,
    loggers: list[MetricsLogger] | None = None,
    overwrite: bool = False,
) -> TrainResult:
    """Train a model (or a fresh one from a config) on 1-D token ids (anything `get_batch` indexes).

    With `run_dir`, checkpoints (ckpt-NNNNNN/ plus `latest` and `best` pointers) and
    metrics.jsonl are written there. `resume` (a run or checkpoint directory) continues a run
    exactly where its checkpoint left off, on the learning-rate schedule it had (see
    `schedule_end`). `dist_ctx` comes from `init_distributed()` under torchrun.

    A `run_dir` that already holds files is refused unless it is the resumed run's own directory
    or `overwrite` is set (which removes the previous run's files first); while training, the
    directory is locked against a second writer (glasslm.training.rundir).
    """
    ctx = dist_ctx or DistributedContext(device=resolve_device(cfg.device))
    resume_dir = resolve_checkpoint(resume, prefer=("latest",)) if resume is not None else None
    with claim_run(run_dir, resume_dir, overwrite, ctx):
        return _train(model_config, cfg, train_tokens, val_tokens, on_eval, run_dir, resume_dir, tokenizer,
                      meta, ctx, loggers)


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
    model_config: ModelConfig | TransformerLM, cfg: TrainConfig, train_tokens: Tensor, val_tokens: Tensor | None,
    on_eval: Callable[[int, float, TransformerLM], None] | None, run_dir: str | os.PathLike | None,
    resume_dir: Path | None, tokenizer: Any, meta: dict[str, Any] | None, ctx: DistributedContext,
    loggers: list[MetricsLogger] | None,
) -> TrainResult:
    """The loop: one `train_step` per step; the metrics window, the evaluator and the checkpointer
    each decide when they have something to do."""
    device = ctx.device if ctx.enabled else resolve_device(cfg.device)
    if cfg.dtype == "float16" and torch.device(device).type != "cuda":
        raise ValueError("dtype float16 (with loss scaling) is for CUDA GPUs; use bfloat16 on CPU")
    parts = _Parts.build(model_config, cfg, ctx, device, resume_dir, (train_tokens, val_tokens))
    cfg, point = parts.cfg, parts.point
    run_path = Path(run_dir) if run_dir is not None else None
    result = TrainResult(parts.model, step=point.step, best_val_loss=point.best_val_loss)
    tokens_per_step = cfg.batch_size * cfg.grad_accum_steps * ctx.world_size * parts.model.config.context_length
    window = MetricsWindow(cfg, ctx, tokens_per_step, point, result, parts.scaler is not None)
    evaluator = Evaluator(parts.eval_model, val_tokens, cfg, ctx, device, tokens_per_step, point.best_val_loss, result,
                          on_eval)
    checkpointer = Checkpointer(run_path, cfg, ctx, parts, tokenizer, meta, result)
    loggers = _metrics_loggers(run_path, loggers, ctx, point.step if resume_dir else None)
    bar = tqdm(total=cfg.max_steps, initial=point.step, disable=not (cfg.progress and ctx.is_main),
               dynamic_ncols=True, desc="train", mininterval=1.0)
    try:
        with _StopRequest() as stop:
            for step in range(point.step, cfg.max_steps):
                started = time.perf_counter()
                lr = apply_schedule(parts.optimizer, cfg, step)
                loss, grad_norm = train_step(parts, *parts.next_batch(train_tokens))
                done = result.step = step + 1
                window.add(loss, grad_norm, time.perf_counter() - started)
                bar.update(1)
                last = done == cfg.max_steps
                logging = done % cfg.log_interval == 0 or last
                stop_signal = stop.requested(ctx, logging)
                evaluating = evaluator.due(done, last)
                saving = checkpointer.due(done, last, stop_signal is not None, evaluating)
                if not (logging or evaluating or saving):
                    continue
                window.flush(done, checkpointer.last)
                record = window.record(done, lr, bar) if logging else {}
                if evaluating:
                    record |= evaluator.run(done, bar)
                if record and ctx.is_main:
                    for logger in loggers:
                        logger.log(record)
                if saving:
                    with stop.saving():  # a second Ctrl-C now waits for the checkpoint to be complete
                        checkpointer.save(done, evaluator, window)
                if stop_signal is not None:
                    result.stopped_by_signal = stop_signal
                    if ctx.is_main and cfg.progress:
                        bar.write(f"stopped by signal {signal.Signals(stop_signal).name} after step {done}; "
                                  f"checkpoint: {result.checkpoint}")
                    break
    finally:
        bar.close()
        for logger in loggers:
            logger.close()
    return result


def _metrics_loggers(run_path: Path | None, loggers: list[MetricsLogger] | None, ctx: DistributedContext,
                     resumed_at: int | None) -> list[MetricsLogger]:
    """metrics.jsonl (cut back to the resumed step) first, then any others; only the main process logs."""
    loggers = list(loggers or [])
    if run_path is not None and ctx.is_main:
        remove_stale_staging(run_path)  # safe: the run directory is locked (see train)
        loggers.insert(0, JSONLLogger(run_path / METRICS_FILE, keep_up_to_step=resumed_at))
    return loggers


@dataclass
class _Parts:
    """What the loop works with: the model (and its DDP/FSDP/compiled wrappers), the optimizer,
    the loss scaler, the batch sampler, and where the run stands (fresh or resumed)."""

    cfg: TrainConfig
    ctx: DistributedContext
    device: str
    model: TransformerLM
    step_model: nn.Module  # what the step runs: DDP- or FSDP-wrapped, maybe compiled
    eval_model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    batch_rng: torch.Generator
    point: ResumePoint
    fsdp: bool

    @classmethod
    def build(cls, model_config: ModelConfig | TransformerLM, cfg: TrainConfig, ctx: DistributedContext, device: str,
              resume_dir: Path | None, data: tuple[Tensor, Tensor | None]) -> "_Parts":
        torch.manual_seed(cfg.seed)  # every process builds identical initial weights
        model = model_config if isinstance(model_config, TransformerLM) else TransformerLM(model_config)
        if cfg.init_from and resume_dir is None and not isinstance(model_config, TransformerLM):
            from glasslm.hf import init_weights_from

            init_weights_from(model, cfg.init_from)
        model.to(device).train()
        context = model.config.context_length
        for name, tokens in zip(("training", "validation"), data):
            if tokens is not None and len(tokens) <= context:
                raise ValueError(f"{name} data has {len(tokens)} tokens; need more than context_length={context}")
        batch_rng = seed_processes(cfg.seed, ctx.rank)
        if resume_dir is not None:
            if load_config(resume_dir / "config.json") != model.config:
                raise ValueError(f"{resume_dir} holds a different model config than the one to train")
            load_weights(model, read_safetensors(resume_dir / "model.safetensors", device), str(resume_dir))
        fsdp = cfg.fsdp and ctx.enabled
        step_model, eval_model = _wrap(model, cfg, ctx, device, fsdp)
        optimizer = make_optimizer(model, cfg, fused=not fsdp)
        scaler = torch.amp.GradScaler(torch.device(device).type) if cfg.dtype == "float16" else None
        point = ResumePoint()
        if resume_dir is not None:
            _load_optimizer(model, optimizer, resume_dir, fsdp)
            point = load_resume_point(resume_dir, batch_rng, ctx)
            if scaler is not None and point.grad_scaler:
                scaler.load_state_dict(point.grad_scaler)
            # The run's schedule goes on (see schedule_end), saved explicitly so a later resume keeps it too.
            cfg = dataclasses.replace(cfg, lr_decay_steps=schedule_end(cfg, point.train_config))
        return cls(cfg, ctx, device, model, step_model, eval_model, optimizer, scaler, batch_rng, point, fsdp)

    def next_batch(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """This process's slice of the step's global batch (see the module docstring)."""
        cfg, ctx = self.cfg, self.ctx
        x, y = get_batch(tokens, cfg.batch_size * cfg.grad_accum_steps * ctx.world_size,
                         self.model.config.context_length, generator=self.batch_rng)
        x = rank_slice(x, ctx.rank, ctx.world_size).to(self.device, non_blocking=True)
        return x, rank_slice(y, ctx.rank, ctx.world_size).to(self.device, non_blocking=True)


def _wrap(model: TransformerLM, cfg: TrainConfig, ctx: DistributedContext, device: str,
          fsdp: bool) -> tuple[nn.Module, nn.Module]:
    """(model to step, model to evaluate): FSDP2 or DDP across processes, then maybe compiled."""
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:  # one all-gather per block keeps peak memory at one block's weights
            fully_shard(block)
        fully_shard(model)
        step_model: nn.Module = model
    elif ctx.enabled:
        cuda = torch.device(device).type == "cuda"
        step_model = nn.parallel.DistributedDataParallel(model, device_ids=[device] if cuda else None)
    else:
        step_model = model
    if cfg.compile:
        step_model = torch.compile(step_model)
    return step_model, step_model if cfg.compile and not ctx.enabled else model  # reuse the compiled graph


def apply_schedule(optimizer: torch.optim.Optimizer, cfg: TrainConfig, step: int) -> float:
    """Set every group's rate for `step`: its peak (`initial_lr`, else cfg.lr) times the schedule's
    fraction of cfg.lr, so Muon's and AdamW's groups warm up and decay together. Returns cfg.lr's value."""
    lr = scheduled_lr(cfg, step)
    for group in optimizer.param_groups:
        group["lr"] = group.get("initial_lr", cfg.lr) * (lr / cfg.lr if cfg.lr > 0 else 0.0)
    return lr


def train_step(parts: _Parts, x: Int[Tensor, "b t"], y: Int[Tensor, "b t"]) -> tuple[Tensor, Tensor]:
    """One optimizer step on this process's batch: (mean loss, global gradient norm), both still
    on the device (reading them would wait for the step to finish)."""
    cfg, model, optimizer, scaler = parts.cfg, parts.model, parts.optimizer, parts.scaler
    ddp = parts.step_model if isinstance(parts.step_model, nn.parallel.DistributedDataParallel) else None
    loss = forward_backward(parts.step_model, x, y, cfg.grad_accum_steps,
                            lambda: autocast_context(cfg, parts.device), scaler, ddp.no_sync if ddp else None)
    if scaler is not None:
        scaler.unscale_(optimizer)  # clip the true gradient, not the scaled one
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    if parts.fsdp:  # sharded (DTensor) gradients: torch's clipping reduces the norm across shards
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
    else:
        grad_norm = clip_grad_norm(model.parameters(), max_norm)
    if scaler is not None:
        scaler.step(optimizer)  # skips the step if the gradient is not finite
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor, already reduced over shards
        grad_norm = grad_norm.full_tensor()
    return loss, grad_norm.detach().float().to(loss.device)


class MetricsWindow:
    """Per-step losses between two metrics records: kept on the device until a log, eval or
    checkpoint step needs them (one host sync then), checked for non-finite values, averaged."""

    def __init__(self, cfg: TrainConfig, ctx: DistributedContext, tokens_per_step: int, point: ResumePoint,
                 result: TrainResult, loss_scaling: bool):
        self.cfg, self.ctx, self.tokens_per_step, self.result = cfg, ctx, tokens_per_step, result
        self.loss_scaling = loss_scaling  # fp16: an infinite gradient only skips its step
        self.pending: list[tuple[Tensor, Tensor]] = []
        self.losses: list[float] = list(point.log_window_losses)  # resumed mid-window: its earlier steps
        self.grad_norm = math.nan
        self.seconds, self.steps_timed, self.total_seconds = 0.0, 0, 0.0
        self.clock_start, self.elapsed_before = time.perf_counter(), point.elapsed_s

    def add(self, loss: Tensor, grad_norm: Tensor, seconds: float) -> None:
        self.pending.append((loss, grad_norm))
        self.seconds += seconds
        self.steps_timed += 1

    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.clock_start

    def flush(self, done: int, last_checkpoint: Path | None) -> None:
        """Bring pending losses to the host and stop on a non-finite loss or gradient norm."""
        if not self.pending:
            return
        losses = all_reduce_mean(torch.stack([loss for loss, _ in self.pending]), self.ctx).tolist()
        norms = torch.stack([norm for _, norm in self.pending]).tolist()
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
        bar.set_postfix(loss=f"{self.losses[-1]:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:,.0f}",
                        refresh=False)  # redrawn at tqdm's own pace
        self.losses.clear()
        self.seconds, self.steps_timed = 0.0, 0
        return record


class Evaluator:
    """Validation loss every `eval_interval` steps and at the end; keeps the best one."""

    def __init__(self, model: nn.Module, tokens: Tensor | None, cfg: TrainConfig, ctx: DistributedContext,
                 device: str, tokens_per_step: int, best: float, result: TrainResult,
                 on_eval: Callable[[int, float, TransformerLM], None] | None):
        self.model, self.tokens, self.cfg, self.ctx, self.device = model, tokens, cfg, ctx, device
        self.tokens_per_step, self.best, self.result, self.on_eval = tokens_per_step, best, result, on_eval
        self.last: float | None = None  # the latest validation loss
        self.improved_at: int | None = None  # the step whose evaluation set the current best

    def due(self, done: int, last: bool) -> bool:
        interval = self.cfg.eval_interval
        return self.tokens is not None and (last or (interval > 0 and done % interval == 0))

    def run(self, done: int, bar: Any) -> dict[str, Any]:
        """Evaluate now; returns the fields it adds to the step's metrics record."""
        assert self.tokens is not None
        loss = self.last = evaluate(self.model, self.tokens, self.cfg, ctx=self.ctx, device=self.device)
        self.result.val_losses.append((done, loss))
        if loss < self.best:
            self.improved_at = done
        self.best = self.result.best_val_loss = min(self.best, loss)
        if self.ctx.is_main and self.cfg.progress:
            bar.write(f"step {done}: train loss {self.result.train_losses[-1]:.4f}, val loss {loss:.4f}")
        if self.on_eval is not None:
            self.on_eval(done, loss, self.result.model)
        return {"step": done, "tokens": done * self.tokens_per_step, "val_loss": loss,
                "val_ppl": math.exp(min(loss, 50.0))}


class Checkpointer:
    """Saves at every evaluation, every `checkpoint_interval` steps, at the end and when stopped
    by a signal, into the run directory (if any)."""

    def __init__(self, run_dir: Path | None, cfg: TrainConfig, ctx: DistributedContext, parts: _Parts,
                 tokenizer: Any, meta: dict[str, Any] | None, result: TrainResult):
        self.run_dir, self.cfg, self.ctx, self.parts = run_dir, cfg, ctx, parts
        self.tokenizer, self.meta, self.result = tokenizer, meta or {}, result

    @property
    def last(self) -> Path | None:
        return self.result.checkpoint

    def due(self, done: int, last: bool, stopping: bool, evaluating: bool) -> bool:
        interval = self.cfg.checkpoint_interval
        return self.run_dir is not None and (
            evaluating or last or stopping or (interval > 0 and done % interval == 0))

    def save(self, done: int, evaluator: Evaluator, window: MetricsWindow) -> None:
        assert self.run_dir is not None
        point = ResumePoint(step=done, best_val_loss=evaluator.best, elapsed_s=window.elapsed(),
                            log_window_losses=window.losses, train_config=self.cfg.to_dict(),
                            grad_scaler=self.parts.scaler.state_dict() if self.parts.scaler is not None else None)
        meta = {**self.meta, "step": done, "val_loss": evaluator.last}
        self.result.checkpoint = _save_training_checkpoint(self.run_dir, self.parts, point, self.tokenizer, meta,
                                                           is_best=evaluator.improved_at == done)


def _save_training_checkpoint(run_dir: Path, parts: _Parts, point: ResumePoint, tokenizer: Any,
                              meta: dict[str, Any], is_best: bool) -> Path:
    """Write ckpt-<step>/ with everything needed to continue bit for bit; point `latest` (and maybe
    `best`) at it; prune old ones. Collective: every process calls it, the main one writes.

    Pointers move only once the directory is complete. If writing fails (a full disk), the
    error names the previous checkpoint, which is untouched, and nothing half-written stays."""
    model_state, optim_state = _full_state_dicts(parts.model, parts.optimizer, parts.fsdp)
    state_tensors, state_json = trainer_state_files(point, parts.batch_rng, parts.ctx)
    target = run_dir / checkpoint_name(point.step)
    if parts.ctx.is_main:
        optim_tensors, optim_scalars = optimizer_state_to_files(optim_state)
        previous = read_pointer(run_dir, "latest")
        try:
            save_checkpoint(
                target, parts.model, tokenizer, meta, state_dict=model_state,
                extra_tensors={OPTIMIZER_FILE: optim_tensors, TRAINER_STATE_TENSORS: state_tensors},
                extra_json={OPTIMIZER_JSON: optim_scalars, TRAINER_STATE_JSON: state_json},
            )
            if is_best:  # `best` first: if `latest` then fails, what the error says about it is true
                write_pointer(run_dir, "best", target.name)
            write_pointer(run_dir, "latest", target.name)
        except CheckpointWriteError as err:
            kept = (f"the previous checkpoint {previous} is intact and `latest` still names it"
                    if previous is not None and previous.is_dir() else "no earlier checkpoint exists")
            raise CheckpointWriteError(f"{err}; {kept}") from None
        prune_checkpoints(run_dir, parts.cfg.keep_last)
    barrier(parts.ctx)
    return target


def _full_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer, fsdp: bool) -> tuple[dict, dict]:
    if not fsdp:
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
    )

    # Gather the shards into whole tensors on the CPU of every process (small models only need this).
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, optimizer, options=options)


def _load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path, fsdp: bool) -> None:
    state = load_optimizer_state(directory)
    if not fsdp:
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `glasslm train` (python -m glasslm.cli train)")
