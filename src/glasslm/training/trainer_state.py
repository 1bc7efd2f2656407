"""What a training checkpoint holds beyond weights and optimizer state, so a resumed run continues
bit for bit: the step, the best validation loss, the clock, the losses of an unfinished metrics
window, and every random number generator (the batch sampler, torch's per process, CUDA's,
Python's and NumPy's). Stored as `trainer_state.json` plus `trainer_state.safetensors` (the
generator states are byte tensors); nothing is pickled.

Example (the batch sampler continues where the saved state left it):
    >>> import torch
    >>> from glasslm.training.distributed import DistributedContext
    >>> ctx = DistributedContext()
    >>> sampler = seed_processes(seed=0, rank=0)
    >>> _ = torch.randint(0, 10, (3,), generator=sampler)
    >>> tensors, fields = capture_rng(sampler, ctx)
    >>> expected = torch.randint(0, 10, (3,), generator=sampler)
    >>> restored = seed_processes(seed=99, rank=0)
    >>> restore_rng(fields, tensors, restored, ctx)
    >>> torch.equal(torch.randint(0, 10, (3,), generator=restored), expected)
    True
"""

from __future__ import annotations

import math
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from glasslm.io.checkpoint import TRAINER_STATE_JSON, TRAINER_STATE_TENSORS, read_json, read_safetensors
from glasslm.training.distributed import DistributedContext, gather_objects


def seed_processes(seed: int, rank: int) -> torch.Generator:
    """Seed torch, Python and NumPy for process `rank` (dropout masks differ per process) and
    return the batch sampler's generator, which is the same on every process."""
    torch.manual_seed(seed + rank)
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    return torch.Generator().manual_seed(seed)


def capture_rng(batch_rng: torch.Generator, ctx: DistributedContext) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Every generator's state: (tensors for safetensors, JSON fields). Collective: the torch and
    CUDA states of all processes are gathered; only the main process needs the result."""
    torch_states = gather_objects(torch.get_rng_state(), ctx)
    cuda_states = gather_objects(torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [], ctx)
    tensors: dict[str, Tensor] = {"rng.batch_sampler": batch_rng.get_state()}
    for rank, state in enumerate(torch_states):
        tensors[f"rng.torch.rank{rank}"] = state  # type: ignore[assignment]
    for rank, states in enumerate(cuda_states):
        for i, state in enumerate(states):  # type: ignore[arg-type]
            tensors[f"rng.cuda.rank{rank}.device{i}"] = state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    fields = {
        "world_size": ctx.world_size,
        "rng_python": _jsonable(random.getstate()),
        "rng_numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }
    return tensors, fields


def restore_rng(state: dict[str, Any], tensors: dict[str, Tensor], batch_rng: torch.Generator,
                ctx: DistributedContext) -> None:
    """Put every random number generator back where `capture_rng` found it."""
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


def _jsonable(obj: Any) -> Any:
    return [_jsonable(x) for x in obj] if isinstance(obj, (tuple, list)) else obj


@dataclass
class ResumePoint:
    """Where a run stands: what a checkpoint records and a resumed run starts from."""

    step: int = 0
    best_val_loss: float = math.inf
    evals_without_improvement: int = 0  # early stopping's count, so a resumed run stops where it would have
    elapsed_s: float = 0.0
    # Losses of the steps since the last metrics record: a checkpoint between two log steps
    # keeps them, so the record closing that window averages the same steps after a resume.
    log_window_losses: list[float] = field(default_factory=list)
    train_config: dict[str, Any] | None = None  # the run's TrainConfig as saved (its schedule)
    grad_scaler: dict[str, Any] | None = None


def load_resume_point(directory: Path, batch_rng: torch.Generator, ctx: DistributedContext) -> ResumePoint:
    """Read a checkpoint's trainer state and restore every generator from it."""
    state = read_json(directory / TRAINER_STATE_JSON)
    tensors = read_safetensors(directory / TRAINER_STATE_TENSORS)
    if not isinstance(state, dict) or "step" not in state:
        raise ValueError(f"{directory / TRAINER_STATE_JSON} does not hold a training step")
    restore_rng(state, tensors, batch_rng, ctx)
    return ResumePoint(
        step=state["step"], best_val_loss=state["best_val_loss"], elapsed_s=state["elapsed_s"],
        evals_without_improvement=state.get("evals_without_improvement", 0),
        log_window_losses=[float(v) for v in state.get("log_window_losses", [])],
        train_config=state.get("train_config"), grad_scaler=state.get("grad_scaler"),
    )


def trainer_state_files(point: ResumePoint, batch_rng: torch.Generator,
                        ctx: DistributedContext) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """(tensors, JSON) for `trainer_state.safetensors` / `.json`. Collective (see capture_rng)."""
    tensors, rng_fields = capture_rng(batch_rng, ctx)
    state = {"format": 1, "step": point.step, "best_val_loss": point.best_val_loss, "elapsed_s": point.elapsed_s,
             "train_config": point.train_config, **rng_fields, "grad_scaler": point.grad_scaler,
             "log_window_losses": list(point.log_window_losses),  # JSON floats round-trip exactly
             "evals_without_improvement": point.evals_without_improvement}
    return tensors, state
