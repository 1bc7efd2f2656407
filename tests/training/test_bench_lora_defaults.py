"""A tiny smoke run of benchmarks/bench_lora_defaults.py (--smoke): two candidates, a few steps, on a
small random base whose characters cover the shipped chat example."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_lora_defaults_benchmark_runs_and_reports_curves(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_lora_defaults.py"), "--smoke",
                           "--json", str(tmp_path / "out.json")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "out.json").read_text())
    assert [r["name"] for r in rows] == ["default", "old-default"]
    assert all([step for step, _ in r["curve"]] == [2, 4] and 0.0 <= r["answered_train"] <= 1.0 for r in rows)
    assert rows[0]["method"]["lora_sites"] != rows[1]["method"]["lora_sites"]  # the defaults are not the old ones
    assert "load average" in proc.stderr and "answered train" in proc.stdout
