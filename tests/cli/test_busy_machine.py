"""A busy machine (issue 32): with other processes holding cores, `train`, `finetune` and `eval`
compute on the cores left free, say so in one line, and the training estimate holds within 2x.

The load is real: busy-loop processes beside the test, as `benchmarks/bench_llamacpp.py --busy`
starts them (on a shared machine, on top of whatever else runs there)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest
import torch

from glasslm import runtime
from glasslm.cli import main

# alone: the busy loops must be the only load (under xdist, no other test runs beside these)
pytestmark = pytest.mark.alone

TEMPLATE = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"


@contextmanager
def busy_loops(n: int):
    """`n` processes that spin on a core each until the block ends."""
    processes = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.3)  # started (a spinning interpreter is runnable from its first instruction anyway)
        yield
    finally:
        for process in processes:
            process.kill()
        for process in processes:
            process.wait()


def busy_count() -> int:
    """Busy loops enough to take every core of a small machine (capped, so a big one is not swamped)."""
    return min(runtime.machine_cores(), 4)


def test_busy_loops_count_as_load_at_once(monkeypatch):
    # The 1-minute load average lags a load that has just begun; the runnable count does not.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    n, cores = busy_count(), runtime.machine_cores()
    with busy_loops(n):
        assert runtime.runnable_now() >= n - 0.5
        assert runtime.machine_load() >= n - 0.5
        choice = runtime.choose_threads()
    assert 1 <= choice.threads <= max(1, cores - n)
    assert (choice.note is None) is (choice.threads == cores)


class _Timed:
    """Wraps the loop's estimate and run: what the estimate said, how long the run then took."""

    def __init__(self, monkeypatch):
        import glasslm.training.loop as loop

        self.estimates: list[float] = []
        self.runs: list[float] = []
        estimate, run = loop.estimate_training, loop._train

        def estimating(*args, **kwargs):
            result = estimate(*args, **kwargs)
            self.estimates.append(result.seconds)
            return result

        def running(*args, **kwargs):
            started = time.perf_counter()
            try:
                return run(*args, **kwargs)
            finally:
                self.runs.append(time.perf_counter() - started)

        monkeypatch.setattr(loop, "estimate_training", estimating)
        monkeypatch.setattr(loop, "_train", running)


def _check_threads(err: str, n: int) -> None:
    cores, threads = runtime.machine_cores(), torch.get_num_threads()
    assert 1 <= threads <= max(1, cores - n), err
    if threads < cores:
        assert f"threads: {threads} of {cores} cores" in err and "--threads N" in err, err
    torch.set_num_threads(cores)  # as PyTorch starts, so the next command's choice is seen


@pytest.mark.slow
def test_commands_on_a_busy_machine_use_the_free_cores_and_estimate_within_2x(tmp_path, shakespeare_text,
                                                                               monkeypatch, capsys):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    (tmp_path / "text.txt").write_text(shakespeare_text[:20000])
    lines = [line for line in shakespeare_text[:20000].splitlines() if line.strip()]
    (tmp_path / "chat.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n"
        for q, a in zip(lines[0:80:2], lines[1:80:2])))
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    timed, n = _Timed(monkeypatch), busy_count()
    before = torch.get_num_threads()
    torch.set_num_threads(runtime.machine_cores())
    try:
        with busy_loops(n):
            assert main(["train", "--preset", "shakespeare-char-cpu", "--n-layers", "2", "--data",
                         str(tmp_path / "text.txt"), "--out", str(tmp_path / "base"), "--max-steps", "40",
                         "--batch-size", "8", "--eval-interval", "20", "--eval-iters", "2",
                         "--sample-tokens", "0"]) == 0
            _check_threads(capsys.readouterr().err, n)
            assert main(["finetune", "--checkpoint", str(tmp_path / "base"), "--data", str(tmp_path / "chat.jsonl"),
                         "--chat-template", str(tmp_path / "t.jinja"), "--out", str(tmp_path / "ft"),
                         "--max-steps", "30", "--batch-size", "8", "--eval-interval", "15"]) == 0
            _check_threads(capsys.readouterr().err, n)
            assert main(["eval", "--checkpoint", str(tmp_path / "base"), "--data", str(tmp_path / "text.txt"),
                         "--quiet"]) == 0
            _check_threads(capsys.readouterr().err, n)
    finally:
        torch.set_num_threads(before)
    assert len(timed.estimates) == len(timed.runs) == 2
    for estimate, took in zip(timed.estimates, timed.runs):
        assert 0.5 <= estimate / took <= 2.0, (timed.estimates, timed.runs)
