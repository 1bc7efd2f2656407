"""On a CUDA GPU (marked `cuda`, skipped without one; scripts/gpu_check.sh runs them): a bf16 training
run's losses follow the CPU float32 run's, a checkpoint written on the GPU loads on the CPU with the
same logits, and greedy decoding gives the CPU's tokens. Without CUDA, scripts/gpu_check.sh fails
saying so, running nothing."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from glasslm.presets import get_preset
from glasslm.training.config import TrainConfig
from glasslm.training.loop import train

ROOT = Path(__file__).resolve().parents[2]
needs_cuda = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
TINY = dict(vocab_size=64, n_layers=2, d_model=64, n_heads=4, context_length=32)


def run(device: str, dtype: str, out: Path):
    tokens = torch.randint(0, 64, (5000,), generator=torch.Generator().manual_seed(0))
    cfg = TrainConfig(max_steps=20, batch_size=8, warmup_steps=2, eval_interval=0, eval_iters=2, log_interval=1,
                      progress=False, device=device, dtype=dtype, optimizer="adamw")
    return train(get_preset("shakespeare-char-cpu", **TINY), cfg, tokens[:4500], tokens[4500:], run_dir=out)


@needs_cuda[0]
@needs_cuda[1]
def test_bf16_training_on_cuda_follows_cpu_float32_and_its_checkpoint_loads_on_cpu(tmp_path):
    gpu, cpu = run("cuda", "bfloat16", tmp_path / "gpu"), run("cpu", "float32", tmp_path / "cpu")
    assert gpu.train_losses == pytest.approx(cpu.train_losses, rel=0.02)
    assert gpu.train_losses[-1] < gpu.train_losses[0]
    from glasslm.io.checkpoint import load_checkpoint

    model, _, _ = load_checkpoint(tmp_path / "gpu")
    x = torch.randint(0, 64, (2, 32))
    with torch.no_grad():
        expected = gpu.model.float()(x.cuda()).cpu()
        assert torch.allclose(model(x), expected, atol=1e-4)


@needs_cuda[0]
@needs_cuda[1]
def test_greedy_decoding_on_cuda_gives_the_cpu_tokens():
    from glasslm.core.model import TransformerLM
    from glasslm.generation import GenerationConfig, generate_tokens

    torch.manual_seed(0)
    model = TransformerLM(get_preset("gpt2-small", n_layers=2, d_model=64, n_heads=4, vocab_size=128)).eval()
    greedy = GenerationConfig(max_new_tokens=16, temperature=0.0)
    on_cpu = list(generate_tokens(model, [1, 2, 3], config=greedy))
    assert list(generate_tokens(model.cuda(), [1, 2, 3], config=greedy)) == on_cpu


def documented_gpu_check_lines() -> list[str]:
    """The docs' `bash scripts/gpu_check.sh` lines (tests/doc_commands.py counts them as run here)."""
    text = (ROOT / "docs" / "training.md").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.startswith("bash scripts/gpu_check.sh")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_gpu_check_says_there_is_no_cuda_device():
    assert documented_gpu_check_lines()
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "gpu_check: no CUDA device" in done.stderr and "nothing was run" in done.stderr
    assert done.stdout == ""
