"""A corpus of bad inputs to the command line: each must end in ONE line `glasslm CMD: error: ...`
on stderr (never a traceback), a nonzero exit status, and no existing file changed.

Most cases call `glasslm.cli.main` in this process (a torch import per case would cost ~2 s); an
uncaught exception there fails the test just as a traceback would. The signal cases need a real
process and run `python -m glasslm.cli`.
Families: CLI arguments, data/prepare, checkpoints, generation, Hugging Face conversion,
overwriting, signals during prepare, a full disk during prepare.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from glasslm.cli import main

TEXT = "ROMEO:\nBut, soft! what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n" * 40
TINY = ["--n-layers", "1", "--d-model", "32", "--n-heads", "2", "--context-length", "32"]


# --- shared assets, built once and copied into every case's own directory ---------------------------

@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """text.txt, a run directory (run/), a prepared dataset (ds/), a BPE tokenizer (tok/) and an HF
    Llama directory (hf/): everything the cases damage or point at."""
    import torch

    from glasslm.presets import get_preset
    from glasslm.hf import export_hf
    from glasslm.core.model import TransformerLM

    root = tmp_path_factory.mktemp("assets")
    (root / "text.txt").write_text(TEXT)
    assert main(["train", "--data", str(root / "text.txt"), "--out", str(root / "run"), "--max-steps", "2",
                 "--eval-iters", "1", "--batch-size", "2", "--no-progress", "--sample-tokens", "0", *TINY]) == 0
    assert main(["prepare", str(root / "text.txt"), "--out", str(root / "ds"), "--quiet"]) == 0
    assert main(["train-tokenizer", str(root / "text.txt"), "--vocab-size", "270", "--out", str(root / "tok"),
                 "--workers", "1"]) == 0
    torch.manual_seed(0)
    llama = get_preset("llama-tiny", n_layers=1, d_model=32, n_heads=2, n_kv_heads=2, d_mlp=64, vocab_size=64,
                       context_length=32)
    export_hf(TransformerLM(llama), root / "hf")
    return root


@pytest.fixture
def work(assets, tmp_path) -> Path:
    shutil.copytree(assets, tmp_path, dirs_exist_ok=True)
    return tmp_path


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file and a marker for every directory under `root`."""
    tree = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        tree[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "<dir>"
    return tree


def checkpoint_dir(work: Path) -> Path:
    return work / "run" / (work / "run" / "latest").read_text().strip()


def unwritable_dir(work: Path) -> Path:
    """A directory this process cannot create entries in (root ignores permission bits: use /sys)."""
    if os.geteuid() == 0:
        return Path("/sys")
    locked = work / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    return locked


# --- the cases --------------------------------------------------------------------------------------

@dataclass
class Case:
    id: str
    argv: Callable[[Path], list[str]]  # given the case's directory; may damage files there first
    error: str                          # regex the single error line must match


def _meta(work: Path, change: Callable[[dict], object]) -> Path:
    meta = json.loads((work / "ds" / "meta.json").read_text())
    (work / "ds" / "meta.json").write_text(json.dumps(change(meta)))
    return work / "ds"


def _char_tokenizer_without_chars(work: Path) -> Path:
    ckpt = checkpoint_dir(work)
    (ckpt / "glasslm_char_tokenizer.json").write_text(json.dumps({"kind": "char"}))
    return ckpt


def _state_without_step(work: Path) -> Path:
    ckpt = checkpoint_dir(work)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    del state["step"]
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    return work / "run"


def _hf_weights(work: Path, damage: str) -> Path:
    weights = work / "hf" / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:200])
    else:
        weights.write_bytes(os.urandom(4096))
    return work / "hf"


def _interrupted_prepare(work: Path) -> Path:
    """What a SIGKILL during prepare leaves: the marker and a half-written token file."""
    ds = work / "half"
    ds.mkdir()
    (ds / ".prepare-incomplete").write_text("")
    (ds / ".train.bin.tmp").write_bytes(b"\0" * 10)
    return ds


def _a_file(work: Path) -> Path:
    (work / "afile").write_text("keep me")
    return work / "afile"


CASES = [
    # CLI arguments
    Case("cli-context-length-0", lambda w: ["convert", "--from-hf", str(w / "hf"), "--out", str(w / "new"),
                                            "--context-length", "0"], r"--context-length.*at least 1"),
    Case("cli-eval-max-tokens-0", lambda w: ["eval", "--checkpoint", str(w / "run"), "--data", str(w / "text.txt"),
                                             "--max-tokens", "0"], r"--max-tokens.*at least 1"),
    Case("cli-eval-batch-size-0", lambda w: ["eval", "--checkpoint", str(w / "run"), "--data", str(w / "text.txt"),
                                             "--batch-size", "0"], r"--batch-size.*at least 1"),
    # data and prepare
    Case("prepare-out-is-a-file", lambda w: ["prepare", str(w / "text.txt"), "--out", str(_a_file(w)), "--quiet"],
         r"is an existing file"),
    Case("prepare-out-under-a-file", lambda w: ["prepare", str(w / "text.txt"), "--out", str(_a_file(w) / "x"),
                                                "--quiet"], r"Not a directory"),
    Case("prepare-out-unwritable", lambda w: ["prepare", str(w / "text.txt"), "--out",
                                              str(unwritable_dir(w) / "ds"), "--quiet"],
         r"(Permission denied|Operation not permitted|Read-only)"),
    Case("prepare-input-inside-out", lambda w: ["prepare", str(w / "text.txt"), "--out", str(w), "--overwrite",
                                                "--quiet"], r"would overwrite the input"),
    Case("meta-without-dtype", lambda w: ["train", "--data", str(_meta(w, lambda m: {k: v for k, v in m.items()
                                                                                    if k != "dtype"})),
                                          "--out", str(w / "new"), *TINY], r"dtype should be uint16 or uint32"),
    Case("meta-is-a-list", lambda w: ["train", "--data", str(_meta(w, lambda m: [m])), "--out", str(w / "new"),
                                      *TINY], r"should hold a JSON object"),
    Case("meta-dtype-float99", lambda w: ["eval", "--checkpoint", str(w / "run"),
                                          "--data", str(_meta(w, lambda m: {**m, "dtype": "float99"}))],
         r"float99"),
    Case("interrupted-prepare-reads-as-such", lambda w: ["eval", "--checkpoint", str(w / "run"),
                                                         "--data", str(_interrupted_prepare(w))],
         r"incomplete preparation.*rerun prepare with --overwrite"),
    Case("train-out-is-a-file", lambda w: ["train", "--data", str(w / "text.txt"), "--out", str(_a_file(w)),
                                           "--max-steps", "1", *TINY], r"(File exists|is an existing file|not a directory|is a file)"),
    Case("train-out-under-a-file", lambda w: ["train", "--data", str(w / "text.txt"), "--out", str(_a_file(w) / "x"),
                                              "--max-steps", "1", *TINY], r"([Nn]ot a directory|is a file)"),
    Case("train-out-unwritable", lambda w: ["train", "--data", str(w / "text.txt"),
                                            "--out", str(unwritable_dir(w) / "x"), "--max-steps", "1", *TINY],
         r"(Permission denied|Operation not permitted|Read-only)"),
    # checkpoints
    Case("char-tokenizer-without-chars", lambda w: ["generate", "--checkpoint", str(_char_tokenizer_without_chars(w)),
                                                    "--prompt", "R", "--max-new-tokens", "2"], r"needs \"chars\""),
    Case("trainer-state-without-step", lambda w: ["train", "--resume", str(_state_without_step(w)),
                                                  "--max-steps", "4"], r"lacks step"),
    # generation
    Case("prompt-file-is-a-directory", lambda w: ["generate", "--checkpoint", str(w / "run"),
                                                  "--prompt-file", str(w / "ds")], r"is a directory"),
    # Hugging Face conversion
    Case("hf-safetensors-truncated", lambda w: ["convert", "--from-hf", str(_hf_weights(w, "truncated")),
                                                "--out", str(w / "new")], r"not a readable safetensors file"),
    Case("hf-safetensors-random-bytes", lambda w: ["generate", "--checkpoint", str(_hf_weights(w, "random")),
                                                   "--prompt", "R"], r"not a readable safetensors file"),
    Case("to-hf-out-is-a-file", lambda w: ["convert", "--to-hf", "--checkpoint", str(w / "run"),
                                           "--out", str(_a_file(w))], r"is an existing file"),
    Case("to-hf-out-under-a-file", lambda w: ["convert", "--to-hf", "--checkpoint", str(w / "run"),
                                              "--out", str(_a_file(w) / "x")], r"Not a directory"),
    Case("to-hf-out-unwritable", lambda w: ["convert", "--to-hf", "--checkpoint", str(w / "run"),
                                            "--out", str(unwritable_dir(w) / "x")],
         r"(Permission denied|Operation not permitted|Read-only)"),
    Case("train-tokenizer-out-is-a-file", lambda w: ["train-tokenizer", str(w / "text.txt"), "--vocab-size", "270",
                                                     "--out", str(_a_file(w))], r"is an existing file"),
    Case("train-tokenizer-out-under-a-file", lambda w: ["train-tokenizer", str(w / "text.txt"), "--vocab-size",
                                                        "270", "--out", str(_a_file(w) / "x")], r"Not a directory"),
    Case("train-tokenizer-out-unwritable", lambda w: ["train-tokenizer", str(w / "text.txt"), "--vocab-size", "270",
                                                      "--out", str(unwritable_dir(w) / "x"), "--workers", "1"],
         r"(Permission denied|Operation not permitted|Read-only)"),
    # overwriting what exists
    Case("from-hf-out-existing-run", lambda w: ["convert", "--from-hf", str(w / "hf"), "--out", str(w / "run")],
         r"not empty.*--overwrite"),
    Case("from-hf-out-is-its-input", lambda w: ["convert", "--from-hf", str(w / "hf"), "--out", str(w / "hf"),
                                                "--overwrite"], r"would overwrite the input"),
    Case("to-hf-out-is-its-input", lambda w: ["convert", "--to-hf", "--zero-biases", "--checkpoint", str(checkpoint_dir(w)),
                                              "--out", str(checkpoint_dir(w)), "--overwrite"],
         r"would overwrite the input"),
    Case("train-out-existing-run", lambda w: ["train", "--data", str(w / "text.txt"), "--out", str(w / "run"),
                                              "--max-steps", "1", *TINY], r"not empty.*--resume.*--overwrite"),
    Case("prepare-out-existing-run", lambda w: ["prepare", str(w / "text.txt"), "--out", str(w / "run"), "--quiet"],
         r"not empty.*--overwrite"),
    Case("train-tokenizer-out-existing", lambda w: ["train-tokenizer", str(w / "text.txt"), "--vocab-size", "270",
                                                    "--out", str(w / "tok"), "--workers", "1"], r"not empty.*--overwrite"),
]


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's usage errors
        code = exit_.code
    return code, capsys.readouterr().err


def assert_one_line_error(code: int, err: str, pattern: str) -> None:
    assert code not in (0, None), f"accepted: {err}"
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    assert re.search(pattern, errors[0]), errors[0]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_error_and_changes_nothing(case, work, capsys):
    argv = case.argv(work)  # damages the case's own copy first
    before = snapshot(work)
    code, err = run_main(argv, capsys)
    assert_one_line_error(code, err, case.error)
    assert snapshot(work) == before


def test_overwrite_is_explicit(work, capsys):
    """The refusals above are not blanket: --overwrite replaces what --out holds."""
    code, err = run_main(["prepare", str(work / "text.txt"), "--out", str(work / "run"), "--overwrite", "--quiet"],
                         capsys)
    assert code == 0, err
    assert sorted(p.name for p in (work / "run").iterdir()) == ["glasslm_char_tokenizer.json", "meta.json", "train.bin",
                                                                  "val.bin"]


# --- full disk and signals during prepare -------------------------------------------------------------

def test_full_disk_during_prepare_leaves_nothing(work, capsys, monkeypatch):
    import glasslm.data.prepared

    real_flush, calls = glasslm.data.prepared._flush, []

    def flush_until_full(block, f, dtype, vocab_size):
        calls.append(1)
        if len(calls) > 1:  # the first block lands, the second finds the disk full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f.name)
        return real_flush(block, f, dtype, vocab_size)

    monkeypatch.setattr(glasslm.data.prepared, "_flush", flush_until_full)
    big = work / "big.txt"
    big.write_text(TEXT * 20)  # more than one 64k-token block
    before = snapshot(work)
    code, err = run_main(["prepare", str(big), "--out", str(work / "new"), "--quiet"], capsys)
    assert_one_line_error(code, err, r"no space left.*removed the partial dataset")
    assert len(calls) == 2
    assert snapshot(work) == before  # no new/ directory, no .tmp


def _cli(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "glasslm.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def _signal_each_once_writing(procs: dict[signal.Signals, subprocess.Popen], outs: dict[signal.Signals, Path]) -> None:
    """Send each process its signal as soon as its token file is being written."""
    waiting, deadline = dict(procs), time.monotonic() + 120
    while waiting:
        for sig, proc in list(waiting.items()):
            if (outs[sig] / ".train.bin.tmp").exists():
                proc.send_signal(sig)
                del waiting[sig]
            else:
                assert proc.poll() is None, f"prepare ended before it could be interrupted: {proc.communicate()}"
        assert time.monotonic() < deadline
        time.sleep(0.002)


@pytest.mark.slow
def test_signals_during_prepare(work, capsys):
    """SIGTERM: prepare removes what it wrote. SIGKILL (no chance to clean up): what is left is named
    an incomplete preparation by every command that reads it, and prepare --overwrite redoes it.
    Both processes start together, so their imports overlap."""
    big = work / "big.txt"
    big.write_text(TEXT * 2000)  # 8 MB: writing it takes long enough (~1 s) to be caught mid-way
    outs = {sig: work / f"new-{sig.name}" for sig in (signal.SIGTERM, signal.SIGKILL)}
    procs = {sig: _cli("prepare", str(big), "--out", str(out), "--quiet") for sig, out in outs.items()}
    _signal_each_once_writing(procs, outs)
    _, err = procs[signal.SIGTERM].communicate(timeout=60)
    assert procs[signal.SIGTERM].returncode == 128 + signal.SIGTERM
    assert "Traceback" not in err and "interrupted" in err
    assert not outs[signal.SIGTERM].exists()  # neither .tmp files nor a half-made directory

    procs[signal.SIGKILL].communicate(timeout=60)
    out = outs[signal.SIGKILL]
    for argv in (["train", "--data", str(out), "--out", str(work / "r2"), *TINY],
                 ["prepare", str(work / "text.txt"), "--out", str(out), "--quiet"]):
        code, err = run_main(argv, capsys)
        assert_one_line_error(code, err, r"incomplete preparation.*rerun prepare with --overwrite")
    assert run_main(["prepare", str(work / "text.txt"), "--out", str(out), "--quiet", "--overwrite"], capsys)[0] == 0
    assert (out / "meta.json").is_file() and not list(out.glob(".*"))


# --- a malicious pickle ---------------------------------------------------------------------------

def test_malicious_pickle_is_refused_and_never_run(work, tmp_path, capsys):
    """An HF pytorch_model.bin whose unpickling would create a file: refused, the file never made."""
    import torch
    from safetensors.torch import load_file

    marker = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self):  # unpickling would call open(marker, "w")
            return (open, (str(marker), "w"))

    weights = work / "hf" / "model.safetensors"
    tensors = load_file(weights)
    weights.unlink()
    torch.save({**tensors, "evil": Payload()}, work / "hf" / "pytorch_model.bin")  # pickling never calls it
    before = snapshot(work)
    code, err = run_main(["convert", "--from-hf", str(work / "hf"), "--out", str(work / "new")], capsys)
    assert_one_line_error(code, err, r"refusing to load pickled code.*\bopen\b")
    assert not marker.exists()
    assert snapshot(work) == before
