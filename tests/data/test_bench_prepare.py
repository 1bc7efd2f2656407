"""A tiny smoke run of benchmarks/bench_prepare.py (--smoke): prepare's tokens/s beside tiktoken's and
tokenizers' batch encoding of the same 0.3 MB of JSONL, with the load average beside them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_prepare_benchmark_runs_and_reports_the_ratio(tmp_path, data_dir):
    env = {**os.environ, "GLASSLM_DATA_DIR": str(data_dir), "TIKTOKEN_CACHE_DIR": str(data_dir / "tiktoken_cache")}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_prepare.py"), "--smoke", "--workers", "2",
                           "--json", str(tmp_path / "out.json")], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    speeds = json.loads((tmp_path / "out.json").read_text())
    assert set(speeds) == {"prepare", "tiktoken", "tokenizers", "ratio"}
    assert all(value > 0 for value in speeds.values())
    assert speeds["ratio"] == speeds["prepare"] / speeds["tiktoken"]
    assert "load average" in proc.stderr and "prepare / tiktoken batch" in proc.stdout
