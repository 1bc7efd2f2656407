"""The training loop: AdamW, warmup + cosine learning rate, clipping, accumulation, mixed precision,
periodic validation, checkpoints that resume exactly, and data parallelism.

Example (a few steps on a toy corpus):
    >>> import torch
    >>> from glasslm.config import get_preset
    >>> from glasslm.train import TrainConfig, train
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
import warnings
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
import torch
from jaxtyping import Int
from torch import Tensor, nn
from tqdm.auto import tqdm

from .checkpoint import (
    OPTIMIZER_FILE, OPTIMIZER_JSON, CheckpointWriteError, checkpoint_name, load_config, load_optimizer_state,
    load_weights, optimizer_state_to_files, prune_checkpoints, read_json, read_pointer, read_safetensors,
    remove_stale_staging, resolve_checkpoint, save_checkpoint, write_pointer,
)
from .config import ModelConfig
from .data import get_batch
from .distributed import DistributedContext, all_reduce_mean, any_process, barrier, gather_objects, resolve_device
from .layers import cross_entropy
from .loggers import METRICS_FILE, JSONLLogger, MetricsLogger
from .model import TransformerLM
from .rundir import RunDirError, claim_run_dir
from .schema import checked

TRAINER_STATE_JSON = "trainer_state.json"
TRAINER_STATE_TENSORS = "trainer_state.safetensors"
DType = Literal["float32", "bfloat16", "float16"]


@dataclass
class TrainConfig:
    """Everything about a run that is not the architecture. Saved (as JSON) with every checkpoint."""

    max_steps: int = 2000  # optimizer steps in the whole run (a resumed run continues up to it)
    batch_size: int = 12  # sequences per micro-batch per process
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    lr: float = 1e-3  # peak learning rate, reached at the end of warmup
    min_lr: float = 1e-4  # learning rate at the end of the cosine decay, and after it
    warmup_steps: int = 100  # steps of linear warmup to lr
    lr_decay_steps: int | None = None  # step where the cosine decay ends; None (or 0): max_steps
    beta1: float = 0.9  # AdamW's decay rate of the gradient's running mean
    beta2: float = 0.99  # AdamW's decay rate of the squared gradient's running mean
    weight_decay: float = 0.1  # AdamW's decoupled weight decay, on matrices only
    decay_embeddings: bool = False  # also decay token/position embeddings (nanoGPT does)
    grad_clip: float = 1.0  # max global L2 norm of the gradient; 0 disables clipping
    eval_interval: int = 250  # steps between validation runs; 0: only at the end
    eval_iters: int = 20  # validation batches per evaluation (the same batches every time)
    log_interval: int = 10  # steps between metrics records (JSONL) and progress-bar updates
    checkpoint_interval: int = 0  # steps between extra checkpoints; 0: only at evaluations and the end
    keep_last: int = 2  # numbered checkpoints kept (plus the best one); 0 keeps all
    seed: int = 1337  # seeds the initial weights, the batch order and dropout
    device: str = "auto"  # auto: the best available (cuda, else mps, else cpu; cuda:LOCAL_RANK under torchrun), or cpu, cuda, cuda:1, mps
    dtype: DType = "float32"  # bfloat16/float16: autocast the forward pass; weights stay float32
    compile: bool = False  # torch.compile the model (measured no faster on CPU; see docs/training.md)
    threads: int = 0  # CPU intra-op threads, set by `glasslm train` (train() leaves it to the caller); 0: torch's
    fsdp: bool = False  # shard parameters, gradients and optimizer state (FSDP2) instead of DDP
    tensorboard: bool = False  # also log metrics to TensorBoard (RUN_DIR/tensorboard; needs tensorboard)
    wandb: bool = False  # also log metrics to Weights & Biases, offline unless WANDB_MODE says otherwise
    progress: bool = True  # draw a progress bar with loss, lr and tokens/s

    def __post_init__(self) -> None:
        for name in ("max_steps", "batch_size", "eval_iters", "grad_accum_steps", "log_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_interval", "checkpoint_interval", "keep_last", "threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need 0 <= min_lr <= lr, got min_lr={self.min_lr}, lr={self.lr}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be 'float32', 'bfloat16' or 'float16', got {self.dtype!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "TrainConfig") -> "TrainConfig":
        """From `to_dict`'s output (or JSON/TOML), type-checked; `where` names the source in errors."""
        return cls(**checked(cls, data, where))


# Each preset's training recipe lives beside its model in config.PRESETS (see config.get_recipe).


def lr_at(step: int, lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> float:
    """Learning rate for 0-based `step`: linear warmup to `lr`, cosine decay to `min_lr`, then flat.

    Warmup is (step + 1) / (warmup_steps + 1) of `lr` (nanoGPT's form): the very first step
    already learns (a zero learning rate would waste a batch), and the ramp reaches exactly `lr`
    at step == warmup_steps, where the cosine starts, so the curve is continuous.

    >>> [round(lr_at(s, 1.0, 0.1, warmup_steps=3, decay_steps=7), 3) for s in range(9)]
    [0.25, 0.5, 0.75, 1.0, 0.868, 0.55, 0.232, 0.1, 0.1]
    """
    if step < warmup_steps:
        return lr * (step + 1) / (warmup_steps + 1)
    if step >= decay_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def scheduled_lr(cfg: TrainConfig, step: int) -> float:
    """`cfg`'s learning rate at 0-based `step`; the one place lr_decay_steps None (or 0) means max_steps.

    >>> round(scheduled_lr(TrainConfig(max_steps=100, lr=1.0, min_lr=0.1, warmup_steps=0, lr_decay_steps=0), 50), 3)
    0.55
    """
    return lr_at(step, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.lr_decay_steps or cfg.max_steps)


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


def make_optimizer(model: nn.Module, cfg: TrainConfig, fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW; weight decay only on matrices that multiply activations (not norms, biases, and not
    embeddings unless cfg.decay_embeddings).

    The fused kernel updates every parameter in one pass (CPU and CUDA); sharded (DTensor)
    parameters use the foreach kernel instead, passing `fused=False`.
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_embedding = name.startswith(("embed.", "pos_embed."))
        wants_decay = p.dim() >= 2 and (cfg.decay_embeddings or not is_embedding)
        (decay if wants_decay else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = True if fused is None else fused
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused or None,
                             foreach=None if fused else True)


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
        x, y = get_batch(tokens, cfg.batch_size * ctx.world_size, context_length, generator)
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
    directory is locked against a second writer (glasslm.rundir).
    """
    ctx = dist_ctx or DistributedContext(device=resolve_device(cfg.device))
    resume_dir = resolve_checkpoint(resume, prefer=("latest",)) if resume is not None else None
    with claim_run(run_dir, resume_dir, overwrite, ctx):
        return _train(model_config, cfg, train_tokens, val_tokens, on_eval, run_dir, resume_dir, tokenizer,
                      meta, ctx, loggers)


@contextmanager
def claim_run(run_dir: str | os.PathLike | None, resume_dir: str | os.PathLike | None, overwrite: bool,
              ctx: DistributedContext):
    """Hold `run_dir` for training (glasslm.rundir.claim_run_dir) on the main process. Collective:
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
    device = ctx.device if ctx.enabled else resolve_device(cfg.device)
    device_type = torch.device(device).type
    if cfg.dtype == "float16" and device_type != "cuda":
        raise ValueError("dtype float16 (with loss scaling) is for CUDA GPUs; use bfloat16 on CPU")

    # Every process builds identical initial weights from the same seed.
    torch.manual_seed(cfg.seed)
    model = model_config if isinstance(model_config, TransformerLM) else TransformerLM(model_config)
    model.to(device).train()
    context = model.config.context_length
    for name, tokens in (("training", train_tokens), ("validation", val_tokens)):
        if tokens is not None and len(tokens) <= context:
            raise ValueError(f"{name} data has {len(tokens)} tokens; need more than context_length={context}")

    # Dropout masks differ per process; the batch sampler is shared (see the module docstring).
    torch.manual_seed(cfg.seed + ctx.rank)
    random.seed(cfg.seed + ctx.rank)
    np.random.seed((cfg.seed + ctx.rank) % 2**32)
    batch_rng = torch.Generator().manual_seed(cfg.seed)
    start_step, best_val_loss, elapsed_before = 0, math.inf, 0.0
    window_losses: list[float] = []  # per-step losses since the last metrics record
    if resume_dir is not None:
        saved_config = load_config(resume_dir / "config.json")
        if saved_config != model.config:
            raise ValueError(f"{resume_dir} holds a different model config than the one to train")
        load_weights(model, read_safetensors(resume_dir / "model.safetensors", device), str(resume_dir))

    fsdp = cfg.fsdp and ctx.enabled
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:  # one all-gather per block keeps peak memory at one block's weights
            fully_shard(block)
        fully_shard(model)
        step_model: nn.Module = model
    elif ctx.enabled:
        step_model = nn.parallel.DistributedDataParallel(model, device_ids=[device] if device_type == "cuda" else None)
    else:
        step_model = model
    if cfg.compile:
        step_model = torch.compile(step_model)
    eval_model = step_model if cfg.compile and not ctx.enabled else model  # reuse the compiled graph
    no_sync = step_model.no_sync if isinstance(step_model, nn.parallel.DistributedDataParallel) else None

    optimizer = make_optimizer(model, cfg, fused=not fsdp)
    scaler = torch.amp.GradScaler(device_type) if cfg.dtype == "float16" else None
    if resume_dir is not None:
        state = read_json(resume_dir / TRAINER_STATE_JSON)
        tensors = read_safetensors(resume_dir / TRAINER_STATE_TENSORS)
        _load_optimizer(model, optimizer, resume_dir, fsdp)
        start_step, best_val_loss, elapsed_before = state["step"], state["best_val_loss"], state["elapsed_s"]
        # The losses of a metrics window a checkpoint cut in two, so the record closing that
        # window averages the same steps as in an uninterrupted run.
        window_losses = [float(v) for v in state.get("log_window_losses", [])]
        if scaler is not None and state.get("grad_scaler"):
            scaler.load_state_dict(state["grad_scaler"])
        _restore_rng(state, tensors, batch_rng, ctx)
        # The run's schedule goes on (see schedule_end), saved explicitly so a later resume keeps it too.
        cfg = dataclasses.replace(cfg, lr_decay_steps=schedule_end(cfg, state.get("train_config")))
    global_batch = cfg.batch_size * cfg.grad_accum_steps * ctx.world_size
    tokens_per_step = global_batch * context
    autocast = lambda: autocast_context(cfg, device)  # noqa: E731 (a fresh context per micro-batch)

    run_path = Path(run_dir) if run_dir is not None else None
    loggers = list(loggers or [])
    if run_path is not None and ctx.is_main:
        remove_stale_staging(run_path)  # safe: the run directory is locked (see train)
        loggers.insert(0, JSONLLogger(run_path / METRICS_FILE, keep_up_to_step=start_step if resume_dir else None))
    result = TrainResult(model, step=start_step, best_val_loss=best_val_loss)
    pending_losses: list[Tensor] = []  # per-step losses still on the device (no sync per step)
    pending_norms: list[Tensor] = []
    window_steps = 0  # steps timed by this process in the current window (resumed ones were not)
    last_grad_norm = math.nan
    last_val_loss: float | None = None

    def flush_pending(done: int) -> None:
        """Bring pending losses to the host (one sync) and stop on a non-finite loss or gradient."""
        nonlocal last_grad_norm
        if not pending_losses:
            return
        losses = all_reduce_mean(torch.stack(pending_losses), ctx).tolist()
        norms = torch.stack(pending_norms).tolist()
        first = done - len(losses) + 1  # steps are counted from 1, as in the metrics log
        for i, (loss, norm) in enumerate(zip(losses, norms)):
            # Under fp16 loss scaling an infinite gradient just skips that step, so it is not an error.
            if not math.isfinite(loss) or (scaler is None and not math.isfinite(norm)):
                kept = result.checkpoint or "none written"
                raise FloatingPointError(
                    f"training stopped at step {first + i}: loss {loss}, gradient norm {norm} is not finite "
                    f"(lower the learning rate?). Last good checkpoint: {kept}")
        result.train_losses.extend(losses)
        window_losses.extend(losses)
        last_grad_norm = norms[-1]
        pending_losses.clear()
        pending_norms.clear()

    bar = tqdm(total=cfg.max_steps, initial=start_step, disable=not (cfg.progress and ctx.is_main),
               dynamic_ncols=True, desc="train", mininterval=1.0)
    clock_start = time.perf_counter()
    window_start, window_train_time = time.perf_counter(), 0.0
    total_train_time = 0.0
    try:
        with _StopRequest() as stop:
            for step in range(start_step, cfg.max_steps):
                step_start = time.perf_counter()
                lr = scheduled_lr(cfg, step)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                x, y = get_batch(train_tokens, global_batch, context, batch_rng)
                x = rank_slice(x, ctx.rank, ctx.world_size).to(device, non_blocking=True)
                y = rank_slice(y, ctx.rank, ctx.world_size).to(device, non_blocking=True)
                loss = forward_backward(step_model, x, y, cfg.grad_accum_steps, autocast, scaler, no_sync)
                if scaler is not None:
                    scaler.unscale_(optimizer)  # clip the true gradient, not the scaled one
                max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
                grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
                if scaler is not None:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                pending_losses.append(loss)
                if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor, already reduced over shards
                    grad_norm = grad_norm.full_tensor()
                pending_norms.append(grad_norm.detach().float().to(loss.device))
                done = result.step = step + 1
                window_train_time += time.perf_counter() - step_start
                window_steps += 1
                bar.update(1)

                last = done == cfg.max_steps
                is_log = done % cfg.log_interval == 0 or last
                # Processes must agree to stop together; they compare notes only at log steps, as
                # an all-reduce + .item() on every step would be a host sync on the hot path.
                stop_signal = stop.signum if not ctx.enabled else (
                    stop.signum or signal.SIGTERM if is_log and any_process(stop.signum is not None, ctx) else None)
                is_eval = val_tokens is not None and (last or (cfg.eval_interval > 0 and done % cfg.eval_interval == 0))
                is_checkpoint = run_path is not None and (
                    is_eval or last or stop_signal is not None
                    or (cfg.checkpoint_interval > 0 and done % cfg.checkpoint_interval == 0))
                if not (is_log or is_eval or is_checkpoint):
                    continue
                flush_pending(done)
                record: dict[str, Any] = {}
                if is_log:
                    total_train_time += window_train_time
                    tokens_per_s = tokens_per_step * window_steps / max(window_train_time, 1e-9)
                    result.tokens_per_second = tokens_per_step * len(result.train_losses) / max(total_train_time, 1e-9)
                    record = {
                        "step": done, "tokens": done * tokens_per_step,
                        "train_loss": sum(window_losses) / len(window_losses), "lr": lr,
                        "grad_norm": last_grad_norm, "tokens_per_s": tokens_per_s,
                        "elapsed_s": elapsed_before + time.perf_counter() - clock_start,
                    }
                    bar.set_postfix(loss=f"{window_losses[-1]:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:,.0f}",
                                    refresh=False)  # redrawn at tqdm's own pace
                    window_losses.clear()
                    window_train_time, window_steps = 0.0, 0
                improved = False
                if is_eval:
                    assert val_tokens is not None
                    last_val_loss = evaluate(eval_model, val_tokens, cfg, ctx=ctx, device=device)
                    result.val_losses.append((done, last_val_loss))
                    improved = last_val_loss < best_val_loss
                    best_val_loss = min(best_val_loss, last_val_loss)
                    result.best_val_loss = best_val_loss
                    record.update(step=done, tokens=done * tokens_per_step, val_loss=last_val_loss,
                                  val_ppl=math.exp(min(last_val_loss, 50.0)))
                    if ctx.is_main and cfg.progress:
                        bar.write(f"step {done}: train loss {result.train_losses[-1]:.4f}, val loss {last_val_loss:.4f}")
                    if on_eval is not None:
                        on_eval(done, last_val_loss, model)
                if record and ctx.is_main:
                    for logger in loggers:
                        logger.log(record)
                if is_checkpoint:
                    assert run_path is not None
                    elapsed = elapsed_before + time.perf_counter() - clock_start
                    with stop.saving():  # a second Ctrl-C now waits for the checkpoint to be complete
                        result.checkpoint = _save_training_checkpoint(
                            run_path, done, model, optimizer, scaler, batch_rng, cfg, ctx, tokenizer,
                            {**(meta or {}), "step": done, "val_loss": last_val_loss},
                            best_val_loss, elapsed, improved, fsdp, window_losses)
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


def _save_training_checkpoint(
    run_dir: Path, step: int, model: TransformerLM, optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None, batch_rng: torch.Generator, cfg: TrainConfig, ctx: DistributedContext,
    tokenizer: Any, meta: dict[str, Any], best_val_loss: float, elapsed: float, is_best: bool, fsdp: bool,
    window_losses: list[float] = (),  # type: ignore[assignment]
) -> Path:
    """Write ckpt-<step>/ with everything needed to continue bit for bit; point `latest` (and maybe
    `best`) at it; prune old ones. Collective: every process calls it, the main one writes.

    Pointers move only once the directory is complete. If writing fails (a full disk), the
    error names the previous checkpoint, which is untouched, and nothing half-written stays."""
    model_state, optim_state = _full_state_dicts(model, optimizer, fsdp)
    torch_rng_states = gather_objects(torch.get_rng_state(), ctx)
    cuda_rng_states = gather_objects(torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [], ctx)
    target = run_dir / checkpoint_name(step)
    if ctx.is_main:
        tensors: dict[str, Tensor] = {"rng.batch_sampler": batch_rng.get_state()}
        for rank, state in enumerate(torch_rng_states):
            tensors[f"rng.torch.rank{rank}"] = state  # type: ignore[assignment]
        for rank, states in enumerate(cuda_rng_states):
            for i, state in enumerate(states):  # type: ignore[arg-type]
                tensors[f"rng.cuda.rank{rank}.device{i}"] = state
        np_state = np.random.get_state()
        trainer_state = {
            "format": 1, "step": step, "best_val_loss": best_val_loss, "elapsed_s": elapsed,
            "world_size": ctx.world_size, "train_config": cfg.to_dict(),
            "rng_python": _jsonable(random.getstate()),
            "rng_numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
            "grad_scaler": scaler.state_dict() if scaler is not None else None,
            "log_window_losses": list(window_losses),  # JSON floats round-trip exactly
        }
        optim_tensors, optim_scalars = optimizer_state_to_files(optim_state)
        previous = read_pointer(run_dir, "latest")
        try:
            save_checkpoint(
                target, model, tokenizer, meta, state_dict=model_state,
                extra_tensors={OPTIMIZER_FILE: optim_tensors, TRAINER_STATE_TENSORS: tensors},
                extra_json={OPTIMIZER_JSON: optim_scalars, TRAINER_STATE_JSON: trainer_state},
            )
            if is_best:  # `best` first: if `latest` then fails, what the error says about it is true
                write_pointer(run_dir, "best", target.name)
            write_pointer(run_dir, "latest", target.name)
        except CheckpointWriteError as err:
            kept = (f"the previous checkpoint {previous} is intact and `latest` still names it"
                    if previous is not None and previous.is_dir() else "no earlier checkpoint exists")
            raise CheckpointWriteError(f"{err}; {kept}") from None
        prune_checkpoints(run_dir, cfg.keep_last)
    barrier(ctx)
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


def _jsonable(obj: Any) -> Any:
    return [_jsonable(x) for x in obj] if isinstance(obj, (tuple, list)) else obj


def _restore_rng(state: dict[str, Any], tensors: dict[str, Tensor], batch_rng: torch.Generator,
                 ctx: DistributedContext) -> None:
    """Put every random number generator back where the checkpoint found it."""
    batch_rng.set_state(tensors["rng.batch_sampler"])
    if state.get("world_size", 1) != ctx.world_size:
        warnings.warn(f"checkpoint was written by {state['world_size']} processes, resuming with "
                      f"{ctx.world_size}: data order is unchanged for the same global batch, dropout masks differ")
    own = tensors.get(f"rng.torch.rank{ctx.rank}")
    if own is not None:
        torch.set_rng_state(own)
    cuda_states = [tensors[k] for k in sorted(tensors) if k.startswith(f"rng.cuda.rank{ctx.rank}.")]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states)
    version, internal, gauss = state["rng_python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["rng_numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `glasslm train` (python -m glasslm.cli train)")
