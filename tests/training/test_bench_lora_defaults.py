"""A tiny smoke run of benchmarks/bench_lora_defaults.py: two candidates, a few steps, on a small
random base whose characters cover the shipped chat example."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from glasslm.core.model import TransformerLM
from glasslm.io.checkpoint import save_checkpoint
from glasslm.presets import get_preset
from glasslm.tokenizers import CharTokenizer

ROOT = Path(__file__).resolve().parents[2]


def test_the_lora_defaults_benchmark_runs_and_reports_curves(tmp_path):
    examples = ROOT / "examples" / "chat"
    text = (examples / "shakespeare.jsonl").read_text() + "USER: ASSISTANT\n"
    tokenizer = CharTokenizer.from_text(text)
    torch.manual_seed(0)
    config = get_preset("shakespeare-char-cpu", vocab_size=tokenizer.vocab_size, n_layers=1, d_model=32, n_heads=2)
    save_checkpoint(tmp_path / "base", TransformerLM(config), tokenizer)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_lora_defaults.py"), "--base",
                           str(tmp_path / "base"), "--candidates", "default,old-default", "--steps", "4",
                           "--eval-every", "2", "--asked", "4", "--json", str(tmp_path / "out.json")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "out.json").read_text())
    assert [r["name"] for r in rows] == ["default", "old-default"]
    assert all([step for step, _ in r["curve"]] == [2, 4] and 0.0 <= r["answered_train"] <= 1.0 for r in rows)
    assert rows[0]["method"]["lora_sites"] != rows[1]["method"]["lora_sites"]  # the defaults are not the old ones
    assert "load average" in proc.stderr and "answered train" in proc.stdout
