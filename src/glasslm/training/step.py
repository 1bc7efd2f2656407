"""One optimizer step: forward and backward over accumulated micro-batches (under autocast), then
unscale, clip, step and zero the gradients.

Example (the gradient of two accumulated halves is the gradient of the whole batch):
    >>> import torch
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.presets import get_preset
    >>> _ = torch.manual_seed(0)
    >>> model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=4, n_layers=1, context_length=8))
    >>> x, y = torch.randint(0, 4, (2, 4, 8))
    >>> _ = forward_backward(model, x, y, accum_steps=1); whole = model.embed.weight.grad.clone()
    >>> model.zero_grad(); _ = forward_backward(model, x, y, accum_steps=2)
    >>> torch.allclose(model.embed.weight.grad, whole, atol=1e-6)
    True
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import TYPE_CHECKING, Callable, Protocol

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from glasslm.core.layers import cross_entropy
from glasslm.training.config import TrainConfig
from glasslm.training.distributed import resolve_device
from glasslm.training.optim import clip_grad_norm

if TYPE_CHECKING:
    from glasslm.training.parts import TrainingParts


def autocast_context(cfg: TrainConfig, device: str | None = None):
    """bf16/fp16 autocast for the forward pass (matmuls in low precision, reductions in fp32)."""
    if cfg.dtype == "float32":
        return nullcontext()
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float16
    return torch.autocast(device_type=torch.device(device or resolve_device(cfg.device)).type, dtype=dtype)


class Objective(Protocol):
    """What a step minimises on one micro-batch: (loss, statistics to log beside it, each a scalar
    tensor averaged over the step's micro-batches). The default is `next_token_loss`; preference
    tuning's is glasslm.training.dpo.DPOObjective."""

    def __call__(self, model: nn.Module, x: Int[Tensor, "b t"],
                 y: Int[Tensor, "b t"]) -> tuple[Float[Tensor, ""], dict[str, Tensor]]: ...


def next_token_loss(model: nn.Module, x: Int[Tensor, "b t"], y: Int[Tensor, "b t"]) -> tuple[Tensor, dict[str, Tensor]]:
    """The mean cross-entropy of the labelled next tokens (pretraining's and fine-tuning's loss).

    A mixture-of-experts model in training adds its routers' auxiliary loss (`TransformerLM.router_losses`:
    moe_aux_loss_coef x load balance + moe_z_loss_coef x z-loss) and logs, beside the total, the
    cross-entropy alone (`lm_loss`), the terms, and each expert's share of the token assignments averaged
    over the MoE layers (`expert_load/{e}`; 1 / n_experts each when balanced) and the largest share any
    expert has in any layer (`expert_load_max`).
    """
    loss = cross_entropy(model(x), y)
    router_losses = getattr(_core_model(model), "router_losses", None)
    router = router_losses() if router_losses is not None and model.training else None
    if router is None:
        return loss, {}
    load = router["load"]  # (moe layers, n_experts)
    stats = {"lm_loss": loss.detach(), "moe_aux_loss": router["aux"].detach(),
             "moe_balance_loss": router["balance"].detach(), "moe_z_loss": router["z"].detach(),
             "expert_load_max": load.max()}
    stats |= {f"expert_load/{e}": share for e, share in enumerate(load.mean(dim=0))}
    return loss + router["aux"], stats


def _core_model(model: nn.Module) -> nn.Module:
    """The TransformerLM inside DDP (.module) and torch.compile (._orig_mod) wrappers."""
    while not hasattr(model, "router_losses") and (hasattr(model, "module") or hasattr(model, "_orig_mod")):
        model = getattr(model, "module", None) or model._orig_mod
    return model


def forward_backward(
    model: nn.Module, x: Int[Tensor, "b t"], y: Int[Tensor, "b t"], accum_steps: int,
    autocast=nullcontext, scaler: torch.amp.GradScaler | None = None, no_sync: Callable | None = None,
    interrupted: Callable[[], bool] | None = None, objective: Objective = next_token_loss,
    stats: dict[str, Tensor] | None = None,
) -> Tensor | None:
    """Accumulate the gradient of the mean loss over all rows of (x, y) in `accum_steps` chunks.

    Each chunk's loss is divided by accum_steps, so the summed gradient equals the gradient of
    one big batch (chunks must be equal-sized). Returns the (detached) mean loss; the objective's
    statistics, averaged the same way, are added to `stats` where given.
    `no_sync` (DDP's) skips the gradient all-reduce on every chunk but the last. `interrupted` is
    asked before each chunk after the first: true abandons the step (returns None, the gradient
    half-accumulated), so a Ctrl-C is answered within one micro-batch, not one whole step.
    """
    total: Tensor | None = None
    for i, (xc, yc) in enumerate(zip(x.tensor_split(accum_steps), y.tensor_split(accum_steps))):
        if i > 0 and interrupted is not None and interrupted():
            return None
        sync = no_sync() if no_sync is not None and i < accum_steps - 1 else nullcontext()
        with sync:
            with autocast():
                loss, chunk_stats = objective(model, xc, yc)  # xc, yc: (b / accum_steps, t)
                loss = loss / accum_steps
            (scaler.scale(loss) if scaler is not None else loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
        if stats is not None:
            for name, value in chunk_stats.items():
                stats[name] = stats.get(name, 0.0) + value.detach().float() / accum_steps
    assert total is not None
    return total


def train_step(parts: TrainingParts, x: Int[Tensor, "b t"], y: Int[Tensor, "b t"],
               interrupted: Callable[[], bool] | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]] | None:
    """One optimizer step on this process's batch: (mean loss, global gradient norm, the objective's
    statistics), all still on the device (reading them would wait for the step to finish). None:
    `interrupted` abandoned the step between micro-batches; weights and optimizer are as before it,
    gradients cleared."""
    cfg, model, optimizer, scaler = parts.cfg, parts.model, parts.optimizer, parts.scaler
    ddp = parts.step_model if isinstance(parts.step_model, nn.parallel.DistributedDataParallel) else None
    stats: dict[str, Tensor] = {}
    loss = forward_backward(parts.step_model, x, y, cfg.grad_accum_steps,
                            lambda: autocast_context(cfg, parts.device), scaler, ddp.no_sync if ddp else None,
                            interrupted, parts.objective, stats)
    if loss is None:
        optimizer.zero_grad(set_to_none=True)
        return None
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
    return loss, grad_norm.detach().float().to(loss.device), stats
