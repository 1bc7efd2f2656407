"""Training checkpoints: when to save, what a resumable checkpoint holds beyond the weights (the
optimizer, the trainer state), whole state dicts from FSDP shards, and reading them back.

A checkpoint is a glasslm checkpoint directory (glasslm.io.checkpoint: weights, config, meta,
tokenizer) plus the optimizer's files and the trainer state (glasslm.training.trainer_state).

Example (a run directory with nowhere to save is never due):
    >>> from glasslm.training.config import TrainConfig
    >>> from glasslm.training.distributed import DistributedContext
    >>> Checkpointer(None, TrainConfig(), DistributedContext(), None, None, None, None).due(10, True, False, True)
    False
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from glasslm.core.model import TransformerLM
from glasslm.io.build import load_weights
from glasslm.io.checkpoint import (
    ADAPTER_BASE_KEY, CONFIG_FILE, META_FILE, OPTIMIZER_FILE, OPTIMIZER_JSON, WEIGHTS_FILE, CheckpointWriteError,
    checkpoint_name, load_config, load_optimizer_state, optimizer_state_from_files, optimizer_state_to_files,
    prune_checkpoints, read_json, read_pointer, read_weights, save_checkpoint, staging_directory, write_pointer,
)
from glasslm.io.sharded import MODEL_PREFIX, OPTIMIZER_PREFIX, SHARDS_DIR, is_sharded_checkpoint
from glasslm.training.config import TrainConfig
from glasslm.training.distributed import DistributedContext, barrier, broadcast_object
from glasslm.training.evaluator import Evaluator
from glasslm.training.metrics import MetricsWindow
from glasslm.training.result import TrainResult
from glasslm.transforms.lora import load_lora_state_dict, lora_state_dict
from glasslm.training.trainer_state import (
    TRAINER_STATE_JSON, TRAINER_STATE_TENSORS, ResumePoint, trainer_state_files,
)

if TYPE_CHECKING:
    from glasslm.training.parts import TrainingParts


class Checkpointer:
    """Saves at every evaluation, every `checkpoint_interval` steps, at the end and when stopped
    by a signal, into the run directory (if any)."""

    def __init__(self, run_dir: Path | None, cfg: TrainConfig, ctx: DistributedContext, parts: TrainingParts,
                 tokenizer: Any, meta: dict[str, Any] | None, result: TrainResult, chat_template: str | None = None):
        self.run_dir, self.cfg, self.ctx, self.parts = run_dir, cfg, ctx, parts
        self.tokenizer, self.meta, self.result = tokenizer, meta or {}, result
        self.chat_template = chat_template  # kept in every checkpoint (chat_template.jinja)

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
                            evals_without_improvement=evaluator.without_improvement,
                            log_window_losses=window.losses, train_config=self.cfg.to_dict(),
                            grad_scaler=self.parts.scaler.state_dict() if self.parts.scaler is not None else None)
        meta = {**self.meta, "step": done, "val_loss": evaluator.last}
        self.result.checkpoint = save_training_checkpoint(self.run_dir, self.parts, point, self.tokenizer, meta,
                                                          is_best=evaluator.improved_at == done,
                                                          chat_template=self.chat_template)


def save_training_checkpoint(run_dir: Path, parts: TrainingParts, point: ResumePoint, tokenizer: Any,
                             meta: dict[str, Any], is_best: bool, chat_template: str | None = None) -> Path:
    """Write ckpt-<step>/ with everything needed to continue bit for bit; point `latest` (and maybe
    `best`) at it; prune old ones. Collective: every process calls it.

    Under torchrun every process writes its own shard of the weights and optimizer state
    (`write_shards`: torch.distributed.checkpoint); the main process writes the rest beside them.
    A single process writes whole tensors (model.safetensors, optimizer.safetensors), as always.
    Either way the checkpoint is staged in a hidden directory and renamed into place when complete;
    pointers move only after that. If writing fails (a full disk), the error names the previous
    checkpoint, which is untouched, and nothing half-written stays.

    With `meta` naming an adapter base (ADAPTER_BASE_KEY: a LoRA run), only the adapters'
    tensors are written, whole: the frozen base is the base checkpoint's, which loading re-reads."""
    state_tensors, state_json = trainer_state_files(point, parts.batch_rng, parts.ctx)
    target = run_dir / checkpoint_name(point.step)
    if parts.ctx.enabled and ADAPTER_BASE_KEY not in meta:
        staging, optim_scalars = write_shards(target, parts)
        files: dict[str, Any] = dict(staging=staging, extra_tensors={TRAINER_STATE_TENSORS: state_tensors})
    else:
        model_state, optim_state = _whole_state_dicts(parts, meta)
        optim_tensors, optim_scalars = optimizer_state_to_files(optim_state)
        files = dict(state_dict=model_state,
                     extra_tensors={OPTIMIZER_FILE: optim_tensors, TRAINER_STATE_TENSORS: state_tensors})
    files["extra_json"] = {OPTIMIZER_JSON: optim_scalars, TRAINER_STATE_JSON: state_json}
    if parts.ctx.is_main:
        _commit(run_dir, target, parts, tokenizer, meta, is_best, chat_template, files)
    barrier(parts.ctx)
    return target


def _whole_state_dicts(parts: TrainingParts, meta: dict[str, Any]) -> tuple[dict, dict]:
    """(model, optimizer) state dicts with whole tensors; of an adapter run, only the adapters' weights."""
    model_state, optim_state = full_state_dicts(parts.model, parts.optimizer, parts.fsdp)
    if ADAPTER_BASE_KEY in meta:
        adapters = lora_state_dict(parts.model)
        if not adapters:
            raise ValueError(f"meta[{ADAPTER_BASE_KEY!r}] is set but the model has no LoRA adapters to save")
        model_state = {name: model_state[name] for name in adapters}
    return model_state, optim_state


def _commit(run_dir: Path, target: Path, parts: TrainingParts, tokenizer: Any, meta: dict[str, Any],
            is_best: bool, chat_template: str | None, files: dict[str, Any]) -> None:
    """The main process: write the checkpoint (into place at once), move the pointers, prune."""
    previous = read_pointer(run_dir, "latest")
    try:
        save_checkpoint(target, parts.model, tokenizer, meta, chat_template=chat_template, **files)
        if is_best:  # `best` first: if `latest` then fails, what the error says about it is true
            write_pointer(run_dir, "best", target.name)
        write_pointer(run_dir, "latest", target.name)
    except CheckpointWriteError as err:
        kept = (f"the previous checkpoint {previous} is intact and `latest` still names it"
                if previous is not None and previous.is_dir() else "no earlier checkpoint exists")
        raise CheckpointWriteError(f"{err}; {kept}") from None
    prune_checkpoints(run_dir, parts.cfg.keep_last)


def write_shards(target: Path, parts: TrainingParts) -> tuple[Path, dict[str, Any]]:
    """Every process writes its part of the weights and optimizer state (FSDP2: its shards; DDP:
    DCP gives each replicated tensor to one process) into a new staging directory for `target`,
    as safetensors shards (glasslm.io.sharded). Returns (the staging directory, the optimizer's
    param groups and non-tensor state for optimizer.json). Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    staging = broadcast_object(staging_directory(target) if parts.ctx.is_main else None, parts.ctx)
    # The model's first: its state-dict hook reshards FSDP2's root parameters, which an evaluation's
    # forward (with no backward after it) leaves gathered, and the optimizer holds the shards.
    model_state = get_model_state_dict(parts.model)
    optim_tensors, optim_scalars = optimizer_state_to_files(get_optimizer_state_dict(parts.model, parts.optimizer))
    state = {**{MODEL_PREFIX + name: t for name, t in model_state.items()},
             **{OPTIMIZER_PREFIX + name: t for name, t in optim_tensors.items()}}
    try:
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(staging / SHARDS_DIR), save_distributed=True))
    except BaseException as err:
        if parts.ctx.is_main:
            shutil.rmtree(staging, ignore_errors=True)
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        # (DCP's CheckpointException is a BaseException: it holds each failed process's exception.)
        raise CheckpointWriteError(f"could not write {target}: {_shard_failure(err)}") from err
    return staging, optim_scalars


def _shard_failure(err: BaseException) -> str:
    """What went wrong in DCP's save, in one line: each failed process's error, not its traceback."""
    failures = getattr(err, "failures", None)  # torch.distributed.checkpoint's CheckpointException
    if not failures:
        return str(err)
    reasons = []
    for rank, failure in sorted(failures.items()):
        cause = getattr(failure, "exception", failure)
        reasons.append(f"process {rank}: {getattr(cause, 'strerror', None) or cause}")
    return "; ".join(reasons)


def full_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer, fsdp: bool) -> tuple[dict, dict]:
    """(model, optimizer) state dicts with whole tensors, gathered from FSDP shards if sharded."""
    if not fsdp:
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
    )

    # Gather the shards into whole tensors on the CPU of every process (small models only need this).
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, optimizer, options=options)


def check_checkpoint_config(model: TransformerLM, directory: Path) -> None:
    """Refuse a checkpoint whose model config is not `model`'s, naming each difference."""
    saved = load_config(directory / CONFIG_FILE)
    if saved != model.config:
        differences = "; ".join(f"{name}: checkpoint {value!r}, this run {getattr(model.config, name)!r}"
                                for name, value in vars(saved).items() if getattr(model.config, name) != value)
        raise ValueError(f"{directory} holds a different model config than the one to train ({differences})")


def loads_per_process(directory: Path, ctx: DistributedContext) -> bool:
    """Whether a run resuming from `directory` loads it with `load_shards`: a distributed checkpoint
    (weights and optimizer state only in its shards) read by a run of two processes or more."""
    return ctx.enabled and is_sharded_checkpoint(directory) and not (directory / WEIGHTS_FILE).is_file() \
        and not (directory / OPTIMIZER_FILE).is_file()


def load_shards(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Every process loads the model weights and optimizer state it holds (FSDP2: its shards; DDP:
    everything) from a distributed checkpoint: torch.distributed.checkpoint's load planner matches
    each process's tensors (whole or sharded, of any number of processes) with the saved chunks and
    reads only the chunks they overlap, so no process holds a whole copy it then throws away.
    Collective; `model` is wrapped (DDP/FSDP2) and `optimizer` built over it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
    )

    scalars = read_json(directory / OPTIMIZER_JSON)  # the param groups and non-tensor state
    model_state = get_model_state_dict(model)  # this process's tensors (DTensor shards under FSDP2)
    # (With an empty optimizer this first takes a zero step, so its state tensors exist to load into.)
    optim_tensors, _ = optimizer_state_to_files(get_optimizer_state_dict(model, optimizer))
    state = {**{MODEL_PREFIX + name: t for name, t in model_state.items()},
             **{OPTIMIZER_PREFIX + name: t for name, t in optim_tensors.items()}}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(directory / SHARDS_DIR)))  # in place
    set_model_state_dict(model, {name: state[MODEL_PREFIX + name] for name in model_state})
    set_optimizer_state_dict(model, optimizer, optimizer_state_from_files(
        {name: state[OPTIMIZER_PREFIX + name] for name in optim_tensors}, scalars))


def load_checkpoint_weights(model: TransformerLM, directory: Path, device: str) -> None:
    """Copy a training checkpoint's weights into `model`, which must have the checkpoint's config.
    An adapter checkpoint (a LoRA run) holds only the adapters: `model` is the base with the same
    adapters added, and only they are copied."""
    check_checkpoint_config(model, directory)
    weights = read_weights(directory, device)
    meta = read_json(directory / META_FILE) if (directory / META_FILE).is_file() else {}
    if not (isinstance(meta, dict) and ADAPTER_BASE_KEY in meta):
        load_weights(model, weights, str(directory))
        return
    load_lora_state_dict(model, weights, str(directory))


def load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path, fsdp: bool) -> None:
    """Restore the optimizer state saved in `directory` (whole tensors; FSDP shards them again). A
    distributed run's state names its parameters (glasslm.io.sharded), so it loads into any number
    of processes, one included."""
    state = load_optimizer_state(directory)
    if not fsdp and not is_sharded_checkpoint(directory):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
