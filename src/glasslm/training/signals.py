"""SIGINT/SIGTERM during training: finish the step, save a checkpoint, then stop.

Example (outside a run nothing is requested):
    >>> from glasslm.training.distributed import DistributedContext
    >>> with StopRequest() as stop:
    ...     stop.requested(DistributedContext(), log_step=True) is None
    True
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager
from typing import Any

from glasslm.training.distributed import DistributedContext, any_process


class StopRequest:
    """Turns SIGINT/SIGTERM into a flag the loop checks after each step (to checkpoint first).

    A second SIGINT stops at once (KeyboardInterrupt), except while a checkpoint is being saved:
    then it only says it will stop when the checkpoint is complete, so pointers never name a
    half-written or half-replaced checkpoint. (A save that hangs still yields to SIGKILL.)
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._saving = False

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():  # signal handlers need the main thread
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
        elif self._saving:
            print("saving a checkpoint; stopping as soon as it is complete", file=sys.stderr, flush=True)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt

    @contextmanager
    def saving(self):
        self._saving = True
        try:
            yield
        finally:
            self._saving = False

    def requested(self, ctx: DistributedContext, log_step: bool) -> int | None:
        """The signal to stop for, if any process got one (then every process stops at this step).

        Processes compare notes only at log steps: an all-reduce + `.item()` on every step would be
        a host sync on the hot path."""
        if not ctx.enabled:
            return self.signum
        if not log_step:
            return None
        return (self.signum or signal.SIGTERM) if any_process(self.signum is not None, ctx) else None

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
