"""The training step's pieces written out: AdamW, Muon, gradient clipping and the learning-rate schedule.

Each optimizer is a `torch.optim.Optimizer` subclass built like torch's own, and its state has
the same names and shapes as torch's (`exp_avg`, `exp_avg_sq`, `step`, `momentum_buffer`), so a
state dict saved by one loads into the other. `make_optimizer` picks the readable classes here
or torch's fused kernels with the same switch as the model (`ModelConfig.impl`).

Example (a few AdamW steps on a quadratic, the same as torch's AdamW):
    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(3))
    >>> w_ref = torch.nn.Parameter(torch.ones(3))
    >>> ours = AdamW([w], lr=0.1, weight_decay=0.01)
    >>> ref = torch.optim.AdamW([w_ref], lr=0.1, weight_decay=0.01)
    >>> for _ in range(5):
    ...     for p, opt in ((w, ours), (w_ref, ref)):
    ...         opt.zero_grad(); (p ** 2).sum().backward(); opt.step()
    >>> torch.equal(w, w_ref)
    True
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

if TYPE_CHECKING:
    from glasslm.training.config import TrainConfig

__all__ = ["AdamW", "Muon", "clip_grad_norm", "cosine_schedule", "make_optimizer", "newton_schulz",
           "muon_param_groups"]


# ----- AdamW ----------------------------------------------------------------------------------------

def adamw_update(param: Tensor, grad: Tensor, state: dict[str, Any], lr: float, betas: tuple[float, float],
                 eps: float, weight_decay: float) -> None:
    """One AdamW step for one parameter, in place (Loshchilov & Hutter 2019, Algorithm 2).

    With t the step count, g the gradient and theta the parameter:
        theta <- theta * (1 - lr * weight_decay)          decoupled decay: not part of the gradient
        m <- beta1 m + (1 - beta1) g                       running mean of g
        v <- beta2 v + (1 - beta2) g^2                     running mean of g^2
        theta <- theta - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    The two (1 - beta^t) factors undo the bias of m and v towards their zero start.
    The operations are in the same order as torch's single-tensor AdamW, so the two agree bit for bit.
    """
    beta1, beta2 = betas
    if not state:  # first step: zero moments, and the step count as a float tensor as torch keeps it
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    state["step"] += 1
    step = state["step"].item()
    m, v = state["exp_avg"], state["exp_avg_sq"]
    param.mul_(1 - lr * weight_decay)
    m.lerp_(grad, 1 - beta1)  # = beta1 m + (1 - beta1) g
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1 ** step)
    denom = (v.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
    param.addcdiv_(m, denom, value=-step_size)


class AdamW(torch.optim.Optimizer):
    """AdamW written out, one parameter at a time (see `adamw_update` for the maths).

    Constructed like `torch.optim.AdamW`: `AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=0.01)`, with `params` an iterable of tensors or of parameter-group dicts.
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    adamw_update(p, p.grad, self.state[p], group["lr"], group["betas"], group["eps"],
                                 group["weight_decay"])
        return loss


# ----- Muon ------------------------------------------------------------------------------------------

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic: steepest slope at 0 that still settles


def newton_schulz(matrix: Float[Tensor, "*batch rows cols"], steps: int = 5,
                  coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: float = 1e-7,
                  dtype: torch.dtype = torch.bfloat16) -> Float[Tensor, "*batch rows cols"]:
    """Approximately the nearest semi-orthogonal matrix to `matrix` (U V^T of its SVD U S V^T).

    Each step maps X to a X + b (X X^T) X + c (X X^T)^2 X, a polynomial that pushes every singular
    value of X towards 1 while keeping U and V. Scaling X by its Frobenius norm first puts all
    singular values in [0, 1], where the iteration works. It runs on the short side (X X^T is
    rows x rows, so transpose a tall matrix) and in `dtype` (bfloat16 as torch and modded-nanogpt
    do: the result is only approximately orthogonal anyway, singular values land in ~[0.7, 1.2]).
    A stack of same-shaped matrices (batch, rows, cols) is done in one batched matmul per product.

    >>> q = newton_schulz(torch.randn(4, 16, generator=torch.Generator().manual_seed(0)), dtype=torch.float32)
    >>> bool(torch.linalg.svdvals(q).sub(1).abs().max() < 0.35)
    True
    """
    a, b, c = coefficients
    x = matrix.to(dtype)
    tall = matrix.size(-2) > matrix.size(-1)
    if tall:
        x = x.mT
    x = x.div_(x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps))
    add_product = torch.addmm if x.dim() == 2 else torch.baddbmm  # beta * m + alpha * (p @ q), one kernel
    for _ in range(steps):
        gram = x @ x.mT  # (short, short)
        poly = add_product(gram, gram, gram, beta=b, alpha=c)  # b * gram + c * gram @ gram
        x = add_product(x, poly, x, beta=a)  # a * x + poly @ x
    return x.mT if tall else x


class Muon(torch.optim.Optimizer):
    """Muon (Jordan et al. 2024) for 2-D hidden weights, with AdamW for every other parameter.

    For a matrix W with gradient G, Muon keeps a momentum buffer B and steps along the
    orthogonalised momentum, so every direction of the update moves by about the same amount:
        B <- momentum * B + (1 - momentum) * G                   (torch's form: a running mean)
        U <- (1 - momentum) G + momentum B if nesterov else B
        W <- W (1 - lr * weight_decay) - lr * sqrt(max(1, rows / cols)) * newton_schulz(U)
    Orthogonalising suits matrices that map one hidden space to another; embeddings, the
    unembedding, norms and biases are not such maps, so groups marked `use_muon=False` take plain
    AdamW steps (`adamw_update`) with their own `lr`, `betas`, `eps` and `weight_decay`, as
    modded-nanogpt and nanochat do. `muon_param_groups(model)` makes that split for a TransformerLM.

    Constructed like `torch.optim.Muon`: `Muon(params, lr=0.02, momentum=0.95, ...)`. With only
    tensors (no groups) every parameter is a Muon parameter and must be 2-D. `fused=True` runs
    torch's kernels (torch.optim.Muon's update and fused AdamW) on the same state.
    `ns_dtype` ("bfloat16" or "float32") is the Newton–Schulz precision.
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], lr: float = 0.02,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, ns_eps: float = 1e-7,
                 ns_dtype: str = "bfloat16", fused: bool = False):
        if lr < 0 or not 0 <= momentum < 1 or weight_decay < 0 or ns_steps < 1:
            raise ValueError(f"need lr >= 0, 0 <= momentum < 1, weight_decay >= 0, ns_steps >= 1; got "
                             f"{lr}, {momentum}, {weight_decay}, {ns_steps}")
        if ns_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"ns_dtype must be 'bfloat16' or 'float32', got {ns_dtype!r}")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, weight_decay=weight_decay,
                        betas=tuple(betas), eps=eps, ns_eps=ns_eps, ns_dtype=ns_dtype, use_muon=True)
        super().__init__(params, defaults)
        self.fused = fused
        for group in self.param_groups:
            for p in group["params"]:
                if group["use_muon"] and p.dim() != 2:
                    raise ValueError(f"Muon orthogonalises matrices; a parameter of shape {tuple(p.shape)} "
                                     "belongs in a group with use_muon=False (AdamW)")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if self.fused:
                self._fused_group(group, params)
            elif group["use_muon"]:
                for p in params:
                    self._muon_update(p, group)
            else:
                for p in params:
                    adamw_update(p, p.grad, self.state[p], group["lr"], group["betas"], group["eps"],
                                 group["weight_decay"])
        return loss

    def _muon_update(self, param: Tensor, group: dict[str, Any]) -> None:
        state, grad, momentum = self.state[param], param.grad, group["momentum"]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        buf.lerp_(grad, 1 - momentum)
        update = grad.lerp(buf, momentum) if group["nesterov"] else buf
        ortho = newton_schulz(update, group["ns_steps"], NS_COEFFICIENTS, group["ns_eps"],
                              getattr(torch, group["ns_dtype"]))
        rows, cols = param.shape
        # The orthogonalised update has unit singular values, so its RMS is about 1/sqrt(max(rows, cols)) of
        # the square case's; sqrt(rows/cols) for tall matrices evens that out (Keller's "original" rule).
        param.mul_(1 - group["lr"] * group["weight_decay"])
        param.add_(ortho, alpha=-group["lr"] * math.sqrt(max(1.0, rows / cols)))

    def _batched_muon(self, params: list[Tensor], group: dict[str, Any]) -> None:
        """`_muon_update` for several same-shaped matrices at once (the fast path)."""
        momentum, grads = group["momentum"], [p.grad for p in params]
        bufs = [self.state[p]["momentum_buffer"] for p in params]
        torch._foreach_lerp_(bufs, grads, 1 - momentum)
        updates = torch.stack([g.lerp(b, momentum) for g, b in zip(grads, bufs)] if group["nesterov"] else bufs)
        ortho = newton_schulz(updates, group["ns_steps"], NS_COEFFICIENTS, group["ns_eps"],
                              getattr(torch, group["ns_dtype"]))
        rows, cols = params[0].shape
        torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
        torch._foreach_add_(params, list(ortho.to(params[0].dtype).unbind(0)), alpha=-group["lr"] * math.sqrt(max(1.0, rows / cols)))

    def _fused_group(self, group: dict[str, Any], params: list[Tensor]) -> None:
        """The same update through torch's kernels (same state names, so checkpoints interchange)."""
        if not params:
            return
        for p in params:  # state as torch keeps it (the readable path makes the same on first use)
            if not self.state[p]:
                if group["use_muon"]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                else:
                    self.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p),
                                         exp_avg_sq=torch.zeros_like(p))
        states = [self.state[p] for p in params]
        if group["use_muon"]:
            from torch.optim._muon import muon

            by_shape: dict[tuple[int, ...], list[Tensor]] = {}
            for p in params:
                by_shape.setdefault(tuple(p.shape), []).append(p)
            for same in by_shape.values():
                if len(same) > 1:  # one batched Newton–Schulz for all matrices of a shape: far fewer small matmuls
                    self._batched_muon(same, group)
                    continue
                if group["ns_dtype"] != "bfloat16":  # torch's Newton–Schulz is bf16 only
                    self._muon_update(same[0], group)
                    continue
                muon(same, [p.grad for p in same], [self.state[p]["momentum_buffer"] for p in same],
                     lr=group["lr"], weight_decay=group["weight_decay"], momentum=group["momentum"],
                     nesterov=group["nesterov"], ns_coefficients=NS_COEFFICIENTS, ns_steps=group["ns_steps"],
                     eps=group["ns_eps"], adjust_lr_fn=None, has_complex=False)
        else:
            from torch.optim.adamw import adamw

            device_is_cpu_or_cuda = params[0].device.type in ("cpu", "cuda")
            adamw(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                  [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states],
                  fused=device_is_cpu_or_cuda or None, foreach=None if device_is_cpu_or_cuda else True,
                  amsgrad=False, beta1=group["betas"][0], beta2=group["betas"][1], lr=group["lr"],
                  weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)


def muon_param_groups(model: nn.Module, muon_lr: float, adamw_lr: float, weight_decay: float,
                      muon_weight_decay: float = 0.0, decay_embeddings: bool = False) -> list[dict[str, Any]]:
    """Split a model's parameters for `Muon`: 2-D weights inside the blocks go to Muon; the token and
    position embeddings, the unembedding, norms and biases to AdamW (decayed only if 2-D, and
    embeddings only with `decay_embeddings`)."""
    muon, adam_decay, adam_plain = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        in_block = name.startswith("blocks.") or ".blocks." in name
        if in_block and p.dim() == 2:
            muon.append(p)
        elif p.dim() >= 2 and (decay_embeddings or in_block or name.startswith("unembed")):
            adam_decay.append(p)
        else:
            adam_plain.append(p)
    return [dict(params=muon, lr=muon_lr, weight_decay=muon_weight_decay, use_muon=True),
            dict(params=adam_decay, lr=adamw_lr, weight_decay=weight_decay, use_muon=False),
            dict(params=adam_plain, lr=adamw_lr, weight_decay=0.0, use_muon=False)]


def newton_schulz_dtype(requested: str, device: str) -> str:
    """The precision Muon's Newton–Schulz runs in for `TrainConfig.muon_ns_dtype` on `device`.

    "auto" is bfloat16 (torch.optim.Muon's choice) only where the device multiplies bfloat16 natively:
    on a CPU without avx512_bf16 or AMX a bfloat16 matmul is emulated, ~6x slower than float32, and the
    optimizer step then costs more than the forward and backward of a small model.

    >>> newton_schulz_dtype("auto", "cuda")
    'bfloat16'
    >>> newton_schulz_dtype("float32", "cuda")
    'float32'
    """
    from glasslm.runtime import default_dtype

    return default_dtype(device) if requested == "auto" else requested


def make_optimizer(model: nn.Module, cfg: "TrainConfig", fused: bool | None = None) -> torch.optim.Optimizer:
    """The optimizer `cfg.optimizer` names, for `model`.

    adamw: weight decay only on matrices that multiply activations (not norms, biases, and not
    embeddings unless cfg.decay_embeddings). muon: see `muon_param_groups` (Muon at cfg.muon_lr,
    AdamW at cfg.lr). `fused=None` follows the model's `impl`: "fast" uses torch's fused kernels,
    "readable" the classes above. `fused=False` on a fast model (sharded DTensor parameters) keeps
    torch's AdamW with its foreach kernel. Every group records its peak rate as `initial_lr`,
    which `apply_schedule` scales.
    """
    config = getattr(model, "config", None)
    readable = getattr(config, "impl", "fast") == "readable"
    if cfg.optimizer == "muon":
        groups = muon_param_groups(model, cfg.muon_lr, cfg.lr, cfg.weight_decay,
                                   decay_embeddings=cfg.decay_embeddings)
        device = next(model.parameters()).device.type
        optimizer: torch.optim.Optimizer = Muon(
            [g for g in groups if g["params"]], momentum=cfg.muon_momentum, betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps, ns_dtype=newton_schulz_dtype(cfg.muon_ns_dtype, device),
            fused=not readable and fused is not False)
    else:
        decay, no_decay = [], []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            is_embedding = name.startswith(("embed.", "pos_embed."))
            wants_decay = p.dim() >= 2 and (cfg.decay_embeddings or not is_embedding)
            (decay if wants_decay else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if readable:
            optimizer = AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
        else:
            fused = True if fused is None else fused
            optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                          fused=fused or None, foreach=None if fused else True)
    for group in optimizer.param_groups:
        group["initial_lr"] = group["lr"]
    return optimizer


# ----- gradient clipping and the schedule ------------------------------------------------------------

def clip_grad_norm(parameters: Iterable[Tensor], max_norm: float, eps: float = 1e-6) -> Float[Tensor, ""]:
    """Scale all gradients together so their global L2 norm is at most `max_norm`; returns the norm before.

    The global norm is sqrt(sum of every gradient's squared entries). If it exceeds `max_norm`, every
    gradient is multiplied by max_norm / (norm + eps) (eps keeps a zero norm finite), so the
    direction is kept. Parameters without a gradient are skipped. Same result as
    `torch.nn.utils.clip_grad_norm_`.

    >>> w = torch.nn.Parameter(torch.zeros(2)); w.grad = torch.tensor([3.0, 4.0])
    >>> clip_grad_norm([w, torch.nn.Parameter(torch.zeros(1))], max_norm=1.0).item()
    5.0
    >>> [round(g, 4) for g in w.grad.tolist()]
    [0.6, 0.8]
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    if math.isfinite(max_norm):
        scale = (max_norm / (norm + eps)).clamp(max=1.0)  # never scale up
        for g in grads:
            g.mul_(scale.to(g.device))
    return norm


def cosine_schedule(step: int, lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> float:
    """Learning rate at 0-based `step`: linear warmup from 0, cosine decay to `min_lr`, then flat.

    With T_w = warmup_steps and T_c = decay_steps (the step where the cosine ends):
        step < T_w:          lr * step / T_w                                (0 at step 0)
        T_w <= step <= T_c:  min_lr + (1 + cos(pi (step - T_w) / (T_c - T_w))) / 2 * (lr - min_lr)
        step > T_c:          min_lr
    This is the usual form (and CS336's `run_get_lr_cosine_schedule(it, max_learning_rate,
    min_learning_rate, warmup_iters, cosine_cycle_iters)` argument for argument).

    >>> [round(cosine_schedule(s, 1.0, 0.1, warmup_steps=3, decay_steps=7), 3) for s in range(9)]
    [0.0, 0.333, 0.667, 1.0, 0.868, 0.55, 0.232, 0.1, 0.1]
    """
    if step < warmup_steps:
        return lr * step / warmup_steps
    if step >= decay_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)
