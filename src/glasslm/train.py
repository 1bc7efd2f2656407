"""The training loop: AdamW, warmup + cosine learning rate, clipping, periodic validation, checkpoints.

Example (a few steps on a toy corpus):
    >>> import torch
    >>> from glasslm.config import get_preset
    >>> from glasslm.train import TrainConfig, train
    >>> cfg = get_preset("shakespeare-char-cpu", vocab_size=4, n_layers=1, context_length=8)
    >>> tokens = torch.randint(0, 4, (1000,))
    >>> result = train(cfg, TrainConfig(max_steps=3, eval_interval=0, progress=False), tokens)
    >>> len(result.train_losses)
    3
"""

from __future__ import annotations

import dataclasses
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from jaxtyping import Int
from torch import Tensor
from tqdm.auto import tqdm

from .config import ModelConfig
from .data import get_batch
from .layers import cross_entropy
from .model import TransformerLM


@dataclass
class TrainConfig:
    """Everything about a run that is not the architecture."""

    max_steps: int = 2000
    batch_size: int = 12
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    lr_decay_steps: int | None = None  # end of the cosine phase; None means max_steps
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # max global L2 norm of the gradient; 0 disables clipping
    eval_interval: int = 250  # 0 evaluates only at the end
    eval_iters: int = 20
    seed: int = 1337
    device: str = "cpu"
    dtype: str = "float32"  # "bfloat16" runs the forward pass under bf16 autocast
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("max_steps", "batch_size", "eval_iters"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.warmup_steps < 0 or self.eval_interval < 0:
            raise ValueError("warmup_steps and eval_interval must be >= 0")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need 0 <= min_lr <= lr, got min_lr={self.min_lr}, lr={self.lr}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


TRAIN_PRESETS: dict[str, TrainConfig] = {
    # nanoGPT's CPU recipe for tiny Shakespeare, so results compare directly.
    "shakespeare-char-cpu": TrainConfig(),
    "shakespeare-char": TrainConfig(max_steps=5000, batch_size=64, warmup_steps=100, eval_interval=250,
                                    eval_iters=200),
}


def lr_at(step: int, lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> float:
    """Linear warmup from 0 to lr over warmup_steps, cosine decay to min_lr by decay_steps, then min_lr."""
    if step < warmup_steps:
        return lr * (step + 1) / (warmup_steps + 1)
    if step >= decay_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def make_optimizer(model: TransformerLM, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay only on matrices that multiply activations (not norms, biases, embeddings)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        is_embedding = name.startswith(("embed.", "pos_embed."))
        (decay if p.dim() >= 2 and not is_embedding else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # The fused kernel updates every parameter in one pass; it exists for CPU and CUDA.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=True)


def autocast_context(cfg: TrainConfig):
    if cfg.dtype == "bfloat16":
        return torch.autocast(device_type=torch.device(cfg.device).type, dtype=torch.bfloat16)
    return nullcontext()


@torch.no_grad()
def evaluate(model: TransformerLM, tokens: Tensor, cfg: TrainConfig, generator: torch.Generator) -> float:
    """Mean loss over eval_iters random batches."""
    was_training = model.training
    model.eval()
    losses = []
    for _ in range(cfg.eval_iters):
        x, y = get_batch(tokens, cfg.batch_size, model.config.context_length, generator, cfg.device)
        with autocast_context(cfg):
            losses.append(cross_entropy(model(x), y).item())
    model.train(was_training)
    return sum(losses) / len(losses)


@dataclass
class TrainResult:
    model: TransformerLM
    train_losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)
    tokens_per_second: float = 0.0


def train(
    model_config: ModelConfig | TransformerLM,
    cfg: TrainConfig,
    train_tokens: Int[Tensor, "n"],
    val_tokens: Int[Tensor, "m"] | None = None,
    on_eval: Callable[[int, float, TransformerLM], None] | None = None,
) -> TrainResult:
    """Train a model (or a fresh one from a config) on a 1-D tensor of token ids."""
    torch.manual_seed(cfg.seed)
    model = model_config if isinstance(model_config, TransformerLM) else TransformerLM(model_config)
    model.to(cfg.device).train()
    context = model.config.context_length
    for name, tokens in (("training", train_tokens), ("validation", val_tokens)):
        if tokens is not None and len(tokens) <= context:
            raise ValueError(f"{name} data has {len(tokens)} tokens; need more than context_length={context}")
    optimizer = make_optimizer(model, cfg)
    batch_rng = torch.Generator().manual_seed(cfg.seed)
    eval_rng = torch.Generator().manual_seed(cfg.seed + 1)
    decay_steps = cfg.lr_decay_steps or cfg.max_steps
    result = TrainResult(model)
    tokens_per_step = cfg.batch_size * context

    bar = tqdm(range(cfg.max_steps), disable=not cfg.progress, dynamic_ncols=True, desc="train", mininterval=0.5)
    start = time.perf_counter()
    for step in bar:
        lr = lr_at(step, cfg.lr, cfg.min_lr, cfg.warmup_steps, decay_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = get_batch(train_tokens, cfg.batch_size, context, batch_rng, cfg.device)
        with autocast_context(cfg):
            loss = cross_entropy(model(x), y)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        loss_value = loss.item()
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"loss became {loss_value} at step {step}; lower the learning rate?")
        result.train_losses.append(loss_value)
        elapsed = time.perf_counter() - start
        result.tokens_per_second = tokens_per_step * (step + 1) / elapsed
        bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}", tok_s=f"{result.tokens_per_second:,.0f}",
                        refresh=False)  # redrawn at tqdm's own pace, not every step

        last = step == cfg.max_steps - 1
        if val_tokens is not None and (last or (cfg.eval_interval and (step + 1) % cfg.eval_interval == 0)):
            val_loss = evaluate(model, val_tokens, cfg, eval_rng)
            result.val_losses.append((step + 1, val_loss))
            bar.write(f"step {step + 1}: train loss {loss_value:.4f}, val loss {val_loss:.4f}")
            if on_eval is not None:
                on_eval(step + 1, val_loss, model)
    bar.close()
    return result
