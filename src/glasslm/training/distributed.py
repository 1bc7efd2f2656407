"""Data-parallel training across processes: what `torchrun` tells us, and the few collectives we use.

`torchrun --nproc_per_node=N -m glasslm.cli train ...` starts N processes with the environment
variables RANK, WORLD_SIZE and LOCAL_RANK set (plus MASTER_ADDR/MASTER_PORT for the rendezvous).
`init_distributed` reads them and joins the process group: gloo on CPU, NCCL on CUDA. A plain
`python -m glasslm.cli train` sees none of them and runs as a world of one.

Example (no torchrun variables set, so a single process):
    >>> ctx = init_distributed("cpu")   # "auto" (the default) picks cuda, else mps, else cpu
    >>> (ctx.rank, ctx.world_size, ctx.is_main, ctx.enabled)
    (0, 1, True, False)
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistributedContext:
    """Where this process sits in the job. `enabled` is False for a world of one."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"  # a resolved device (resolve_device), never "auto"

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Only the main process logs, draws progress bars and writes checkpoints."""
        return self.rank == 0


def resolve_device(device: str = "auto") -> str:
    """The device to use for `device`: "auto" picks the best available (cuda, else mps, else cpu).

    Under torchrun (LOCAL_RANK set) a bare "cuda" means this process's own GPU, cuda:LOCAL_RANK.
    A device that does not exist here is refused in one line, before anything touches it.

    >>> resolve_device("cpu")
    'cpu'
    """
    name = device.strip().lower()
    if name == "auto":
        if torch.cuda.is_available():
            name = "cuda"
        elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            name = "mps"
        else:
            name = "cpu"
    try:
        parsed = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}; use auto, cpu, cuda, cuda:N or mps") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this PyTorch build has no CUDA support" if torch.version.cuda is None
                   else "no CUDA GPU is visible")
            raise ValueError(f"device {device!r} is not available: {why} (torch {torch.__version__}); "
                             "use --device cpu or auto")
        if parsed.index is None:
            return f"cuda:{os.environ['LOCAL_RANK']}" if "LOCAL_RANK" in os.environ else "cuda"
        if parsed.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} is not available: {torch.cuda.device_count()} CUDA GPU(s) visible")
    if parsed.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ValueError(f"device {device!r} is not available: no Apple MPS device here; use --device cpu or auto")
    if parsed.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device {device!r} is not supported; use auto, cpu, cuda, cuda:N or mps")
    return name


# Set when this process joins a process group of two or more (see exit_process).
_joined_group = False


def init_distributed(device: str = "auto") -> DistributedContext:
    """Join the process group torchrun set up (if any) and pick this process's device.

    On CUDA each process takes the GPU numbered by its LOCAL_RANK.
    """
    device = resolve_device(device)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistributedContext(device=device)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device_type = torch.device(device).type
    if device_type == "cuda":
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
    global _joined_group
    _joined_group = True
    return DistributedContext(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End the process with `code`; a process that joined a group skips interpreter teardown.

    DDP keeps its process group alive past `destroy_process_group` (its gloo worker threads were
    still running after destroy and a garbage collection in torch 2.13), so the group was torn
    down during interpreter finalization, racing those threads: about one torchrun worker in
    fifteen, on a loaded 2-core machine, died there with SIGABRT ("terminate called without an
    active exception") after a complete, checkpointed run. Everything the run writes is closed
    by then, so such a process flushes its output and leaves at once with `os._exit`, as
    multiprocessing's children always do.
    """
    if not _joined_group:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def all_reduce_mean(tensor: torch.Tensor, ctx: DistributedContext) -> torch.Tensor:
    """The mean of `tensor` over all processes (the tensor itself in a world of one)."""
    if not ctx.enabled:
        return tensor
    tensor = tensor.clone()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor / ctx.world_size


def any_process(flag: bool, ctx: DistributedContext) -> bool:
    """True on every process if `flag` is True on any (e.g. one process received SIGTERM)."""
    if not ctx.enabled:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=ctx.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def gather_objects(obj: object, ctx: DistributedContext) -> list[object]:
    """`obj` from every process, in rank order (used for per-rank RNG states in checkpoints)."""
    if not ctx.enabled:
        return [obj]
    out: list[object] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: object, ctx: DistributedContext) -> object:
    """The main process's `obj` on every process (e.g. the staging directory it made)."""
    if not ctx.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(ctx: DistributedContext) -> None:
    if ctx.enabled:
        dist.barrier()
