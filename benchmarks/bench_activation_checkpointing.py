"""Activation checkpointing (`--activation-checkpointing`): how much peak memory one training step
saves, and what it costs in step time.

Memory: each variant runs in a fresh process (tracemalloc does not see PyTorch's allocations, so
resident memory it is). The child builds the model, runs one forward and backward to warm up (lazy
imports, the allocator's first pages), frees the gradients, resets the kernel's peak-resident-memory
mark (Linux: `5` into /proc/self/clear_refs), then runs the measured forward and backward and
reports the peak (VmHWM) above the resident memory before it: the activations and gradients the
step needs. Both variants hold the same gradients, so the difference is the activations
checkpointing did not keep. The child runs with glibc's mmap threshold fixed at 64 KiB
(MALLOC_MMAP_THRESHOLD_): every tensor buffer is then its own mapping, returned to the system when
freed, so resident memory follows the live tensors (with the default, growing threshold, the
warm-up's freed activations stay resident and hide the step's peak). Linux only.

Time: both variants in one process, steps interleaved (forward, backward, optimizer step), medians
reported with their ratio, so a noisy neighbour slows both alike.

    PYTHONPATH=src python benchmarks/bench_activation_checkpointing.py --threads 1
    PYTHONPATH=src python benchmarks/bench_activation_checkpointing.py --smoke   # a tiny model, one step (the test suite runs it)
"""

from __future__ import annotations

import argparse
import json
import os
import gc
import statistics
import subprocess
import sys
import time

import torch

from glasslm.core.model import TransformerLM
from glasslm.presets import get_preset
from glasslm.training.activations import checkpoint_blocks
from glasslm.training.config import TrainConfig
from glasslm.training.optim import make_optimizer
from glasslm.training.step import forward_backward


def build(args: argparse.Namespace, checkpointing: bool) -> TransformerLM:
    torch.manual_seed(0)
    config = get_preset(args.preset, **({"n_layers": 2, "d_model": 32, "n_heads": 2, "context_length": 32,
                                         "vocab_size": 64} if args.smoke else {}))
    model = TransformerLM(config).train()
    if checkpointing:
        checkpoint_blocks(model)
    return model


def batch(args: argparse.Namespace, model: TransformerLM) -> tuple[torch.Tensor, torch.Tensor]:
    c = model.config
    tokens = torch.randint(0, c.vocab_size, (args.batch_size, c.context_length + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def status_mib(field: str) -> float:
    """A memory figure of this process from /proc/self/status (VmRSS: now, VmHWM: the peak), MiB."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024  # kB


def peak_child(args: argparse.Namespace, checkpointing: bool) -> dict[str, float]:
    """In a fresh process: resident memory before the measured step and the peak during it (MiB)."""
    model = build(args, checkpointing)
    x, y = batch(args, model)
    forward_backward(model, x, y, accum_steps=1)  # warm-up
    model.zero_grad(set_to_none=True)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident memory
    before = status_mib("VmRSS")
    forward_backward(model, x, y, accum_steps=1)
    peak = status_mib("VmHWM")
    return {"before_mib": before, "peak_mib": peak, "step_mib": peak - before}


def measure_peak(args: argparse.Namespace, checkpointing: bool) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", "on" if checkpointing else "off", "--preset", args.preset,
               "--batch-size", str(args.batch_size), "--threads", str(args.threads), *(["--smoke"] if args.smoke else [])]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def step_times(args: argparse.Namespace) -> dict[str, float]:
    """Median seconds per training step of each variant, steps interleaved (after one warm-up each)."""
    models = {"plain": build(args, False), "checkpointed": build(args, True)}
    cfg = TrainConfig(optimizer="adamw")
    optimizers = {name: make_optimizer(model, cfg) for name, model in models.items()}
    x, y = batch(args, models["plain"])
    times: dict[str, list[float]] = {name: [] for name in models}
    for repeat in range(args.steps + 1):
        for name, model in models.items():
            started = time.perf_counter()
            forward_backward(model, x, y, accum_steps=1)
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            if repeat > 0:
                times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="shakespeare-char")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="a tiny model and one timed step")
    parser.add_argument("--child", choices=["on", "off"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(peak_child(args, args.child == "on")))
        return
    if args.smoke:
        args.batch_size, args.steps = 2, 1
    plain, checkpointed = measure_peak(args, False), measure_peak(args, True)
    times = step_times(args)
    print(f"preset {args.preset}, batch {args.batch_size}, {args.threads} thread(s), torch {torch.__version__}")
    print(f"{'':14}{'step peak MiB':>15}{'step s (median)':>17}")
    print(f"{'plain':14}{plain['step_mib']:>15.1f}{times['plain']:>17.4f}")
    print(f"{'checkpointed':14}{checkpointed['step_mib']:>15.1f}{times['checkpointed']:>17.4f}")
    saved = 1 - checkpointed["step_mib"] / plain["step_mib"] if plain["step_mib"] > 0 else float("nan")
    print(f"memory saved: {saved:.0%} of the step's peak; time: {times['checkpointed'] / times['plain']:.2f}x the plain step")


if __name__ == "__main__":
    main()
