"""PyTorch Lightning adapter (optional: `pip install lightning`).

`GlassLMModule` wraps a `TransformerLM` so `lightning.Trainer` can train it with glasslm's own
pieces: `cross_entropy` for the loss, `make_optimizer` for AdamW (weight decay only on matrices)
and `scheduled_lr` (warmup + cosine, as `train` uses it) for the learning rate, stepped once per optimizer step.
`token_loader` feeds it random windows of a 1-D token tensor through `get_batch`.

What stays with the Trainer: the number of steps (`Trainer(max_steps=...)`; keep it equal to
`train_config.max_steps` or set `lr_decay_steps`, which sets where the cosine ends), gradient
clipping (`Trainer(gradient_clip_val=train_config.grad_clip)`), precision, devices, checkpoints
and loggers. Importing this module raises ImportError when lightning is not installed.

Example (two steps on a toy corpus):
    >>> import lightning, torch
    >>> from glasslm.presets import get_preset
    >>> from glasslm.training.lightning import GlassLMModule, token_loader
    >>> from glasslm.training.config import TrainConfig
    >>> module = GlassLMModule(get_preset("shakespeare-char-cpu", vocab_size=4, n_layers=1, context_length=8),
    ...                        TrainConfig(max_steps=2, batch_size=4, warmup_steps=0))
    >>> loader = token_loader(torch.randint(0, 4, (500,)), batch_size=4, context_length=8, seed=0)
    >>> trainer = lightning.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False,
    ...     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    >>> trainer.fit(module, loader)
    >>> len(module.train_losses)
    2
"""

from __future__ import annotations

from collections.abc import Iterator

import lightning
import torch
from jaxtyping import Int
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from glasslm.core.config import ModelConfig
from glasslm.data import get_batch
from glasslm.core.layers import cross_entropy
from glasslm.core.model import TransformerLM
from glasslm.training.config import TrainConfig
from glasslm.training.optim import make_optimizer
from glasslm.training.schedule import scheduled_lr


class TokenWindows(IterableDataset):
    """Batches (x, y) of random windows from a 1-D token tensor, drawn with `get_batch`.

    Every iteration starts a fresh generator seeded with `seed` (plus the worker id when the
    DataLoader has workers), so the same seed gives the same batches. `num_batches=None` never
    ends (let `Trainer(max_steps=...)` stop training); a number gives a fixed set, e.g. for validation.
    """

    def __init__(self, tokens: Int[Tensor, "n"], batch_size: int, context_length: int, seed: int = 0,
                 num_batches: int | None = None):
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        self.tokens, self.batch_size, self.context_length = tokens, batch_size, context_length
        self.seed, self.num_batches = seed, num_batches

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        worker = get_worker_info()
        generator = torch.Generator().manual_seed(self.seed + (worker.id if worker else 0))
        produced = 0
        while self.num_batches is None or produced < self.num_batches:
            yield get_batch(self.tokens, self.batch_size, self.context_length, generator=generator)
            produced += 1


def token_loader(tokens: Int[Tensor, "n"], batch_size: int, context_length: int, seed: int = 0,
                 num_batches: int | None = None, num_workers: int = 0) -> DataLoader:
    """A DataLoader over `TokenWindows`. The dataset already yields whole batches (batch_size=None)."""
    dataset = TokenWindows(tokens, batch_size, context_length, seed, num_batches)
    return DataLoader(dataset, batch_size=None, num_workers=num_workers)


class GlassLMModule(lightning.LightningModule):
    """A `TransformerLM` (or a `ModelConfig` to build one) plus the `TrainConfig` for its optimizer.

    Logs `train_loss` every step and `val_loss` averaged over each validation run. The detached
    per-step training losses are also kept in `train_losses` (handy without a logger).
    """

    def __init__(self, model: TransformerLM | ModelConfig, train_config: TrainConfig):
        super().__init__()
        self.model = TransformerLM(model) if isinstance(model, ModelConfig) else model
        self.train_config = train_config
        self.train_losses: list[Tensor] = []

    def forward(self, tokens: Int[Tensor, "batch seq"]) -> Tensor:
        return self.model(tokens)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = cross_entropy(self.model(x), y)
        self.train_losses.append(loss.detach())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = cross_entropy(self.model(x), y)
        self.log("val_loss", loss, prog_bar=True)  # Lightning averages it over the validation run
        return loss

    def configure_optimizers(self):
        cfg = self.train_config
        optimizer = make_optimizer(self.model, cfg)
        # LambdaLR multiplies each group's initial lr (cfg.lr) by the factor, so factor = lr / cfg.lr;
        # scheduled_lr is the function train() uses, so both follow the same schedule.
        factor = lambda step: scheduled_lr(cfg, step) / cfg.lr  # noqa: E731
        if cfg.lr == 0:
            factor = lambda step: 0.0  # noqa: E731
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
