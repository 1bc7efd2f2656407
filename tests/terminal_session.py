"""A glasslm command run on a real terminal (a pty) for the Ctrl-C tests of `generate --interactive`
and `chat`: Ctrl-C during an answer stops that answer and returns to the prompt; Ctrl-C at the prompt
ends the session cleanly."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator


class Reader(threading.Thread):
    """Collects a pipe's text as it arrives, so the test can wait for a given amount or text."""

    def __init__(self, pipe):
        super().__init__(daemon=True)
        self.pipe, self.text = pipe, ""

    def run(self) -> None:
        for chunk in iter(lambda: os.read(self.pipe.fileno(), 4096), b""):
            self.text += chunk.decode("utf-8", "replace")

    def wait_for(self, predicate, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not predicate(self.text):
            assert time.monotonic() < deadline, f"timed out waiting for {what}; got {self.text[-300:]!r}"
            time.sleep(0.01)


@contextlib.contextmanager
def sigint_as_at_a_terminal() -> Iterator[None]:
    """A child started in the block gets Ctrl-C's default action, as a shell gives a command typed at a
    terminal, even where this process ignores SIGINT: a suite started in the background of a script
    (`cmd &` without job control) inherits SIGINT ignored, and a child inheriting that would never see
    the test's Ctrl-C (Python installs its KeyboardInterrupt handler only where SIGINT is not ignored)."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def interrupt_two_answers(args: list[str], prompt: str, line: bytes) -> None:
    """Run `python -m glasslm.cli *args` with a terminal as stdin; twice type `line` at `prompt` and
    Ctrl-C the (endless) answer, checking the session is back at its prompt; then Ctrl-C at the
    prompt must exit 0 without a traceback."""
    import pty

    leader, follower = pty.openpty()  # stdin is a terminal, as for a person typing
    with sigint_as_at_a_terminal():
        proc = subprocess.Popen([sys.executable, "-m", "glasslm.cli", *args],
                                stdin=follower, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    os.close(follower)
    out, err = Reader(proc.stdout), Reader(proc.stderr)
    out.start(), err.start()
    try:
        for answer in (1, 2):
            err.wait_for(lambda text: text.count(prompt) == answer, f"prompt marker {answer}")
            seen = len(out.text)
            os.write(leader, line)
            out.wait_for(lambda text: len(text) > seen + 20, f"answer {answer}")
            proc.send_signal(signal.SIGINT)
            err.wait_for(lambda text: text.count("[stopped]") == answer, f"answer {answer} to stop")
            assert proc.poll() is None  # still running, back at the prompt
        err.wait_for(lambda text: text.count(prompt) == 3, "prompt marker 3")
        proc.send_signal(signal.SIGINT)  # at the prompt: a clean exit
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:  # (a check failed: the endless answer must not outlive the test)
            proc.kill()
            proc.wait()
    out.join(), err.join()
    os.close(leader)
    assert "Traceback" not in err.text
