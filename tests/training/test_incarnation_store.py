"""glasslm.training.distributed.incarnation_store: processes relaunched by torchrun meet in a store of
their own launch, never at an address their dead predecessors left in the launcher's store."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import torch.distributed as dist

from glasslm.training import distributed
from glasslm.training.distributed import incarnation_store


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_relaunched_rank_skips_the_dead_store_and_meets_rank_0(monkeypatch):
    launcher = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    # What the previous launch left: its rank 0's store address (that process is gone) and a gloo address.
    launcher.set(distributed._ADDRESS_KEY, f"127.0.0.1:{closed_port()}")
    launcher.set("default_pg/0//cpu//rank_0", "the dead rank 0's address")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(launcher.port))
    monkeypatch.setattr(distributed, "STALE_ADDRESS_TIMEOUT", timedelta(seconds=0.5))
    found: dict[str, object] = {}
    rank1 = threading.Thread(target=lambda: found.update(store=incarnation_store(1, 2)))
    rank1.start()  # first: it reads the stale address and must not stop at it
    rank1.join(timeout=1.5)
    assert rank1.is_alive(), "rank 1 returned before rank 0 started its store"
    own = incarnation_store(0, 2)
    rank1.join(timeout=30)
    assert not rank1.is_alive()
    store = found["store"]
    own.set("from rank 0", "hello")
    assert store.get("from rank 0") == b"hello"
    assert not store.check(["default_pg/0//cpu//rank_0"]), "the new store holds nothing of the previous launch"
    assert launcher.get(distributed._ADDRESS_KEY) == f"127.0.0.1:{own.port}".encode()


def test_outside_torchrun_torch_makes_the_store(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert incarnation_store(0, 2) is None
