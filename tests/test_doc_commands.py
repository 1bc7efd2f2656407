"""The README's and docs' commands refer to runs they make: a newcomer follows them in order."""

import re
import shlex
from pathlib import Path

from glasslm.presets import get_preset

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "scripts" / "demo.sh"]


def _commands(name: str) -> list[list[str]]:
    """Every `glasslm NAME ...` line of the pages, as arguments (comments dropped)."""
    found = []
    for page in PAGES:
        for line in page.read_text(encoding="utf-8").splitlines():
            start = line.find(f"glasslm {name} ")
            if start < 0 or line.lstrip().startswith(("#", "|")) or "`" in line[:start]:
                continue
            try:
                words = shlex.split(line[start:], comments=True)
            except ValueError:
                continue
            found.append(words)
    return found


def _option(words: list[str], name: str, default: str | None = None) -> str | None:
    return words[words.index(name) + 1] if name in words else default


def _runs_made() -> dict[str, str]:
    """Run directory -> preset, for each `glasslm train --out DIR` the pages show."""
    runs = {}
    for words in _commands("train"):
        preset = _option(words, "--preset", "shakespeare-char-cpu")
        out = _option(words, "--out", f"runs/{preset}")
        if "--resume" not in words and "--init-from" not in words:
            runs[out] = preset
    return runs


def test_every_eval_stride_fits_the_context_of_a_run_the_docs_make():
    # docs/generation.md once scored runs/shakespeare-char (made by no command shown) with --stride 128,
    # which the README's context-64 run refuses.
    runs, checked = _runs_made(), 0
    for words in _commands("eval"):
        checkpoint, stride = _option(words, "--checkpoint"), _option(words, "--stride")
        if stride is None or checkpoint is None or not checkpoint.startswith("runs/"):
            continue
        assert checkpoint in runs, f"{' '.join(words)}: no command in the docs makes {checkpoint}"
        context = get_preset(runs[checkpoint]).context_length
        assert 1 <= int(stride) <= context, f"{' '.join(words)}: {checkpoint} has context {context}"
        checked += 1
    assert checked >= 2  # the README's and docs/generation.md's
