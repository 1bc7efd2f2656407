"""Generation speed: glasslm against Hugging Face transformers on identical GPT-2-small weights.

Both models run in this one process, timed in turns (interleaved), so machine noise hits both
alike; tables show medians over repeats and glasslm / HF ratios.

    python benchmarks/bench_generate.py            # full: 256 new tokens, 5 repeats
    python benchmarks/bench_generate.py --quick    # a short version (~1 minute)
    python benchmarks/bench_generate.py --smoke    # every step on a 2-layer model, seconds (the test suite runs it)

The weights are random (GPT-2's init, fixed seed): speed does not depend on their values, and
nothing has to be downloaded. Before timing, the script checks the two models agree: logits
within 1e-4 and identical greedy tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from glasslm.presets import get_preset
from glasslm.generation import GenerationConfig, generate, generate_tokens, onednn_disabled, optimize_for_decoding
from glasslm.core.model import TransformerLM
from glasslm.transforms import apply_transform
from glasslm.runtime import cpu_flags
from glasslm.generation.speculative import SpeculativeStats, speculative_tokens


def hf_gpt2(seed: int = 0, smoke: bool = False):
    """GPT-2 small with random weights (with `smoke`, 2 layers of width 64: the same code, in seconds)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**(dict(n_layer=2, n_embd=64, n_head=2) if smoke else {}))).eval()


def glasslm_from_hf(hf, n_layers: int = 12) -> TransformerLM:
    """Copy HF GPT-2 weights into glasslm's gpt2-small (private to this benchmark; interop lives elsewhere).

    GPT-2's Conv1D stores weights (d_in, d_out); glasslm's Linear stores (d_out, d_in) like torch.
    With `n_layers` below 12, only the first blocks are kept (an early-exit draft model).
    """
    shape = hf.config
    model = TransformerLM(get_preset("gpt2-small", n_layers=min(n_layers, shape.n_layer), d_model=shape.n_embd,
                                     n_heads=shape.n_head)).eval()
    theirs = hf.state_dict()
    pairs = {"embed.weight": "transformer.wte.weight", "pos_embed.weight": "transformer.wpe.weight",
             "ln_final.weight": "transformer.ln_f.weight", "ln_final.bias": "transformer.ln_f.bias"}
    for i in range(model.config.n_layers):
        ours, hf_name = f"blocks.{i}.", f"transformer.h.{i}."
        for a, b in (("ln1", "ln_1"), ("ln2", "ln_2"), ("attn.qkv", "attn.c_attn"), ("attn.out", "attn.c_proj"),
                     ("mlp.up", "mlp.c_fc"), ("mlp.down", "mlp.c_proj")):
            pairs[ours + a + ".weight"] = hf_name + b + ".weight"
            pairs[ours + a + ".bias"] = hf_name + b + ".bias"
    state = {}
    for ours, hf_name in pairs.items():
        tensor = theirs[hf_name]
        is_conv1d = hf_name.endswith("weight") and any(k in hf_name for k in ("c_attn", "c_proj", "c_fc"))
        state[ours] = tensor.T.contiguous() if is_conv1d else tensor
    missing = set(model.state_dict()) - set(state)
    assert not missing, missing
    model.load_state_dict(state)
    return model


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def memory_bandwidth_gb_s(megabytes: int = 512, repeats: int = 5) -> float:
    """A streaming read of a buffer much larger than the caches: the bound one-token decoding hits."""
    data = torch.ones(megabytes * 2**20 // 4)
    data.sum()  # touch every page once before timing
    seconds = statistics.median(timed(lambda: data.sum()) for _ in range(repeats))
    return data.numel() * 4 / seconds / 1e9


def weight_megabytes(model) -> float:
    """Weights streamed per decoded token: all of them, except a token table that is only looked up
    (the int8 model keeps the fp32 embedding for lookups and streams its int8 unembedding copy)."""
    # Tied tensors appear under two names (HF's wte and lm_head): count each storage once.
    unique = {t.data_ptr(): t for t in model.state_dict().values()}
    total = sum(t.numel() * t.element_size() for t in unique.values())
    if isinstance(model, TransformerLM) and model.config.tie_embeddings and model.unembed is not None:
        total -= model.embed.weight.numel() * model.embed.weight.element_size()
    return total / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats")
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--draft-layers", type=int, default=2, help="layers of the early-exit draft (default: 2)")
    parser.add_argument("--lookahead", type=int, default=4, help="tokens the draft proposes per pass (default: 4)")
    parser.add_argument("--smoke", action="store_true", help="a 2-layer model, 4 tokens, 1 repeat: checks it runs")
    args = parser.parse_args()
    n_new = args.new_tokens or (4 if args.smoke else 64 if args.quick else 256)
    repeats = args.repeats or (1 if args.smoke else 3 if args.quick else 5)
    draft_layers = 1 if args.smoke else args.draft_layers
    if args.threads:
        torch.set_num_threads(args.threads)
    print("command:", " ".join([sys.executable, *sys.argv]))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {n_new} new tokens, "
          f"median of {repeats} repeats")
    flags = cpu_flags()
    shown = sorted(f for f in flags if f.startswith(("avx512", "amx", "avx2", "avx_vnni", "fma")))
    print(f"CPU flags: {' '.join(shown) or 'unknown'}")
    bandwidth = memory_bandwidth_gb_s(16 if args.smoke else 512)
    print(f"memory bandwidth (streaming sum, {torch.get_num_threads()} threads): {bandwidth:.1f} GB/s\n")

    hf = hf_gpt2(smoke=args.smoke)
    ours = glasslm_from_hf(hf)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 50257, (1, 16), generator=generator)
    prompt8 = torch.randint(0, 50257, (8, 16), generator=generator)

    with torch.inference_mode():
        diff = (hf(prompt).logits - ours(prompt)).abs().max().item()
    assert diff < 1e-4, f"logits differ by {diff}"
    optimize_for_decoding(ours)  # a layout change only: checked again below through greedy tokens
    ours_bf16 = glasslm_from_hf(hf).to(torch.bfloat16)
    ours_int8 = glasslm_from_hf(hf)
    apply_transform(ours_int8, "int8")
    ours_int4 = glasslm_from_hf(hf)
    apply_transform(ours_int4, "int4")
    greedy = GenerationConfig(max_new_tokens=n_new, temperature=0.0)

    def run_hf(tokens):
        with torch.inference_mode():
            return hf.generate(tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=n_new,
                               min_new_tokens=n_new, do_sample=False, pad_token_id=0)[:, tokens.shape[1]:]

    def run_ours(model, tokens):
        if len(tokens) == 1:
            return [list(generate_tokens(model, tokens[0].tolist(), config=greedy))]
        return [g.tokens for g in generate(model, tokens.tolist(), greedy)]

    hf_tokens = run_hf(prompt)[0].tolist()
    assert run_ours(ours, prompt)[0] == hf_tokens, "greedy tokens differ from transformers'"
    bf16_tokens = run_ours(ours_bf16, prompt)[0]
    agree = next((i for i, (a, b) in enumerate(zip(bf16_tokens, hf_tokens)) if a != b), n_new)
    print(f"check: max |logit diff| {diff:.2e}; greedy tokens identical for {n_new} tokens (fp32); "
          f"bf16 agrees for the first {agree}")
    int8_tokens = run_ours(ours_int8, prompt)[0]
    agree8 = next((i for i, (a, b) in enumerate(zip(int8_tokens, hf_tokens)) if a != b), n_new)
    int4_tokens = run_ours(ours_int4, prompt)[0]
    agree4 = next((i for i, (a, b) in enumerate(zip(int4_tokens, hf_tokens)) if a != b), n_new)
    print(f"int8 agrees for the first {agree8}, int4 for the first {agree4} (random weights make near-ties "
          "common; quality is tested on a trained model in tests/transforms/test_quantize.py)")
    # Speculative decoding needs a draft that often agrees with the target. With random weights no
    # separately built model does, so the draft is the target cut after its first blocks (same
    # embeddings, final norm and unembedding: an early exit), quantized to int8 to make it cheap.
    draft = glasslm_from_hf(hf, n_layers=draft_layers)
    apply_transform(draft, "int8")
    stats = SpeculativeStats()

    def run_speculative():
        return [list(speculative_tokens(ours, draft, prompt[0].tolist(), n_new, lookahead=args.lookahead,
                                        stats=stats))]

    assert run_speculative()[0] == hf_tokens, "speculative decoding changed the greedy tokens"
    print(f"speculative: draft = first {draft_layers} of {hf.config.n_layer} layers in int8, lookahead {args.lookahead}: "
          f"same greedy tokens; {stats.acceptance_rate:.0%} of proposals accepted, "
          f"{stats.tokens_per_target_pass:.2f} tokens per target pass\n")

    cases = {
        ("transformers fp32", 1): lambda: run_hf(prompt),
        ("glasslm fp32", 1): lambda: run_ours(ours, prompt),
        ("glasslm bf16", 1): lambda: run_ours(ours_bf16, prompt),
        ("glasslm int8", 1): lambda: run_ours(ours_int8, prompt),
        ("glasslm int4", 1): lambda: run_ours(ours_int4, prompt),
        ("glasslm fp32 + int8 draft", 1): run_speculative,
        ("transformers fp32", 8): lambda: run_hf(prompt8),
        ("glasslm fp32", 8): lambda: run_ours(ours, prompt8),
        ("glasslm bf16", 8): lambda: run_ours(ours_bf16, prompt8),
        ("glasslm int8", 8): lambda: run_ours(ours_int8, prompt8),
        ("glasslm int4", 8): lambda: run_ours(ours_int4, prompt8),
    }
    megabytes = {"transformers fp32": weight_megabytes(hf), "glasslm fp32": weight_megabytes(ours),
                 "glasslm bf16": weight_megabytes(ours_bf16), "glasslm int8": weight_megabytes(ours_int8),
                 "glasslm int4": weight_megabytes(ours_int4)}
    # Per token, speculation reads the target once per pass and the draft once per proposal.
    passes_per_token = 1 / stats.tokens_per_target_pass
    megabytes["glasslm fp32 + int8 draft"] = passes_per_token * (
        megabytes["glasslm fp32"] + args.lookahead * weight_megabytes(draft))
    times: dict = {case: [] for case in cases}
    for _ in range(repeats):  # interleaved: each repeat runs every case once
        for case, fn in cases.items():
            times[case].append(timed(fn))
    # "GB/s read": weights streamed per second at batch 1 (each token reads every weight once), to
    # hold against the measured bandwidth above.
    print(f"| {'generation (16-token prompt, greedy)':<38} | batch | tokens/s | vs transformers | MB read/token | GB/s read |")
    print(f"|{'-' * 40}|-------|----------|-----------------|---------------|-----------|")
    for (name, batch), ts in times.items():
        rate = batch * n_new / statistics.median(ts)
        base = batch * n_new / statistics.median(times[("transformers fp32", batch)])
        read = megabytes[name] * rate / batch / 1e3
        print(f"| {name:<38} | {batch:>5} | {rate:>8.1f} | {rate / base:>14.2f}x | {megabytes[name]:>13.0f} | "
              f"{read:>9.1f} |")

    # Prefill of a long prompt and per-token decode time at several positions, with and without cache.
    long_prompt = torch.randint(0, 50257, (1, 1024), generator=generator)
    prefill = {"transformers fp32": [], "glasslm fp32": [], "glasslm bf16": []}
    with torch.inference_mode():
        for _ in range(max(1, repeats - 1)):
            prefill["transformers fp32"].append(timed(lambda: hf(long_prompt, use_cache=True)))
            for name, model in (("glasslm fp32", ours), ("glasslm bf16", ours_bf16)):
                cache = model.new_kv_cache(1)
                prefill[name].append(timed(lambda: model(long_prompt, kv_cache=cache, last_logits_only=True)))
    print(f"\n| prefill, 1,024-token prompt | seconds | tokens/s |\n|---|---|---|")
    for name, ts in prefill.items():
        print(f"| {name} | {statistics.median(ts):.3f} | {1024 / statistics.median(ts):.0f} |")

    positions = (16, 256, 512, 1000) if not args.quick else (16, 512, 1000)
    print("\n| position | fp32 cached ms/token | bf16 cached ms/token | fp32 no cache ms/token | transformers cached |")
    print("|---|---|---|---|---|")
    steps = 5
    with torch.inference_mode():
        for position in positions:
            row = []
            for model, native_gemv in ((ours, False), (ours_bf16, True)):
                # As generation does it: a float32 cache, and ATen's gemv for one-row bf16 steps.
                cache = model.new_kv_cache(1, dtype=torch.float32)
                model(long_prompt[:, :position], kv_cache=cache, last_logits_only=True)
                step_times = []
                for i in range(steps):
                    token = long_prompt[:, position + i:position + i + 1]
                    with onednn_disabled(native_gemv):
                        step_times.append(timed(lambda: model(token, kv_cache=cache)))
                row.append(statistics.median(step_times) * 1e3)
            # No cache: every step recomputes the whole prefix (what decoding without a KV cache costs).
            no_cache = [timed(lambda: ours(long_prompt[:, :position + 1], last_logits_only=True))
                        for _ in range(1 if args.quick else 2)]
            row.append(min(no_cache) * 1e3)
            out = hf(long_prompt[:, :position], use_cache=True)
            hf_steps = []
            for i in range(steps):
                token = long_prompt[:, position + i:position + i + 1]
                hf_steps.append(timed(lambda: hf(token, past_key_values=out.past_key_values, use_cache=True)))
            row.append(statistics.median(hf_steps) * 1e3)
            print(f"| {position} | " + " | ".join(f"{x:.1f}" for x in row) + " |")


if __name__ == "__main__":
    main()
