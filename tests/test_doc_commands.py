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


def _run_paths() -> tuple[dict[str, str], list[tuple[str, str]]]:
    """(every runs/... directory a page's command writes -> the command, every runs/... directory a
    command reads -> the command); `glasslm train` without --out writes runs/PRESET."""
    made, used = {}, []
    for name in ("train", "finetune", "convert", "merge", "quantize", "generate", "eval", "serve", "chat", "plot",
                 "inspect", "info"):
        for words in _commands(name):
            words = [w.rstrip("`,") for w in words]
            line = " ".join(words)
            if name == "train" and "--resume" not in words:
                made[_option(words, "--out", f"runs/{_option(words, '--preset', 'shakespeare-char-cpu')}")] = line
            elif "--out" in words:
                made[_option(words, "--out")] = line
            reads = [words[i + 1] for i, w in enumerate(words[:-1])
                     if w in ("--checkpoint", "--resume", "--draft", "--base", "--init-from")]
            reads += [words[2]] if name == "plot" and len(words) > 2 else []
            used += [(path, line) for path in reads if path.startswith("runs/")]
    for page in PAGES:  # the scripts' runs (python scripts/induction_study.py --out runs/induction)
        for found in re.finditer(r"python scripts/\S+ [^`#\n]*--out (\S+)", page.read_text(encoding="utf-8")):
            made[found.group(1).rstrip("`,")] = found.group(0)
    return made, used


def test_every_run_the_pages_read_is_one_their_commands_make():
    # README's examples once read runs/char, runs/base and runs/big, which no command shown makes.
    made, used = _run_paths()
    assert len(used) >= 20
    for path, line in used:
        assert path in made, f"{line}: no command in README, docs/ or demo.sh makes {path}"


def test_the_pages_train_the_demo_model_where_the_demo_does():
    # After `bash scripts/demo.sh`, README's `--checkpoint runs/char` found nothing.
    demo = next(words for words in _commands("train") if "--preset" in words and words[-1] == "$@")
    demo_out = _option(demo, "--out")
    checked = 0
    for words in _commands("train"):
        out = _option(words, "--out", "")
        if "--resume" in words or not out.startswith("runs/") or _option(words, "--data", "tinyshakespeare") \
                != "tinyshakespeare" or _option(words, "--preset", "shakespeare-char-cpu") != _option(demo, "--preset"):
            continue
        assert out == demo_out, " ".join(words)
        checked += 1
    assert demo_out == "runs/shakespeare-char-cpu" and checked >= 3
