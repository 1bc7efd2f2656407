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

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from glasslm.core.model import TransformerLM
from glasslm.io.build import load_weights
from glasslm.io.checkpoint import (
    ADAPTER_BASE_KEY, CONFIG_FILE, META_FILE, OPTIMIZER_FILE, OPTIMIZER_JSON, WEIGHTS_FILE, CheckpointWriteError, checkpoint_name, load_config,
    load_optimizer_state, optimizer_state_to_files, prune_checkpoints, read_json, read_pointer, read_safetensors,
    save_checkpoint, write_pointer,
)
from glasslm.training.config import TrainConfig
from glasslm.training.distributed import DistributedContext, barrier
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
                            log_window_losses=window.losses, train_config=self.cfg.to_dict(),
                            grad_scaler=self.parts.scaler.state_dict() if self.parts.scaler is not None else None)
        meta = {**self.meta, "step": done, "val_loss": evaluator.last}
        self.result.checkpoint = save_training_checkpoint(self.run_dir, self.parts, point, self.tokenizer, meta,
                                                          is_best=evaluator.improved_at == done,
                                                          chat_template=self.chat_template)


def save_training_checkpoint(run_dir: Path, parts: TrainingParts, point: ResumePoint, tokenizer: Any,
                             meta: dict[str, Any], is_best: bool, chat_template: str | None = None) -> Path:
    """Write ckpt-<step>/ with everything needed to continue bit for bit; point `latest` (and maybe
    `best`) at it; prune old ones. Collective: every process calls it, the main one writes.

    Pointers move only once the directory is complete. If writing fails (a full disk), the
    error names the previous checkpoint, which is untouched, and nothing half-written stays.

    With `meta` naming an adapter base (ADAPTER_BASE_KEY: a LoRA run), only the adapters'
    tensors are written: the frozen base is the base checkpoint's, which loading re-reads."""
    model_state, optim_state = full_state_dicts(parts.model, parts.optimizer, parts.fsdp)
    if ADAPTER_BASE_KEY in meta:
        adapters = lora_state_dict(parts.model)
        if not adapters:
            raise ValueError(f"meta[{ADAPTER_BASE_KEY!r}] is set but the model has no LoRA adapters to save")
        model_state = {name: model_state[name] for name in adapters}
    state_tensors, state_json = trainer_state_files(point, parts.batch_rng, parts.ctx)
    target = run_dir / checkpoint_name(point.step)
    if parts.ctx.is_main:
        optim_tensors, optim_scalars = optimizer_state_to_files(optim_state)
        previous = read_pointer(run_dir, "latest")
        try:
            save_checkpoint(
                target, parts.model, tokenizer, meta, state_dict=model_state, chat_template=chat_template,
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


def load_checkpoint_weights(model: TransformerLM, directory: Path, device: str) -> None:
    """Copy a training checkpoint's weights into `model`, which must have the checkpoint's config.
    An adapter checkpoint (a LoRA run) holds only the adapters: `model` is the base with the same
    adapters added, and only they are copied."""
    if load_config(directory / CONFIG_FILE) != model.config:
        raise ValueError(f"{directory} holds a different model config than the one to train")
    weights = read_safetensors(directory / WEIGHTS_FILE, device)
    meta = read_json(directory / META_FILE) if (directory / META_FILE).is_file() else {}
    if not (isinstance(meta, dict) and ADAPTER_BASE_KEY in meta):
        load_weights(model, weights, str(directory))
        return
    load_lora_state_dict(model, weights, str(directory))


def load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path, fsdp: bool) -> None:
    """Restore the optimizer state saved in `directory` (whole tensors; FSDP shards them again)."""
    state = load_optimizer_state(directory)
    if not fsdp:
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
