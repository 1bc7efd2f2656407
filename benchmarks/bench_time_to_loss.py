"""Wall time to a validation loss: nanoGPT's CPU recipe against glasslm's recipe, in one process.

The reference is nanoGPT's tiny-Shakespeare CPU run (README: 4 layers, 4 heads, d_model 128,
context 64, batch 12, AdamW lr 1e-3 -> 1e-4, beta2 0.99, warmup 100 in nanoGPT's (it+1)/(warmup+1)
form, weight decay 0.1 on every matrix, clip 1.0, 2,000 steps), its model written inline
(bench_train.RefGPT: GPT-2 blocks, no biases, tied embeddings, nanoGPT's init).

glasslm's side is the `shakespeare-char-cpu` preset and its recipe (Llama parts: RoPE, RMSNorm,
SwiGLU; Muon for the blocks' matrices), trained through glasslm's own pieces (make_optimizer,
apply_schedule, get_batch, forward_backward, clip_grad_norm) at the same context and parameter
budget. Both models are evaluated on the WHOLE validation split (every non-overlapping window of
the context length) every --eval-every steps; only training time is counted, not evaluation.
The two runs are interleaved in chunks of --eval-every steps, so a noisy neighbour on a shared
machine slows both alike.

    python benchmarks/bench_time_to_loss.py --threads 2
    python benchmarks/bench_time_to_loss.py --threads 2 --glasslm-preset shakespeare-char-cpu-nanogpt  # same recipe
    python benchmarks/bench_time_to_loss.py --smoke          # 4 steps each, a slice of validation (the test suite runs it)
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import RefGPT, _shakespeare, ref_optimizer  # noqa: E402  (the inline nanoGPT reference)

from glasslm.presets import get_preset
from glasslm.training.config import get_recipe# noqa: E402
from glasslm.data import get_batch  # noqa: E402
from glasslm.core.model import TransformerLM  # noqa: E402
from glasslm.training.optim import clip_grad_norm, make_optimizer  # noqa: E402
from glasslm.training.config import TrainConfig
from glasslm.training.schedule import apply_schedule  # noqa: E402
from glasslm.training.step import forward_backward  # noqa: E402


@dataclass
class Run:
    name: str
    model: nn.Module
    step_fn: object  # (step) -> None: one full training step
    max_steps: int
    step: int = 0
    train_seconds: float = 0.0
    step_times: list[float] = field(default_factory=list)
    curve: list[tuple[int, float, float]] = field(default_factory=list)  # (step, train seconds, val loss)

    def train_chunk(self, n: int) -> None:
        self.model.train()
        for _ in range(min(n, self.max_steps - self.step)):
            start = time.perf_counter()
            self.step_fn(self.step)
            elapsed = time.perf_counter() - start
            self.step_times.append(elapsed)
            self.train_seconds += elapsed
            self.step += 1

    @property
    def done(self) -> bool:
        return self.step >= self.max_steps

    def time_to(self, target: float) -> float | None:
        """Training seconds at the first evaluation at or below `target` (None: never reached)."""
        return next((t for _, t, loss in self.curve if loss <= target), None)


@torch.no_grad()
def whole_split_loss(model: nn.Module, val: torch.Tensor, context: int, batch: int = 256) -> float:
    """Mean next-token loss over every non-overlapping window of the validation split."""
    model.eval()
    n_windows = (len(val) - 1) // context
    x_all = val[: n_windows * context].view(n_windows, context)
    y_all = val[1: n_windows * context + 1].view(n_windows, context)
    total = 0.0
    for i in range(0, n_windows, batch):
        logits = model(x_all[i:i + batch])
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y_all[i:i + batch].reshape(-1),
                                 reduction="sum").item()
    return total / (n_windows * context)


def nanogpt_lr(step: int, lr: float = 1e-3, min_lr: float = 1e-4, warmup: int = 100, decay: int = 2000) -> float:
    """nanoGPT's get_lr (train.py): (it+1)/(warmup+1) warmup, cosine to min_lr at lr_decay_iters."""
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if step > decay:
        return min_lr
    ratio = (step - warmup) / (decay - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def reference_run(train: torch.Tensor, vocab: int, seed: int, max_steps: int = 2000) -> Run:
    torch.manual_seed(seed)
    model = RefGPT(vocab, 64, 128, 4, 4)
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, beta2=0.99, weight_decay=0.1)
    opt = ref_optimizer(model, cfg)
    gen = torch.Generator().manual_seed(seed)

    def step_fn(step: int) -> None:
        for group in opt.param_groups:
            group["lr"] = nanogpt_lr(step)
        x, y = get_batch(train, 12, 64, generator=gen)
        logits = model(x)
        F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1)).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return Run("nanoGPT", model, step_fn, max_steps)


def glasslm_run(preset: str, train: torch.Tensor, vocab: int, seed: int, overrides: dict) -> tuple[Run, TrainConfig]:
    model_cfg = get_preset(preset, vocab_size=vocab)
    cfg = get_recipe(preset, **overrides)
    torch.manual_seed(seed)
    model = TransformerLM(model_cfg)
    opt = make_optimizer(model, cfg)
    gen = torch.Generator().manual_seed(seed)

    def step_fn(step: int) -> None:
        apply_schedule(opt, cfg, step)
        x, y = get_batch(train, cfg.batch_size, model_cfg.context_length, generator=gen)
        forward_backward(model, x, y, cfg.grad_accum_steps)
        clip_grad_norm(model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return Run(f"glasslm {preset}", model, step_fn, cfg.max_steps), cfg


def parse_overrides(items: list[str]) -> dict:
    """FIELD=VALUE pairs for TrainConfig: numbers as numbers, true/false as booleans, the rest as text."""
    out: dict = {}
    for item in items:
        key, value = item.split("=", 1)
        for convert in (int, float, {"true": True, "false": False}.__getitem__, str):
            try:
                out[key] = convert(value)
                break
            except (ValueError, KeyError):
                continue
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--target", type=float, default=1.88, help="validation loss to reach")
    parser.add_argument("--eval-every", type=int, default=50,
                        help="steps between whole-split evaluations (the times to a loss are read at them)")
    parser.add_argument("--glasslm-preset", default="shakespeare-char-cpu")
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="override the glasslm recipe")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--skip-reference", action="store_true", help="tune glasslm's side alone")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--smoke", action="store_true", help="4 steps each, 4,096 validation tokens: checks it runs")
    args = parser.parse_args()
    if args.smoke:
        args.eval_every, args.set = 2, [*args.set, "max_steps=4"]
    text = _shakespeare(args.data_dir)
    if args.threads:
        torch.set_num_threads(args.threads)
    # nanoGPT's shakespeare_char vocabulary for both runs: the 65 characters, without the
    # <|endoftext|> that glasslm's own char tokenizer adds (never in this text, one more logit).
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    n_train = int(0.9 * len(ids))  # nanoGPT's prepare.py split
    train, val = ids[:n_train], ids[n_train:n_train + 4096 if args.smoke else None]
    glasslm, cfg = glasslm_run(args.glasslm_preset, train, len(chars), args.seed, parse_overrides(args.set))
    reference = reference_run(train, len(chars), args.seed, glasslm.max_steps if args.smoke else 2000)
    runs = [glasslm] if args.skip_reference else [reference, glasslm]
    for run in runs:
        n = sum(p.numel() for p in run.model.parameters())
        print(f"{run.name}: {n / 1e6:.3f}M parameters, {run.max_steps} steps")
    print(f"glasslm recipe: {cfg}")
    print(f"threads {torch.get_num_threads()}; evaluating the whole val split ({len(val):,} tokens) every "
          f"{args.eval_every} steps", flush=True)
    while not all(r.done for r in runs):
        for run in runs:  # interleaved chunks: both see the same machine load
            if run.done:
                continue
            run.train_chunk(args.eval_every)
            loss = whole_split_loss(run.model, val, 64)
            run.curve.append((run.step, run.train_seconds, loss))
            print(f"  {run.name:<32} step {run.step:5d}  train {run.train_seconds:7.1f}s  val {loss:.4f}", flush=True)
    print()
    for run in runs:
        best = min(loss for _, _, loss in run.curve)
        t = run.time_to(args.target)
        median_ms = statistics.median(run.step_times) * 1e3
        print(f"{run.name:<32} best val {best:.4f}  total {run.train_seconds:6.1f}s  median step {median_ms:.1f} ms  "
              f"to {args.target}: {'%.1fs' % t if t is not None else 'not reached'}")
    if args.skip_reference:
        return
    ref, ours = runs
    ref_best = min(loss for _, _, loss in ref.curve)
    t_ref_best, t_ours_best = ref.time_to(ref_best), ours.time_to(ref_best)
    if t_ours_best is not None:
        print(f"to the reference's best val loss {ref_best:.4f}: glasslm {t_ours_best:.1f}s vs {t_ref_best:.1f}s "
              f"= {t_ours_best / t_ref_best:.2f}x the reference's time")
    t_ref, t_ours = ref.time_to(args.target), ours.time_to(args.target)
    if t_ours is not None and t_ref is not None:
        print(f"to val {args.target}: glasslm {t_ours:.1f}s vs reference {t_ref:.1f}s = {t_ours / t_ref:.2f}x")
    elif t_ours is not None:
        print(f"to val {args.target}: glasslm {t_ours:.1f}s; the reference never got there in {ref.train_seconds:.1f}s "
              f"(its whole run): glasslm took <= {t_ours / ref.train_seconds:.2f}x the reference's time")
    else:
        print(f"to val {args.target}: glasslm did not get there")


if __name__ == "__main__":
    main()
