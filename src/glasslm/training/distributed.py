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
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
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
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                                store=incarnation_store(rank, world_size))
    global _joined_group
    _joined_group = True
    return DistributedContext(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


# How long a process waits for the group's store (torch's default process-group timeout for gloo).
STORE_TIMEOUT = timedelta(minutes=30)
# How long a process tries an address read from the launcher's store before reading it again: a
# live store on node 0 answers in milliseconds; an address left by a relaunched run's previous
# processes is refused (the port is closed, or answers never), and is replaced once the new rank 0
# writes its own.
STALE_ADDRESS_TIMEOUT = timedelta(seconds=2)
_ADDRESS_KEY = "glasslm/process-group-store"


def incarnation_store(rank: int, world_size: int) -> dist.Store | None:
    """A key-value store of this launch of the processes only, for the process group to meet in;
    None (torch's own, from MASTER_ADDR/MASTER_PORT) when torchrun did not start this process.

    Why: torchrun (c10d rendezvous, torch >= 2.5) hands its workers a store that node 0's launcher
    keeps for the whole job (TORCHELASTIC_USE_AGENT_STORE=True). When `--max-restarts` relaunches
    the workers, the keys the previous processes wrote (gloo's addresses: default_pg/0//cpu/...)
    are still in it, so a relaunched process that reads its peer's address before the peer rewrote
    it gets the dead process's and the two wait for each other in gloo's connectFullMesh for the
    30-minute timeout (seen in about 1 relaunch in 5 on 2 busy cores: both new workers in
    Pair::waitUntilConnected, each listening, no connection between them; torch issue 135712).
    So global rank 0 starts a new store on a free port of its node (MASTER_ADDR is that node's
    address) and publishes "host:port" in the launcher's store; the others connect to it, and an
    address from a previous launch, whose store died with its rank 0, is read again until the
    new one is there."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    host = os.environ["MASTER_ADDR"]
    launcher = dist.TCPStore(host, int(os.environ["MASTER_PORT"]), is_master=False, timeout=STORE_TIMEOUT)
    if rank == 0:
        own = dist.TCPStore(host, 0, world_size, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False)
        launcher.set(_ADDRESS_KEY, f"{host}:{own.port}")
        return own
    deadline = time.monotonic() + STORE_TIMEOUT.total_seconds()
    while True:
        address = launcher.get(_ADDRESS_KEY).decode()  # waits for the first launch's rank 0
        store_host, port = address.rsplit(":", 1)
        if _listening(store_host, int(port)):
            return dist.TCPStore(store_host, int(port), is_master=False, timeout=STORE_TIMEOUT)
        if time.monotonic() > deadline:
            raise TimeoutError(f"no process group store answered at {address} (from the launcher's store) "
                               f"within {STORE_TIMEOUT}")
        time.sleep(0.1)


def _listening(host: str, port: int) -> bool:
    """Whether something accepts connections at host:port (a plain socket: TCPStore's own client would
    retry a dead address for its whole timeout, logging a stack trace each time)."""
    try:
        with socket.create_connection((host, port), timeout=STALE_ADDRESS_TIMEOUT.total_seconds()):
            return True
    except OSError:
        return False


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
