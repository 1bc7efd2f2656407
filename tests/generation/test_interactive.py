"""`glasslm generate --interactive` in a real process on a terminal: Ctrl-C stops one answer and
returns to the `> ` prompt; Ctrl-C at the prompt ends the session cleanly (EOF does too:
test_generate.py::test_cli_interactive_answers_each_line)."""

from __future__ import annotations

from pathlib import Path

import pytest

from glasslm.io.checkpoint import save_checkpoint
from glasslm.presets import get_preset
from glasslm.core.model import TransformerLM
from glasslm.tokenizers import CharTokenizer
from terminal_session import interrupt_two_answers


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    tok = CharTokenizer.from_text("ROMEO: JULIET, what light\n")
    model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=tok.vocab_size, n_layers=1, d_model=32,
                                     n_heads=2, context_length=32))
    return save_checkpoint(tmp_path_factory.mktemp("interactive") / "ckpt", model, tok)


@pytest.mark.slow
def test_ctrl_c_stops_the_answer_not_the_session(checkpoint):
    # An answer of a million tokens past every <|endoftext|> never ends by itself: only Ctrl-C can end it.
    interrupt_two_answers(["generate", "--checkpoint", str(checkpoint), "--interactive", "--max-new-tokens", "1000000",
                           "--ignore-eos"], "> ", b"ROMEO:\n")
