"""`glasslm generate --interactive` in a real process on a terminal: Ctrl-C stops one answer and
returns to the `> ` prompt; Ctrl-C at the prompt ends the session cleanly (EOF does too:
test_generate.py::test_cli_interactive_answers_each_line)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from glasslm.io.checkpoint import save_checkpoint
from glasslm.presets import get_preset
from glasslm.core.model import TransformerLM
from glasslm.tokenizers import CharTokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    tok = CharTokenizer.from_text("ROMEO: JULIET, what light\n")
    model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=tok.vocab_size, n_layers=1, d_model=32,
                                     n_heads=2, context_length=32))
    return save_checkpoint(tmp_path_factory.mktemp("interactive") / "ckpt", model, tok)


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


@pytest.mark.slow
def test_ctrl_c_stops_the_answer_not_the_session(checkpoint):
    import pty

    leader, follower = pty.openpty()  # stdin is a terminal, as for a person typing
    # An answer of a million tokens past every <|endoftext|> never ends by itself: only Ctrl-C can end it.
    proc = subprocess.Popen([sys.executable, "-m", "glasslm.cli", "generate", "--checkpoint", str(checkpoint),
                             "--interactive", "--max-new-tokens", "1000000", "--ignore-eos"],
                            stdin=follower, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    os.close(follower)
    out, err = Reader(proc.stdout), Reader(proc.stderr)
    out.start(), err.start()
    for answer in (1, 2):
        err.wait_for(lambda text: text.count("> ") == answer, f"prompt marker {answer}")
        seen = len(out.text)
        os.write(leader, b"ROMEO:\n")
        out.wait_for(lambda text: len(text) > seen + 20, f"answer {answer}")
        proc.send_signal(signal.SIGINT)
        err.wait_for(lambda text: text.count("[stopped]") == answer, f"answer {answer} to stop")
        assert proc.poll() is None  # still running, back at the prompt
    err.wait_for(lambda text: text.count("> ") == 3, "prompt marker 3")
    proc.send_signal(signal.SIGINT)  # at the prompt: a clean exit
    assert proc.wait(timeout=60) == 0
    out.join(), err.join()
    os.close(leader)
    assert "Traceback" not in err.text
