"""Training speed: glasslm against a minimal nanoGPT-style reference, side by side in one process.

Every variant runs the same full training step (batch sampling, forward, loss, backward, clipping,
AdamW, zero_grad). Variants are interleaved round by round, so a noisy neighbour slows all of them
alike; we report the median step time over all timed steps and the ratio to the reference.

    PYTHONPATH=src python benchmarks/bench_train.py                       # shakespeare-char-cpu-nanogpt table (GPT-2 shape, equal maths)
    PYTHONPATH=src python benchmarks/bench_train.py --preset shakespeare-char --batch-size 8 --steps 3
    PYTHONPATH=src python benchmarks/bench_train.py --matmul-only
    PYTHONPATH=src python benchmarks/bench_train.py --profile             # top ops of one glasslm step
    PYTHONPATH=src python benchmarks/bench_train.py --smoke               # one step of each variant (the test suite runs it)
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from glasslm.presets import get_preset
from glasslm.data import get_batch
from glasslm.core.model import TransformerLM
from glasslm.training.config import TrainConfig
from glasslm.training.optim import make_optimizer
from glasslm.training.step import forward_backward


# ----- the reference: nanoGPT's model, written out minimally with standard torch modules -----

class RefBlock(nn.Module):
    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(b, t, d)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class RefGPT(nn.Module):
    def __init__(self, vocab: int, context: int, d: int, n_layers: int, n_heads: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(RefBlock(d, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d, bias=False)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in nanoGPT
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("c_proj.weight", "mlp_proj.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def ref_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    # nanoGPT: decay every >= 2-D tensor (embeddings too); on CPU it uses the default (foreach) AdamW.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


# ----- timing -----

class Variant:
    def __init__(self, name: str, model: nn.Module, optimizer: torch.optim.Optimizer, dtype: str, glasslm: bool):
        self.name, self.model, self.optimizer, self.dtype, self.glasslm = name, model, optimizer, dtype, glasslm
        self.times: list[float] = []

    def step(self, tokens, batch_size, context, generator, clip: float) -> None:
        x, y = get_batch(tokens, batch_size, context, generator=generator)
        autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if self.dtype == "bf16" else nullcontext
        if self.glasslm:
            forward_backward(self.model, x, y, 1, autocast)
        else:
            with autocast():
                logits = self.model(x)
            F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1)).backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), clip, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def build_variants(preset: str, which: list[str], cfg: TrainConfig) -> list[Variant]:
    variants = []
    model_cfg = get_preset(preset, dropout=0.0)
    for spec in which:
        kind, dtype = spec.split("-")  # e.g. "ref-fp32", "fast-bf16", "readable-fp32", "llama-bf16"
        torch.manual_seed(0)
        if kind == "ref":
            c = model_cfg
            model = RefGPT(c.vocab_size, c.context_length, c.d_model, c.n_layers, c.n_heads)
            variants.append(Variant(spec, model, ref_optimizer(model, cfg), dtype, glasslm=False))
        else:
            c = model_cfg.replace(impl=kind) if kind in ("fast", "readable") else llama_variant(model_cfg)
            model = TransformerLM(c)
            variants.append(Variant(spec, model, make_optimizer(model, cfg), dtype, glasslm=True))
    return variants


def llama_variant(c):
    """The Llama family at the same size: RoPE, RMSNorm, SwiGLU (d_mlp keeps the parameter count), no bias."""
    return c.replace(positional="rope", norm="rmsnorm", activation="silu", mlp="swiglu", bias=False,
                     d_mlp=int(8 * c.d_model / 3) // 8 * 8)


def bench(preset: str, which: list[str], batch_size: int, steps: int, rounds: int, warmup: int, text: str) -> None:
    cfg = TrainConfig()
    vocab = sorted(set(text))
    tokens = torch.tensor([vocab.index(ch) for ch in text[:200_000]], dtype=torch.long)
    variants = build_variants(preset, which, cfg)
    context = get_preset(preset).context_length
    generator = torch.Generator().manual_seed(0)
    for v in variants:
        for _ in range(warmup):
            v.step(tokens, batch_size, context, generator, cfg.grad_clip)
    for _ in range(rounds):  # interleaved: each round times every variant once
        for v in variants:
            for _ in range(steps):
                start = time.perf_counter()
                v.step(tokens, batch_size, context, generator, cfg.grad_clip)
                v.times.append(time.perf_counter() - start)
    ref = next((v for v in variants if v.name == "ref-fp32"), variants[0])
    ref_time = statistics.median(ref.times)
    n_params = sum(p.numel() for p in variants[0].model.parameters())
    print(f"\n{preset}: batch {batch_size} x context {context}, {n_params/1e6:.2f}M params, "
          f"{rounds} rounds x {steps} steps, threads {torch.get_num_threads()}")
    print(f"{'variant':<16} {'ms/step':>9} {'tokens/s':>10} {'vs ' + ref.name:>14} {'GFLOP/s':>9}")
    for v in variants:
        t = statistics.median(v.times)
        flops = training_flops(v.model, batch_size, context)
        print(f"{v.name:<16} {t*1e3:9.1f} {batch_size*context/t:10,.0f} {ref_time/t:13.2f}x {flops/t/1e9:9.1f}")


def training_flops(model: nn.Module, batch_size: int, context: int) -> float:
    """6 N per token for the weights (forward 2N, backward 4N) + attention scores and mixing
    (PaLM appendix B: 6 * layers * context * d_model per token, halved for the causal mask not being skipped here)."""
    n = sum(p.numel() for name, p in model.named_parameters() if "pos" not in name and "wpe" not in name)
    cfg = model.config if hasattr(model, "config") else None
    layers = cfg.n_layers if cfg else len(model.blocks)
    d = cfg.d_model if cfg else model.wte.weight.shape[1]
    return batch_size * context * (6 * n + 12 * layers * context * d)


def matmul_throughput(n: int = 2048, repeats: int = 5) -> dict[str, float]:
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        out[str(dtype).split(".")[1]] = 2 * n**3 / statistics.median(times) / 1e9
    return out


def profile_step(preset: str, batch_size: int, impl: str, dtype: str) -> None:
    cfg = TrainConfig()
    variant = build_variants(preset, [f"{impl}-{dtype}"], cfg)[0]
    tokens = torch.randint(0, 65, (100_000,))
    generator = torch.Generator().manual_seed(0)
    context = get_preset(preset).context_length
    for _ in range(3):
        variant.step(tokens, batch_size, context, generator, cfg.grad_clip)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            variant.step(tokens, batch_size, context, generator, cfg.grad_clip)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def _shakespeare(data_dir: str | None) -> str:
    """tiny Shakespeare from the data directory, by glasslm's one rule (--data-dir, else
    $GLASSLM_DATA_DIR, else ~/.cache/glasslm); a one-line error, not a traceback, if it is not there."""
    from glasslm.data import resolve_text

    try:
        return resolve_text("tinyshakespeare", data_dir).read_text(encoding="utf-8")
    except (OSError, ValueError, RuntimeError) as err:
        sys.exit(f"bench_train.py: error: {err}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="shakespeare-char-cpu-nanogpt")
    parser.add_argument("--variants", default="ref-fp32,fast-fp32,readable-fp32,ref-bf16,fast-bf16,readable-bf16,llama-fp32,llama-bf16")
    parser.add_argument("--batch-size", type=int, default=12)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--matmul-only", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--impl", default="fast")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--data-dir", default=None, help="where datasets are kept (default $GLASSLM_DATA_DIR or ~/.cache/glasslm)")
    parser.add_argument("--smoke", action="store_true", help="one round of one step per variant, batch 2: checks it runs")
    args = parser.parse_args()
    if args.smoke:
        args.batch_size, args.steps, args.rounds, args.warmup = 2, 1, 1, 0
    text = None if args.matmul_only or args.profile else _shakespeare(args.data_dir)  # fail before timing anything
    if args.threads:
        torch.set_num_threads(args.threads)
    peak = matmul_throughput(256 if args.smoke else 2048)
    print(f"matmul {256 if args.smoke else 2048}^3 on this machine: fp32 {peak['float32']:.0f} GFLOP/s, bf16 {peak['bfloat16']:.0f} GFLOP/s "
          f"({peak['bfloat16']/peak['float32']:.2f}x)")
    if args.matmul_only:
        return
    if args.profile:
        profile_step(args.preset, args.batch_size, args.impl, args.dtype)
        return
    bench(args.preset, args.variants.split(","), args.batch_size, args.steps, args.rounds, args.warmup, text)


if __name__ == "__main__":
    main()
