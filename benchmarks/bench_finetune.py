"""Fine-tuning cost on CPU: peak memory and tokens/s of one training step for a full fine-tune,
LoRA and QLoRA (int4 base), beside peft + transformers doing the same LoRA step on the same weights.

    python benchmarks/bench_finetune.py                     # both shapes, 5 timed steps each
    python benchmarks/bench_finetune.py --shapes gpt2-small --steps 3 --threads 2
    python benchmarks/bench_finetune.py --smoke             # both shapes cut to 2 narrow layers, 1 step (the test suite runs it)

Shapes (random weights; speed and memory do not depend on their values): GPT-2 small (124M) and a
SmolLM-360M-shaped Llama (32 layers, d_model 960, 15 heads / 5 KV heads, tied embeddings).

Memory: each variant runs in a fresh subprocess. After its model is built (and quantized, and
given adapters) the process's RSS high-water mark is reset (/proc/self/clear_refs), then it trains
`--steps` steps; the peak reported is VmHWM afterwards: what training needs with the model resident
(weights, gradients, AdamW's two moments, activations), less the RSS of the interpreter and torch
measured before the model was built ("process MB" keeps it in). Set-up itself briefly holds the
fp32 model before quantizing it; that is not counted (freed memory is trimmed before the reset).

Speed: in one process per shape, glasslm's LoRA step and peft's LoRA step on the same weights
(the same sites, rank, alpha) run in turns (interleaved), medians over the repeats, ratio glasslm / peft.
A step is forward, backward and an AdamW step on `--batch` sequences of `--seq` tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from glasslm.core.model import TransformerLM
from glasslm.presets import get_preset
from glasslm.transforms import apply_transform
from glasslm.transforms.lora import LoRAConfig

SITES = {"gpt2-small": ("q", "k", "v"), "smollm-360m": ("q", "v")}  # peft's c_attn adapts GPT-2's whole qkv
PEFT_TARGETS = {"gpt2-small": ["c_attn"], "smollm-360m": ["q_proj", "v_proj"]}
RANK, ALPHA = 8, 16.0


SMOKE = dict(vocab_size=512, d_model=64, n_layers=2, n_heads=2, n_kv_heads=None, d_mlp=128, context_length=64)


def config(shape: str, smoke: bool = False):
    """The shape's config; with `smoke`, the same family cut to 2 layers of width 64 (seconds, not minutes)."""
    if shape == "gpt2-small":
        cfg = get_preset("gpt2-small", context_length=1024)
    else:
        cfg = get_preset("llama-tiny").replace(vocab_size=49152, d_model=960, n_layers=32, n_heads=15, n_kv_heads=5,
                                               d_mlp=2560, context_length=2048, tie_embeddings=True, rope_theta=10000.0)
    return cfg.replace(**{**SMOKE, "n_kv_heads": 1 if shape != "gpt2-small" else None}) if smoke else cfg


def build(shape: str, variant: str, smoke: bool = False) -> TransformerLM:
    """The model to train: every weight (full), or a frozen base (int4 for qlora) with adapters."""
    torch.manual_seed(0)
    model = TransformerLM(config(shape, smoke))
    if variant == "qlora":
        apply_transform(model, "int4")
    if variant in ("lora", "qlora"):
        apply_transform(model, "lora", LoRAConfig(rank=RANK, alpha=ALPHA, sites=SITES[shape]))
    return model.train()


def glasslm_step(model, optimizer, ids):
    logits = model(ids[:, :-1])                                                         # (batch, seq, vocab)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def peak_rss_child(shape: str, variant: str, steps: int, batch: int, seq: int, smoke: bool) -> None:
    """(subprocess) Build, reset the RSS high-water mark, train `steps` steps, print the peak as JSON."""
    import ctypes
    import gc

    baseline = _status_mb("VmRSS")  # the interpreter and torch, before any model
    model = build(shape, variant, smoke)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # give back what set-up freed (QLoRA's fp32 weights)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    started = time.perf_counter()
    for _ in range(steps):
        glasslm_step(model, optimizer, ids)
    elapsed = time.perf_counter() - started
    print(json.dumps({"peak_mb": _status_mb("VmHWM") - baseline, "process_peak_mb": _status_mb("VmHWM"),
                      "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
                      "tokens_per_s": steps * batch * seq / elapsed}))


def _status_mb(field: str) -> float:
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    return int(status[field].split()[0]) / 1024


def peak_memory(shape: str, variant: str, args) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", shape, variant, "--steps", str(args.steps),
                          "--batch", str(args.batch), "--seq", str(args.seq), "--threads", str(args.threads),
                          *(["--smoke"] if args.smoke else [])],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def peft_model(shape: str, ours: TransformerLM):
    """transformers + peft LoRA on the same base weights (exported through glasslm.hf)."""
    import peft
    import transformers

    from glasslm.hf import export_hf

    with tempfile.TemporaryDirectory() as folder:
        export_hf(ours, folder)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=PEFT_TARGETS[shape],
                             fan_in_fan_out=shape == "gpt2-small")
    return peft.get_peft_model(hf, config).train()


def speed(shape: str, args) -> dict[str, float]:
    """Median seconds per step of glasslm LoRA and peft LoRA, timed in turns."""
    torch.manual_seed(0)
    base = TransformerLM(config(shape, args.smoke))
    theirs = peft_model(shape, base)
    apply_transform(base, "lora", LoRAConfig(rank=RANK, alpha=ALPHA, sites=SITES[shape]))
    base.train()
    ids = torch.randint(0, base.config.vocab_size, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
    ours_opt = torch.optim.AdamW([p for p in base.parameters() if p.requires_grad], lr=1e-4)
    theirs_opt = torch.optim.AdamW([p for p in theirs.parameters() if p.requires_grad], lr=1e-4)

    def peft_step():
        out = theirs(input_ids=ids[:, :-1], labels=ids[:, :-1])  # labels shifted inside: the same positions
        out.loss.backward()
        theirs_opt.step()
        theirs_opt.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {"glasslm": [], "peft": []}
    steps = {"glasslm": lambda: glasslm_step(base, ours_opt, ids), "peft": peft_step}
    for name in steps:  # warm-up
        steps[name]()
    for _ in range(args.steps):
        for name, step in steps.items():
            started = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="gpt2-small,smollm-360m")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--child", nargs=2, metavar=("SHAPE", "VARIANT"))
    parser.add_argument("--memory-only", action="store_true", help="skip the timed comparison with peft")
    parser.add_argument("--smoke", action="store_true", help="2 narrow layers, 1 step of 1 x 16 tokens: checks it runs")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.batch, args.seq = 1, 1, 16
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        peak_rss_child(*args.child, args.steps, args.batch, args.seq, args.smoke)
        return
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads; batch {args.batch} x {args.seq} tokens, "
          f"{args.steps} steps; LoRA rank {RANK}, alpha {ALPHA:g}")
    for shape in args.shapes.split(","):
        memory = {variant: peak_memory(shape, variant, args) for variant in ("full", "lora", "qlora")}
        timed = None if args.memory_only else speed(shape, args)
        full = memory["full"]["peak_mb"]
        print(f"\n{shape}")
        print(f"{'variant':<12}{'trainable':>14}{'peak MB':>10}{'x full':>8}{'process MB':>12}{'tokens/s':>10}")
        for variant, row in memory.items():
            print(f"{variant:<12}{row['trainable']:>14,}{row['peak_mb']:>10.0f}{row['peak_mb'] / full:>8.2f}"
                  f"{row['process_peak_mb']:>12.0f}{row['tokens_per_s']:>10.0f}")
        if timed is None:
            continue
        tokens = args.batch * args.seq
        print(f"LoRA step, same process, interleaved medians: glasslm {timed['glasslm']:.3f} s "
              f"({tokens / timed['glasslm']:.0f} tokens/s), peft {timed['peft']:.3f} s "
              f"({tokens / timed['peft']:.0f} tokens/s); glasslm / peft = {timed['glasslm'] / timed['peft']:.2f}x")


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
