"""What the training loop works with, built once per run: the model and its DDP/FSDP/compiled
wrappers, the optimizer, the loss scaler, the batch sampler, and where the run stands (a fresh
start, or a checkpoint's step with every generator and the optimizer restored).

How the data is drawn (this is what makes resuming and data parallelism exact): every optimizer
step draws one *global* batch of batch_size x grad_accum_steps x world_size windows from a single
generator seeded by `seed`. Process r takes the r-th contiguous slice and splits it into
grad_accum_steps micro-batches; every process draws the whole batch's random numbers but reads
only its own slice's rows (glasslm.training.batches: `share`). So the windows seen at step s depend only on s and the global batch
size: 2 processes with batch 6 see exactly what 1 process with batch 12 sees, and a resumed run
(generator state restored from the checkpoint) sees what the uninterrupted run saw.

Example:
    >>> import torch
    >>> from glasslm.presets import get_preset
    >>> from glasslm.training.config import TrainConfig
    >>> from glasslm.training.distributed import DistributedContext
    >>> cfg = get_preset("shakespeare-char-cpu", vocab_size=4, n_layers=1, context_length=8)
    >>> tokens = torch.randint(0, 4, (100,))
    >>> parts = TrainingParts.build(cfg, TrainConfig(batch_size=3), DistributedContext(), "cpu", None, (tokens, None))
    >>> x, y = parts.next_batch()
    >>> x.shape, parts.point.step
    (torch.Size([3, 8]), 0)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from glasslm.core.config import ModelConfig
from glasslm.core.model import TransformerLM
from glasslm.training.activations import checkpoint_blocks
from glasslm.training.batches import BatchSource, as_batch_source
from glasslm.training.checkpointer import (
    check_checkpoint_config, load_checkpoint_weights, load_optimizer, load_shards, loads_per_process,
)
from glasslm.training.config import TrainConfig
from glasslm.training.distributed import DistributedContext
from glasslm.training.optim import make_optimizer
from glasslm.training.schedule import schedule_end
from glasslm.training.step import Objective, next_token_loss
from glasslm.training.trainer_state import ResumePoint, load_resume_point, seed_processes


@dataclass
class TrainingParts:
    """The parts one training step uses (see the module docstring)."""

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
    train_source: BatchSource
    val_source: BatchSource | None
    objective: Objective = next_token_loss  # the loss a step minimises (glasslm.training.step)

    @classmethod
    def build(cls, model: ModelConfig | TransformerLM, cfg: TrainConfig, ctx: DistributedContext, device: str,
              resume_dir: Path | None, data: tuple[Tensor | BatchSource, Tensor | BatchSource | None],
              objective: Objective = next_token_loss) -> "TrainingParts":
        """The parts for `model` (a config is built with weights seeded by cfg.seed, the same on every
        process), resumed from `resume_dir` if given. `data` is (training, validation): token
        streams (pretraining's windows) or batch sources (glasslm.training.batches)."""
        torch.manual_seed(cfg.seed)  # every process builds identical initial weights
        model = model if isinstance(model, TransformerLM) else TransformerLM(model)
        model.to(device).train()
        train_source, val_source = (as_batch_source(d, model.config.context_length) for d in data)
        assert train_source is not None
        for name, source in (("training", train_source), ("validation", val_source)):
            if source is not None:
                source.check(name)
        batch_rng = seed_processes(cfg.seed, ctx.rank)
        per_process = resume_dir is not None and loads_per_process(resume_dir, ctx)
        if per_process:
            check_checkpoint_config(model, resume_dir)  # the weights are loaded once wrapped, in place
        elif resume_dir is not None:
            load_checkpoint_weights(model, resume_dir, device)
        fsdp = cfg.fsdp and ctx.enabled
        step_model, eval_model = wrap(model, cfg, ctx, device, fsdp)
        optimizer = make_optimizer(model, cfg, fused=not fsdp)
        scaler = torch.amp.GradScaler(torch.device(device).type) if cfg.dtype == "float16" else None
        point = ResumePoint()
        if resume_dir is not None:
            if per_process:
                load_shards(model, optimizer, resume_dir)
            else:
                load_optimizer(model, optimizer, resume_dir, fsdp)
            point = load_resume_point(resume_dir, batch_rng, ctx)
            if scaler is not None and point.grad_scaler:
                scaler.load_state_dict(point.grad_scaler)
            # The run's schedule goes on (see schedule_end), saved explicitly so a later resume keeps it too.
            cfg = dataclasses.replace(cfg, lr_decay_steps=schedule_end(cfg, point.train_config))
        return cls(cfg, ctx, device, model, step_model, eval_model, optimizer, scaler, batch_rng, point, fsdp,
                   train_source, val_source, objective)

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimizer step trains on, over all processes."""
        cfg = self.cfg
        rows = cfg.batch_size * cfg.grad_accum_steps * self.ctx.world_size
        return round(rows * self.train_source.tokens_per_row())

    def next_batch(self) -> tuple[Tensor, Tensor]:
        """This process's slice of the step's global batch (see the module docstring): x, y (rows, seq)."""
        cfg, ctx = self.cfg, self.ctx
        x, y = self.train_source.draw(cfg.batch_size * cfg.grad_accum_steps * ctx.world_size, self.batch_rng,
                                      share=(ctx.rank, ctx.world_size))  # only this process's rows are read
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)


def wrap(model: TransformerLM, cfg: TrainConfig, ctx: DistributedContext, device: str,
         fsdp: bool) -> tuple[nn.Module, nn.Module]:
    """(model to step, model to evaluate): maybe activation-checkpointed per block, FSDP2 or DDP
    across processes, then maybe compiled."""
    if cfg.activation_checkpointing:  # before sharding: FSDP2's hooks then wrap the checkpointed forward
        checkpoint_blocks(model)
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
