"""Decoding speed on a GPU: glasslm against Hugging Face transformers on the same GPT-2-small weights
(random, GPT-2's init: speed does not depend on their values), both in bf16 on one device, greedy,
batch 1, timed in turns; medians of the repeats and the glasslm / transformers ratio. Before timing,
the two must produce the same greedy tokens in float32.

    python benchmarks/bench_gpu_decode.py              # cuda, 256 new tokens, 5 repeats
    python benchmarks/bench_gpu_decode.py --smoke      # a 2-layer model on the CPU, 8 tokens (the test suite runs it)

scripts/gpu_check.sh runs the first line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import glasslm_from_hf, hf_gpt2  # noqa: E402  (this folder's CPU benchmark: the same weights' copy)
from glasslm.generation import GenerationConfig, generate_tokens


def decode_seconds(run, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    run()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.new_tokens, args.repeats = 8, 1
    elif not torch.cuda.is_available():
        raise SystemExit("bench_gpu_decode: no CUDA device (use --smoke to check it on the CPU)")
    hf = hf_gpt2(smoke=args.smoke).to(device)
    ours = glasslm_from_hf(hf).to(device)
    prompt = torch.tensor([[464, 2068, 7586, 21831]], device=device)
    greedy = GenerationConfig(max_new_tokens=args.new_tokens, temperature=0.0)

    def run_hf():
        with torch.inference_mode():
            return hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens,
                               min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)[0, prompt.shape[1]:].tolist()

    def run_ours():
        return list(generate_tokens(ours, prompt[0].tolist(), config=greedy))

    assert run_ours() == run_hf(), "greedy tokens differ from transformers' (float32)"
    hf.to(torch.bfloat16)
    ours.to(torch.bfloat16)
    run_hf(), run_ours()  # warm-up in bf16
    times: dict[str, list[float]] = {"transformers": [], "glasslm": []}
    for _ in range(args.repeats):
        times["transformers"].append(decode_seconds(run_hf, device))
        times["glasslm"].append(decode_seconds(run_ours, device))
    rate = {name: args.new_tokens / statistics.median(t) for name, t in times.items()}
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"gpt2-small bf16 greedy decoding, batch 1, {args.new_tokens} new tokens on {name}: "
          f"glasslm {rate['glasslm']:,.1f} tokens/s, transformers {rate['transformers']:,.1f} tokens/s, "
          f"ratio {rate['glasslm'] / rate['transformers']:.2f}")


if __name__ == "__main__":
    main()
