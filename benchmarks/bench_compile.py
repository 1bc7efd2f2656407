"""When `--compile` pays off: compiled against eager decoding, and what compiling costs, per model size.

For each preset (random weights: speed does not depend on their values), a fresh process decodes
`--new-tokens` tokens greedily from a 6-token prompt, eager and compiled in turns (interleaved),
and reports medians over the repeats, per token, plus the seconds spent compiling
(`generation.compiled.compile_clock`: loading the compiler, then Dynamo and Inductor). Each preset
runs twice: first with an empty Inductor cache (a first `--compile` on a machine: cold), then
again in a new process with the cache the first filled (every later run: warm). The break-even
is the number of new tokens after which the compile has paid for itself:
compile seconds / (eager seconds per token - compiled seconds per token).

    python benchmarks/bench_compile.py                    # three presets, 512 tokens, 3 repeats
    python benchmarks/bench_compile.py --presets shakespeare-char-cpu --new-tokens 64 --repeats 1
    python benchmarks/bench_compile.py --smoke            # every step on a 1-layer model, 8 tokens (the suite runs it)
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

PRESETS = ("shakespeare-char-cpu", "shakespeare-char", "gpt2-small")


def measure(preset: str, new_tokens: int, repeats: int, threads: int, n_layers: int | None = None) -> dict:
    """One process's figures for one preset (with `n_layers`, that many of its layers): compile
    seconds, eager and compiled seconds per token."""
    import torch

    from glasslm.core.model import TransformerLM
    from glasslm.generation import GenerationConfig, generate_tokens, optimize_for_decoding
    from glasslm.generation.compiled import compile_clock
    from glasslm.presets import get_preset

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = TransformerLM(get_preset(preset, **({"n_layers": n_layers} if n_layers else {}))).eval()
    optimize_for_decoding(model)  # as `glasslm generate` prepares a model, compiled or not
    prompt = torch.randint(0, model.config.vocab_size, (6,), generator=torch.Generator().manual_seed(1)).tolist()

    def run(compile: bool) -> list[int]:
        config = GenerationConfig(max_new_tokens=new_tokens, temperature=0.0, compile=compile)
        return list(generate_tokens(model, prompt, config=config))

    with compile_clock() as clock:
        compiled_tokens = run(True)  # compiles (untimed as decoding)
    assert compiled_tokens == run(False), "compiled decoding changed the greedy tokens"
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats):  # interleaved: each repeat runs both once
        for compile in (False, True):
            started = time.perf_counter()
            run(compile)
            times[compile].append(time.perf_counter() - started)
    return {"preset": preset, "parameters": model.num_parameters(), "compile_s": clock.seconds,
            "eager_s_per_token": statistics.median(times[False]) / new_tokens,
            "compiled_s_per_token": statistics.median(times[True]) / new_tokens}


def in_fresh_process(args: argparse.Namespace, preset: str, cache: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    done = subprocess.run([sys.executable, __file__, "--one", preset, "--new-tokens", str(args.new_tokens),
                           "--repeats", str(args.repeats), "--threads", str(args.threads),
                           *(["--n-layers", str(args.n_layers)] if args.n_layers else [])],
                          env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def break_even(compile_s: float, eager: float, compiled: float) -> str:
    saved = eager - compiled
    return f"{compile_s / saved:,.0f}" if saved > 0 else "never"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--n-layers", type=int, help="keep this many of each preset's layers")
    parser.add_argument("--smoke", action="store_true", help="shakespeare-char-cpu with 1 layer, 8 tokens, 1 repeat: "
                        "checks it runs")
    parser.add_argument("--one", metavar="PRESET", help=argparse.SUPPRESS)  # the measuring process
    args = parser.parse_args()
    if args.smoke:
        args.presets, args.n_layers, args.new_tokens, args.repeats = PRESETS[0], 1, 8, 1
    if args.one:
        print(json.dumps(measure(args.one, args.new_tokens, args.repeats, args.threads, args.n_layers)))
        return
    print("command:", " ".join([sys.executable, *sys.argv]))
    print(f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}; {args.threads} thread(s), "
          f"{args.new_tokens} new tokens, median of {args.repeats} interleaved repeats\n")
    print("| preset | parameters | eager tokens/s | compiled tokens/s | compiled / eager | compile s, cold | "
          "compile s, warm | break-even tokens, cold | break-even tokens, warm |")
    print("|---|---|---|---|---|---|---|---|---|")
    for preset in args.presets.split(","):
        with tempfile.TemporaryDirectory() as cache:
            cold, warm = in_fresh_process(args, preset, cache), in_fresh_process(args, preset, cache)
        eager, compiled = warm["eager_s_per_token"], warm["compiled_s_per_token"]
        print(f"| {preset} | {warm['parameters'] / 1e6:.1f}M | {1 / eager:.0f} | {1 / compiled:.0f} | "
              f"{eager / compiled:.2f}x | {cold['compile_s']:.1f} | {warm['compile_s']:.1f} | "
              f"{break_even(cold['compile_s'], eager, compiled)} | {break_even(warm['compile_s'], eager, compiled)} |",
              flush=True)
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
