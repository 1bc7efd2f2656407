"""What the CLI decides from the machine: bf16 units, the slow-dtype warning, decode threads."""

from __future__ import annotations

import os

import pytest

from glasslm import runtime


@pytest.mark.parametrize("flags, has_bf16", [
    ({"avx512f", "avx512_vnni"}, False),   # Intel Xeon without bf16 units
    ({"avx512f", "avx512_bf16"}, True),    # AMD Zen 4
    ({"amx_bf16", "amx_tile"}, True),      # Sapphire Rapids
])
def test_bf16_units_and_the_default_dtype_follow_the_cpu_flags(monkeypatch, capsys, flags, has_bf16):
    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset(flags))
    assert runtime.cpu_has_bf16() is has_bf16
    assert runtime.default_dtype("cpu") == ("bfloat16" if has_bf16 else "float32")
    assert runtime.default_dtype("cuda:0") == "bfloat16"
    runtime.warn_if_slow_dtype("bfloat16", "cpu")
    warning = capsys.readouterr().err
    assert ("no bfloat16 units" in warning) is (not has_bf16)
    runtime.warn_if_slow_dtype("float32", "cpu")
    assert capsys.readouterr().err == ""


def test_small_models_decode_on_one_thread_large_ones_on_every_core():
    below = runtime.ONE_THREAD_BELOW_PARAMETERS
    assert runtime.decode_threads(below - 1, cores=16, load=0.0) == 1
    assert runtime.decode_threads(below, cores=16, load=0.0) == 16
    assert runtime.decode_threads(below, cores=16, load=0.4) == 16  # background noise keeps every core
    assert runtime.decode_threads(below, cores=16, load=4.0) == 12  # four cores taken by other processes
    assert runtime.decode_threads(below, cores=2, load=1.0) == 1  # one core busy: the step's barriers would wait
    assert runtime.decode_threads(below, cores=2, load=12.0) == 1  # never fewer than one
    assert runtime.decode_threads(124_439_808) >= 1


def test_cli_draft_gives_the_same_text_and_reports_acceptance(tmp_path, capsys):
    import torch

    from glasslm.io.checkpoint import save_checkpoint
    from glasslm.cli import main
    from glasslm.presets import get_preset
    from glasslm.core.model import TransformerLM
    from glasslm.tokenizers import CharTokenizer

    tokenizer = CharTokenizer.from_text("abcdefgh ROMEO:\n")
    torch.manual_seed(0)
    target = TransformerLM(get_preset("llama-tiny", vocab_size=tokenizer.vocab_size, init_std=0.2))
    draft = TransformerLM(get_preset("llama-tiny", vocab_size=tokenizer.vocab_size, n_layers=1, init_std=0.2))
    save_checkpoint(tmp_path / "target", target, tokenizer)
    save_checkpoint(tmp_path / "draft", draft, tokenizer)
    common = ["generate", "--checkpoint", str(tmp_path / "target"), "--prompt", "ROMEO:", "--max-new-tokens", "30",
              "--temperature", "0", "--threads", "1"]
    main(common)
    alone = capsys.readouterr().out
    main(common + ["--draft", str(tmp_path / "draft"), "--lookahead", "3"])
    captured = capsys.readouterr()
    assert captured.out == alone
    assert "draft accepted" in captured.err
    assert main(common[:-4] + ["--temperature", "0.8", "--draft", str(tmp_path / "draft")]) not in (0, None)
    assert "add --temperature 0" in capsys.readouterr().err


def test_commands_take_the_free_cores_and_say_why_when_that_is_fewer():
    # What train, finetune, eval (and decoding above 20M parameters) run on without --threads.
    assert runtime.choose_threads(cores=2, load=0.3, environ={}) == runtime.ThreadChoice(2, None)
    assert runtime.choose_threads(cores=16, load=4.0, environ={}).threads == 12
    busy = runtime.choose_threads(cores=2, load=5.2, environ={})
    assert busy.threads == 1 and busy.note.startswith("threads: 1 of 2 cores") and "--threads N" in busy.note
    # A small model decodes on one thread on any machine: a size rule, nothing to explain.
    assert runtime.choose_threads(decoding_parameters=800_000, cores=2, load=0.0, environ={}) == (
        runtime.ThreadChoice(1, None))
    # OMP_NUM_THREADS (torchrun sets it) is the user's choice: PyTorch's count stays.
    assert runtime.choose_threads(cores=2, load=5.2, environ={"OMP_NUM_THREADS": "2"}) == runtime.ThreadChoice(None, None)


def test_threads_asked_for_are_kept_with_a_warning_above_the_free_cores():
    assert runtime.choose_threads(1, cores=2, load=9.0, environ={}) == runtime.ThreadChoice(1, None)
    assert runtime.choose_threads(2, cores=2, load=0.1, environ={}) == runtime.ThreadChoice(2, None)
    loaded = runtime.choose_threads(2, cores=2, load=5.2, environ={})
    assert loaded.threads == 2 and "--threads 2 on a machine whose load leaves 1 of 2 cores free" in loaded.note
    assert "--threads 1 is likely faster" in loaded.note


def test_released_openmp_workers_end_and_a_later_parallel_region_builds_them_again():
    """Issue 42: a server loads on its main thread and decodes on another; the main thread's idle
    OpenMP workers made GNU OpenMP stop spinning between parallel regions (more threads than cores),
    and every served step waited on sleeping workers. The release ends them; the work is unchanged."""
    import subprocess
    import sys

    code = """
import os, time, torch
from glasslm.runtime import release_openmp_threads
torch.set_num_threads(2)
x, w = torch.randn(64, 512), torch.randn(512, 512)
before = x @ w  # a parallel region: the main thread's team of 2
count = lambda: len(os.listdir("/proc/self/task"))
with_team = count()
released = release_openmp_threads()
time.sleep(0.2)  # (the released workers end on their own)
print(released, with_team - count(), torch.equal(x @ w, before))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"})
    assert out.returncode == 0, out.stderr[-2000:]
    released, ended, same = out.stdout.split()
    assert released == "True" and int(ended) == 1 and same == "True"


@pytest.mark.parametrize("load, omp, want", [(0.2, None, 4), (1.6, None, 2), (7.0, None, 1), (0.2, "1", 1)])
def test_loading_runs_on_the_free_cores_and_puts_the_callers_threads_back(monkeypatch, load, omp, want):
    """The one-time layout at load may use every core the load average leaves free (never fewer than
    the caller set, none where OMP_NUM_THREADS decides); the caller's count is back afterwards."""
    import torch

    monkeypatch.setattr(runtime, "machine_cores", lambda: 4)
    monkeypatch.setattr(runtime.os, "getloadavg", lambda: (load, load, load))
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with runtime.loading_threads() as threads:
            assert threads == want == torch.get_num_threads()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
