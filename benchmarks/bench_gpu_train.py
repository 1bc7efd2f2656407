"""Training throughput and MFU: GPT-2 small (124M) in bf16 on random tokens, the glasslm training
step (forward, backward, clipping, optimizer), eager or compiled; under torchrun with --fsdp, FSDP2
over the processes. Prints tokens/s (all processes) and MFU against the GPU's dense bf16 peak
(glasslm.training.flops: 6 N + 12 L d T FLOPs per token).

    python benchmarks/bench_gpu_train.py                         # one GPU, eager
    python benchmarks/bench_gpu_train.py --compile               # one GPU, torch.compile
    torchrun --nproc-per-node 8 benchmarks/bench_gpu_train.py --fsdp --compile
    python benchmarks/bench_gpu_train.py --smoke                 # a tiny model on the CPU, float32, a few steps (the test suite runs it)

scripts/gpu_check.sh runs the GPU lines.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from glasslm.presets import get_preset
from glasslm.training.config import TrainConfig
from glasslm.training.distributed import init_distributed, shutdown_distributed
from glasslm.training.flops import mfu, peak_flops, training_flops_per_token
from glasslm.training.parts import TrainingParts
from glasslm.training.step import train_step


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpt2-small")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per process per step")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20, help="timed steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation, allocator)")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 under torchrun (else DDP)")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="a 2-layer model on the CPU in float32, 2+1 steps")
    return parser.parse_args()


def step_seconds(parts: TrainingParts, steps: int, warmup: int) -> list[float]:
    """Seconds of each timed training step (the device synchronised around each)."""
    cuda = torch.device(parts.device).type == "cuda"
    times = []
    for i in range(warmup + steps):
        x, y = parts.next_batch()
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        train_step(parts, x, y)
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - started)
    return times


def main() -> None:
    args = parse()
    if args.smoke:
        args.steps, args.warmup, args.batch_size, args.seq_len = 2, 1, 2, 32
    ctx = init_distributed("cpu" if args.smoke else "cuda")
    config = get_preset(args.preset, context_length=args.seq_len,
                        **({"n_layers": 2, "d_model": 64, "n_heads": 4, "vocab_size": 256} if args.smoke else {}))
    cfg = TrainConfig(batch_size=args.batch_size, dtype="float32" if args.smoke else "bfloat16", compile=args.compile,
                      fsdp=args.fsdp, activation_checkpointing=args.activation_checkpointing, progress=False,
                      optimizer="adamw", warmup_steps=0)
    tokens = torch.randint(0, config.vocab_size, (args.seq_len * 4096,), generator=torch.Generator().manual_seed(0))
    try:
        parts = TrainingParts.build(config, cfg, ctx, ctx.device, None, (tokens, None))
        median = statistics.median(step_seconds(parts, args.steps, args.warmup))
    finally:
        shutdown_distributed()
    if not ctx.is_main:
        return
    tokens_per_s = args.batch_size * args.seq_len * ctx.world_size / median
    name = torch.cuda.get_device_name(ctx.device) if ctx.device.startswith("cuda") else "cpu"
    peak = peak_flops(name)
    flops = training_flops_per_token(config)
    share = f"{mfu(tokens_per_s, flops, peak * ctx.world_size):.1%}" if peak else f"n/a (no known peak for {name})"
    mode = ("FSDP2" if args.fsdp else "DDP") if ctx.enabled else "1 process"
    print(f"{args.preset} {cfg.dtype} {'compiled' if args.compile else 'eager'} {mode} x{ctx.world_size} on {name}: "
          f"{tokens_per_s:,.0f} tokens/s (median step {median * 1000:.1f} ms, batch {args.batch_size} x {args.seq_len}), "
          f"{flops / 1e9:.3f} GFLOPs/token, MFU {share}")


if __name__ == "__main__":
    main()
