"""CPU decoding: glasslm against llama.cpp on the same weights, side by side in one process.

A random GPT-2 small (and a SmolLM-135M-shaped Llama with --models gpt2,llama) is saved as a Hugging
Face directory, which glasslm loads with `glasslm.hf.load_model`, and written as GGUF f32 with the
`gguf` package under llama.cpp's own tensor names (those of its convert_hf_to_gguf.py); llama.cpp's
quantizer (`llama_model_quantize`) makes the f16, q8_0 and q4_0 files from it. Pairs timed in
turns (interleaved repeats, medians): glasslm fp32 / bf16 / int8 / int4 against llama.cpp
f32 / f16 / q8_0 / q4_0.

    pip install -e '.[bench]'      # llama-cpp-python (builds llama.cpp, ~10 min on 2 cores) and gguf
    python benchmarks/bench_llamacpp.py                       # GPT-2 small, batch 1, threads 1 and 2
    python benchmarks/bench_llamacpp.py --models gpt2,llama --batches 1,8 --prefill
    python benchmarks/bench_llamacpp.py --full        # batch 1 and 8, threads 1 and 2, prefill, profile
    python benchmarks/bench_llamacpp.py --compile     # also each glasslm model through a compiled step
    python benchmarks/bench_llamacpp.py --smoke       # 2-layer models, 4 tokens, 1 repeat: seconds (the test suite runs it)
    python benchmarks/bench_llamacpp.py --gguf model.gguf   # one real file: llama.cpp on it, glasslm as
                                                             # `glasslm generate --checkpoint model.gguf` loads it

With --gguf, glasslm's rows are the file as `load_model` reads it (4-bit blocks kept, the rest in
float32: `gguf`) and with every tensor dequantized (`gguf fp32`), both against llama.cpp on the file.

Each row prints tokens/s, the glasslm / llama.cpp ratio, bytes read per token and the share of the
memory-bandwidth bound (measured bandwidth / bytes per token) each side reaches. Before timing, the
f32 pair must pick the same greedy tokens for the first steps (a check that the weights match).
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
from pathlib import Path

import numpy as np
import torch

from glasslm.core.layers import Linear
from glasslm.generation import DecodeWindow, generate, onednn_disabled
from glasslm.hf import load_model
from glasslm.runtime import cpu_flags
from glasslm.transforms import apply_transform
from glasslm.transforms.ggml import BlockLinear
from glasslm.transforms.quantize import Int4Linear, Int8Linear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp_reference import LlamaCpp, configuration, quantize  # noqa: E402  (llama.cpp set up for this CPU)

PAIRS = [("fp32", "f32"), ("bf16", "f16"), ("int8", "q8_0"), ("int4", "q4_0")]
COMPILED = " compiled"  # a glasslm row whose name ends so decodes with `compile=True` (--compile)


GGUF_PAIRS = [("gguf", "file"), ("gguf fp32", "file")]  # --gguf: the file as load_model keeps it, and dequantized


def pairs(args) -> list[tuple[str, str]]:
    """The (glasslm, llama.cpp) rows to time: PAIRS (GGUF_PAIRS with --gguf), and with --compile each
    glasslm model compiled too (with --smoke, only the first: compiling takes most of a smoke run)."""
    base = (GGUF_PAIRS if getattr(args, "dequantized_row", True) else GGUF_PAIRS[:1]) if args.gguf else PAIRS
    compiled = [(ours + COMPILED, theirs) for ours, theirs in base][:1 if args.smoke else None]
    return base + compiled if args.compile else base


# --- the weights, written for both ----------------------------------------------------------------

def random_hf_model(kind: str, directory: Path, smoke: bool = False) -> dict:
    """Save a randomly initialised HF model (fixed seed) to `directory`; return its config. With
    `smoke`, 2 layers of width 128 initialised wide (logits far apart: the greedy check stays sharp)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if smoke:
        shape = dict(num_hidden_layers=2, num_attention_heads=4, initializer_range=0.5)
        model = GPT2LMHeadModel(GPT2Config(n_embd=128, **shape)) if kind == "gpt2" else LlamaForCausalLM(
            LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_key_value_heads=2,
                        tie_word_embeddings=True, **shape))
    elif kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config())
    else:  # SmolLM-135M's shape
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True))
    model.save_pretrained(directory)
    return json.loads((directory / "config.json").read_text())


def gpt2_vocab(n_tokens: int) -> tuple[list[str], list[str]]:
    """GPT-2's own byte-level tokens and merges, from the data directory's gpt2/ folder (llama.cpp's
    loader wants a real BPE vocabulary), cut to `n_tokens` for a smaller model; merges whose result
    is cut go too."""
    from glasslm.locations import data_dir

    folder = data_dir() / "gpt2"
    vocab = json.loads((folder / "gpt2_vocab.json").read_text())
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])][:n_tokens]
    kept = set(tokens)
    merges = [m for m in (folder / "gpt2_merges.txt").read_text().splitlines()[1:]
              if m and "".join(m.split(" ")) in kept]
    return tokens, merges


def gguf_tensors(kind: str, hf: dict, state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """HF tensor names -> llama.cpp's (convert_hf_to_gguf.py): GPT-2's Conv1D weights transposed to
    (out, in); Llama's q and k rows permuted from HF's rotate-half order to interleaved pairs."""
    out: dict[str, np.ndarray] = {}
    if kind == "gpt2":
        names = {"wte": "token_embd", "wpe": "position_embd", "ln_f": "output_norm"}
        parts = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output",
                 "ln_2": "ffn_norm", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
        for name, tensor in state.items():
            if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
                continue  # the causal mask buffer; the tied head is token_embd itself
            short = name.removeprefix("transformer.")
            if short.startswith("h."):
                _, layer, rest = short.split(".", 2)
                part, suffix = rest.rsplit(".", 1)
                target = f"blk.{layer}.{parts[part]}.{suffix}"
                tensor = tensor.T if suffix == "weight" and part not in ("ln_1", "ln_2") else tensor
            else:
                stem, suffix = short.rsplit(".", 1)
                target = f"{names[stem]}.{suffix}"
            out[target] = tensor.float().contiguous().numpy()
        return out
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    parts = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, tensor in state.items():
        if name == "lm_head.weight":
            continue
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            part = rest.rsplit(".", 1)[0]
            if part in ("self_attn.q_proj", "self_attn.k_proj"):
                n = heads if part.endswith("q_proj") else kv_heads
                tensor = tensor.reshape(n, 2, tensor.shape[0] // n // 2, -1).swapaxes(1, 2).reshape(tensor.shape)
            target = f"blk.{layer}.{parts[part]}.weight"
        else:
            target = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[name]
        out[target] = tensor.float().contiguous().numpy()
    return out


def write_gguf(kind: str, hf: dict, state: dict[str, torch.Tensor], path: Path) -> None:
    """An f32 GGUF file with the metadata llama.cpp's loader reads for this architecture."""
    import gguf

    writer = gguf.GGUFWriter(str(path), kind)
    if kind == "gpt2":
        writer.add_context_length(hf.get("n_ctx", hf["n_positions"]))
        writer.add_embedding_length(hf["n_embd"])
        writer.add_feed_forward_length(4 * hf["n_embd"])
        writer.add_block_count(hf["n_layer"])
        writer.add_head_count(hf["n_head"])
        writer.add_layer_norm_eps(hf["layer_norm_epsilon"])
        vocab_size = hf["vocab_size"]
    else:
        writer.add_context_length(hf["max_position_embeddings"])
        writer.add_embedding_length(hf["hidden_size"])
        writer.add_feed_forward_length(hf["intermediate_size"])
        writer.add_block_count(hf["num_hidden_layers"])
        writer.add_head_count(hf["num_attention_heads"])
        writer.add_head_count_kv(hf["num_key_value_heads"])
        writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
        writer.add_rope_freq_base(hf.get("rope_theta") or hf["rope_parameters"]["rope_theta"])
        writer.add_rope_dimension_count(hf["hidden_size"] // hf["num_attention_heads"])
        writer.add_vocab_size(hf["vocab_size"])
        vocab_size = hf["vocab_size"]
    writer.add_file_type(0)  # all f32
    tokens, merges = gpt2_vocab(vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(len(tokens) - 1 if kind == "gpt2" else 0)
    writer.add_eos_token_id(len(tokens) - 1 if kind == "gpt2" else 0)
    for name, array in gguf_tensors(kind, hf, state).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_bytes_per_token(path: Path) -> tuple[float, str]:
    """Bytes of weights one decoding step reads, and the tensor types in the file. Token and position
    tables are only looked up, unless the token table is also the output (no output.weight)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    names = {t.name for t in reader.tensors}
    total, types = 0, {}
    for tensor in reader.tensors:
        looked_up = tensor.name == "position_embd.weight" or (
            tensor.name == "token_embd.weight" and "output.weight" in names)
        if not looked_up:
            total += int(tensor.n_bytes)
        if tensor.n_elements > 100_000:
            types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
    return total, ",".join(f"{k}x{v}" for k, v in sorted(types.items()))


def glasslm_bytes_per_token(model) -> float:
    """Bytes of weights and buffers one decoding step reads (the embedding lookup excluded where an
    unembedding matrix of its own is streamed instead)."""
    unique = {t.data_ptr(): t for t in model.state_dict().values()}
    total = sum(t.numel() * t.element_size() for t in unique.values())
    lookups = [model.pos_embed] + ([model.embed] if model.unembed is not None else [])
    for table in lookups:
        for tensor in ([] if table is None else table.state_dict().values()):
            total -= tensor.numel() * tensor.element_size()
    return total


# --- running each side --------------------------------------------------------------------------

def glasslm_models(directory: Path) -> dict:
    """glasslm fp32 / bf16 / int8 / int4 from the HF directory, prepared as `glasslm generate` does."""
    from glasslm.generation import optimize_for_decoding

    models = {}
    for name in ("fp32", "bf16", "int8", "int4"):
        model, _ = load_model(directory, dtype=torch.bfloat16 if name == "bf16" else None)
        model.eval()
        if name in ("int8", "int4"):
            apply_transform(model, name)
        else:
            optimize_for_decoding(model)
        models[name] = model
    return models


def glasslm_greedy(model, prompts: list[list[int]], n_new: int, compile: bool = False) -> list[list[int]]:
    """n_new tokens for every row: an eos does not end a row early, as llama.cpp's loop here never stops
    (a random prompt that drew an eos once made a repeat look six times faster)."""
    out = [g.tokens for g in generate(model, prompts, max_new_tokens=n_new, temperature=0.0, compile=compile,
                                      ignore_eos=True)]
    assert all(len(tokens) == n_new for tokens in out), [len(tokens) for tokens in out]
    return out


def glasslm_prefill(model, prompt: list[int], compile: bool = False) -> None:
    generate(model, [prompt], max_new_tokens=1, temperature=0.0, compile=compile)


def glasslm_prefill_int8(model, prompt: list[int]) -> None:
    """The prefill with `--prefill-activations int8` (one int8 pass, llama.cpp's rounding)."""
    from glasslm.kernels.qmatmul import prefill_activations

    with prefill_activations("int8"):
        generate(model, [prompt], max_new_tokens=1, temperature=0.0)


# --- measuring ----------------------------------------------------------------------------------

def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def memory_bandwidth(threads: int, megabytes: int = 512, repeats: int = 7) -> float:
    """Bytes per second of a streaming read (torch sum) of a buffer far larger than the caches."""
    torch.set_num_threads(threads)
    data = torch.ones(megabytes * 2**20 // 4)
    data.sum()  # touch every page before timing
    return data.numel() * 4 / statistics.median(seconds(lambda: data.sum()) for _ in range(repeats))


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


def check_same_weights(ours, theirs: LlamaCpp, vocab: int, steps: int = 8) -> None:
    """f32 against f32: the same greedy tokens for the first steps, or the weights differ."""
    prompt = [[int(t) for t in torch.randint(0, vocab, (2,), generator=torch.Generator().manual_seed(5))]]
    a, b = glasslm_greedy(ours, prompt, steps)[0], theirs.greedy(prompt, steps)[0]
    same = sum(x == y for x, y in zip(a, b))
    with torch.inference_mode():
        logits = ours(torch.tensor(prompt))[0, -1].numpy()
    gap = float(np.abs(logits - theirs.last_logits(prompt[0])).max())
    print(f"same weights? f32 vs fp32: logits after the prompt differ by at most {gap:.2e} "
          f"(largest |logit| {np.abs(logits).max():.2f}); greedy tokens {same}/{steps} same:\n"
          f"  glasslm {a}\n  llama.cpp {b}")
    if a[:2] != b[:2]:
        raise SystemExit("glasslm and llama.cpp disagree from the first tokens: the GGUF weights are not the same")


def new_tokens(args, batch: int) -> int:
    """New tokens per row: --new-tokens at batch 1, --batch-new-tokens (if given) at larger batches."""
    return args.new_tokens if batch == 1 or not args.batch_new_tokens else args.batch_new_tokens


def paired_ratio(times: dict, key: tuple, ours: str = "glasslm", theirs: str = "llama.cpp") -> tuple[float, float, float]:
    """Median, min and max over repeats of glasslm / llama.cpp, each repeat's two runs taken back to
    back: on a loaded machine the load drifts between repeats, and a ratio of neighbours follows it
    better than a ratio of the two sides' separate medians."""
    ratios = [a / b for a, b in zip(times[(*key, ours)], times[(*key, theirs)])]
    return statistics.median(ratios), min(ratios), max(ratios)


def time_rows(kind: str, ours: dict, theirs: dict, args, vocab: int, report) -> dict:
    """{(batch, threads, pair, side): [tokens/s per repeat]}, every pair timed in turns."""
    generator = torch.Generator().manual_seed(1)
    times: dict = {}
    warm_up = [[1, 2]] * max(args.batches)
    for ours_name, theirs_name in pairs(args):  # first calls pack kernels' weights (and compile): not timed
        compiled = ours_name.endswith(COMPILED)
        for batch in args.batches:
            for threads in args.threads if compiled else args.threads[:1]:
                torch.set_num_threads(threads)  # the timed lengths, so the timed runs reuse the compiled step
                glasslm_greedy(ours[ours_name], warm_up[:batch], new_tokens(args, batch) if compiled else 4, compiled)
            theirs[theirs_name, batch].greedy(warm_up[:batch], 4)
    for repeat in range(args.repeats):
        for batch in args.batches:
            prompts = [torch.randint(0, vocab, (2,), generator=generator).tolist() for _ in range(batch)]
            for threads in args.threads:
                torch.set_num_threads(threads)
                for ours_name, theirs_name in pairs(args):
                    llama = theirs[theirs_name, batch]
                    llama.set_threads(threads)
                    n_new, compiled = new_tokens(args, batch), ours_name.endswith(COMPILED)
                    runs = [("glasslm", lambda: glasslm_greedy(ours[ours_name], prompts, n_new, compiled)),
                            ("llama.cpp", lambda: llama.greedy(prompts, n_new))]
                    for side, run in runs[::1 if repeat % 2 == 0 else -1]:  # alternate who goes first
                        rate = batch * n_new / seconds(run)
                        times.setdefault((batch, threads, ours_name, side), []).append(rate)
                    if args.prefill and batch == 1:
                        prompt = torch.randint(0, vocab, (512,), generator=generator).tolist()
                        sides = [("glasslm prefill", lambda: glasslm_prefill(ours[ours_name], prompt, compiled)),
                                 ("llama.cpp prefill", lambda: llama.prefill(prompt))]
                        if getattr(args, "prefill_int8", False):
                            sides.append(("glasslm prefill int8", lambda: glasslm_prefill_int8(ours[ours_name], prompt)))
                        for side, run in sides:
                            times.setdefault((batch, threads, ours_name, side), []).append(512 / seconds(run))
        print(f"  {kind}: repeat {repeat + 1}/{args.repeats} done", flush=True)
        if repeat + 1 < args.repeats:
            report(times, repeat + 1)  # the medians so far, in case a slow machine's run is cut short
    return times


MATMULS = {"aten::addmm", "aten::mm", "aten::bmm", "quantized::linear_dynamic", "aten::_weight_int8pack_mm",
           "aten::_weight_int4pack_mm_for_cpu", "glasslm_kernels::qlinear", "glasslm_kernels::qmatmul"}
ATTENTION = ("scaled_dot_product", "glasslm_kernels::decode_attention")


def op_times(run, steps: int) -> dict[str, float]:
    """Seconds per call of `run` by kind of operator (torch.profiler self times), plus wall time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            run()
    kinds = {"matmul": 0.0, "attention": 0.0, "other ops": 0.0}
    for event in prof.key_averages():
        kind = ("matmul" if event.key in MATMULS else
                "attention" if any(name in event.key for name in ATTENTION) else "other ops")
        kinds[kind] += event.self_cpu_time_total / 1e6 / steps
    return kinds


def profile_step(name: str, model, steps: int = 32, readable: bool = False) -> None:
    """Where one batch-1 decoding step's time goes: the unembedding matmul, the blocks' matmuls,
    attention, other operators (norms, GELU, adds, copies) and the host (Python, module calls, the
    dispatcher), the host being the step's wall time that no operator's self time accounts for.
    The step is the one `generate` takes (the fast step where it runs), or with `readable` the
    model's readable forward."""
    window = DecodeWindow(model, 1, 4 + 3 * steps)
    if readable:
        window.fast = None
    token = torch.tensor([5])
    with torch.inference_mode():
        window.prefill([[1, 2]])
        for _ in range(steps):  # first calls pack kernels' weights
            window.decode(token)
        wall = statistics.median(seconds(lambda: window.decode(token)) for _ in range(steps))
        ops = op_times(lambda: window.decode(token), steps)
        resid = torch.randn(1, 1, model.config.d_model, dtype=model.embed.weight.dtype)
        with onednn_disabled(window.use_native_gemv):
            head = op_times(lambda: model.logits(resid), steps)["matmul"]
    host = max(wall - sum(ops.values()), 0.0)
    parts = {"unembedding matmul": head, "block matmuls": ops["matmul"] - head, "attention": ops["attention"],
             "other ops": ops["other ops"], "host (Python)": host}
    alone = matmuls_alone(model, steps)
    print(f"| {name}{' (readable step)' if readable else ''} | {wall * 1e3:.2f} | " + " | ".join(f"{t * 1e3:.2f} ({t / wall:.0%})" for t in parts.values())
          + f" | {alone * 1e3:.2f} |")


def matmuls_alone(model, steps: int) -> float:
    """Seconds for one step's matrix products and nothing else: every projection layer of the model,
    then the unembedding, called back to back on one-row inputs (the wall time of the kernels as a
    step calls them, the profiler's cost and the child operators its self times leave out included)."""
    layers = [m for m in model.blocks.modules() if isinstance(m, (Linear, Int8Linear, Int4Linear, BlockLinear))]
    dtype = model.embed.weight.dtype
    rows = [torch.randn(1, 1, layer.d_in if hasattr(layer, "d_in") else layer.weight.shape[1], dtype=dtype)
            for layer in layers]
    resid = torch.randn(1, 1, model.config.d_model, dtype=dtype)

    def step() -> None:
        for layer, row in zip(layers, rows):
            layer(row)
        model.logits(resid)

    with torch.inference_mode(), onednn_disabled(dtype != torch.float32):
        for _ in range(3):
            step()
        return statistics.median(seconds(step) for _ in range(steps))


def print_profiles(kind: str, models: dict, args) -> None:
    """--profile: one batch-1 step of each model broken down, the step `generate` takes and the
    readable forward's, on each thread count."""
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"\n{kind}: one batch-1 decoding step, ms (share), {threads} thread(s), torch.profiler self "
              "times; operators' times include the profiler's own cost, so host time is an underestimate; "
              f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        print("| glasslm | step | unembedding matmul | block matmuls | attention | other ops | host (Python) "
              "| matmuls alone |")
        print("|---|---|---|---|---|---|---|---|")
        for name, model in models.items():
            profile_step(name, model)
            profile_step(name, model, readable=True)


def print_table(kind: str, times: dict, bytes_ours: dict, bytes_theirs: dict, bandwidth: dict, args,
                repeats: int) -> None:
    tokens = ", ".join(f"batch {b}: {b} x {new_tokens(args, b)}" for b in args.batches)
    print(f"\n{kind}: decode tokens/s ({tokens} new tokens after a 2-token prompt), median of {repeats}; "
          "ratio = median of each repeat's back-to-back ratio (range); bound = bandwidth / bytes per step")
    print("| batch | threads | glasslm | llama.cpp | llama.cpp tok/s | glasslm tok/s | glasslm / llama.cpp "
          "| MB/token (llama.cpp, glasslm) | share of bound (llama.cpp, glasslm) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for batch in args.batches:
        for threads in args.threads:
            for ours_name, theirs_name in pairs(args):
                ours = statistics.median(times[batch, threads, ours_name, "glasslm"])
                theirs = statistics.median(times[batch, threads, ours_name, "llama.cpp"])
                ratio, low, high = paired_ratio(times, (batch, threads, ours_name))
                b_theirs, b_ours = bytes_theirs[theirs_name][0], bytes_ours[ours_name]
                bound = bandwidth[threads]  # a step of the whole batch reads the weights once
                share = f"{theirs / batch * b_theirs / bound:.0%}, {ours / batch * b_ours / bound:.0%}"
                print(f"| {batch} | {threads} | {ours_name} | {theirs_name} | {theirs:.1f} | {ours:.1f} | "
                      f"**{ratio:.2f}x** ({low:.2f}-{high:.2f}) | {b_theirs / 1e6:.0f}, {b_ours / 1e6:.0f} | {share} |")
    if args.prefill:
        print(f"\n{kind}: prefill of 512 tokens, tokens/s, batch 1")
        int8 = getattr(args, "prefill_int8", False)
        extra = " glasslm int8 tok/s | int8 / llama.cpp |" if int8 else ""
        print("| threads | glasslm | llama.cpp | llama.cpp tok/s | glasslm tok/s | glasslm / llama.cpp |" + extra)
        print("|---|---|---|---|---|---|" + "---|---|" * int8)
        for threads in args.threads:
            for ours_name, theirs_name in pairs(args):
                key = (1, threads, ours_name)
                ours = statistics.median(times[(*key, "glasslm prefill")])
                theirs = statistics.median(times[(*key, "llama.cpp prefill")])
                ratio, low, high = paired_ratio(times, key, "glasslm prefill", "llama.cpp prefill")
                row = f"| {threads} | {ours_name} | {theirs_name} | {theirs:.1f} | {ours:.1f} | {ratio:.2f}x ({low:.2f}-{high:.2f}) |"
                if int8:
                    one, low, high = paired_ratio(times, key, "glasslm prefill int8", "llama.cpp prefill")
                    row += f" {statistics.median(times[(*key, 'glasslm prefill int8')]):.1f} | {one:.2f}x ({low:.2f}-{high:.2f}) |"
                print(row)


def run_model(kind: str, folder: Path, args, bandwidth: dict) -> None:
    hf_dir = folder / kind
    hf = random_hf_model(kind, hf_dir, args.smoke)
    from safetensors.torch import load_file

    state = load_file(hf_dir / "model.safetensors")
    files = {"f32": folder / f"{kind}-f32.gguf"}
    write_gguf(kind, hf, state, files["f32"])
    for ftype in ("f16", "q8_0", "q4_0"):
        files[ftype] = folder / f"{kind}-{ftype}.gguf"
        quantize(files["f32"], files[ftype], ftype)
    bytes_theirs = {name: gguf_bytes_per_token(path) for name, path in files.items()}
    for name, (size, types) in bytes_theirs.items():
        print(f"{kind} {name}.gguf: {size / 1e6:.0f} MB read per token; tensor types {types}")
    ours = glasslm_models(hf_dir)
    bytes_ours = {name: glasslm_bytes_per_token(model) for name, model in ours.items()}
    eager = dict(ours)
    if args.compile:  # the same models, decoded through a compiled step
        ours.update({name + COMPILED: model for name, model in eager.items()})
        bytes_ours.update({name + COMPILED: size for name, size in list(bytes_ours.items())})
    n_ctx = 1024 if args.prefill else 256 * (1 + (args.new_tokens + 8) // 256)
    theirs = {(name, batch): LlamaCpp(path, batch, n_ctx) for name, path in files.items() for batch in args.batches}
    vocab = ours["fp32"].config.vocab_size
    torch.set_num_threads(args.threads[0])
    theirs["f32", args.batches[0]].set_threads(args.threads[0])
    check_same_weights(ours["fp32"], theirs["f32", args.batches[0]], vocab)
    if args.profile:
        print_profiles(kind, eager, args)
    def report(times: dict, repeats: int) -> None:
        print_table(kind, times, bytes_ours, bytes_theirs, bandwidth, args, repeats)
        print(f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)

    report(time_rows(kind, ours, theirs, args, vocab, report), args.repeats)


def run_file(path: Path, args, bandwidth: dict) -> None:
    """--gguf: llama.cpp on the file against glasslm on the same file, loaded as the CLI loads it."""
    from glasslm.generation import optimize_for_decoding
    from glasslm.hf.gguf.importer import import_gguf

    start = time.perf_counter()
    kept, _ = load_model(path)
    print(f"glasslm load_model({path.name}): {time.perf_counter() - start:.1f} s; {kept.gguf_summary}")
    ours = {"gguf": kept}
    if any(name == "gguf fp32" for name, _ in pairs(args)):
        ours["gguf fp32"] = import_gguf(path, keep_blocks=False).model
    for model in ours.values():
        optimize_for_decoding(model)  # what `glasslm generate` does before decoding
    bytes_ours = {name: glasslm_bytes_per_token(model) for name, model in ours.items()}
    if args.compile:
        ours.update({name + COMPILED: model for name, model in list(ours.items())})
        bytes_ours.update({name + COMPILED: size for name, size in list(bytes_ours.items())})
    bytes_theirs = {"file": gguf_bytes_per_token(path)}
    print(f"{path.name}: {bytes_theirs['file'][0] / 1e6:.0f} MB read per token; tensor types {bytes_theirs['file'][1]}")
    n_ctx = 1024 if args.prefill else 256 * (1 + (args.new_tokens + 8) // 256)
    theirs = {("file", batch): LlamaCpp(path, batch, n_ctx) for batch in args.batches}
    vocab = kept.config.vocab_size
    if args.profile:
        print_profiles(path.name, {name: model for name, model in ours.items() if not name.endswith(COMPILED)}, args)

    def report(times: dict, repeats: int) -> None:
        print_table(path.name, times, bytes_ours, bytes_theirs, bandwidth, args, repeats)
        print(f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)

    report(time_rows(path.name, ours, theirs, args, vocab, report), args.repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt2", help="comma-separated: gpt2, llama (SmolLM-135M's shape)")
    parser.add_argument("--batches", default="1", help="comma-separated batch sizes (default 1; e.g. 1,8)")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill", action="store_true", help="also time a 512-token prefill")
    parser.add_argument("--prefill-int8", action="store_true",
                        help="with --prefill: also time glasslm's prefill with --prefill-activations int8")
    parser.add_argument("--batch-new-tokens", type=int, default=0, metavar="N",
                        help="new tokens per row at batch sizes above 1 (default: --new-tokens)")
    parser.add_argument("--busy", type=int, default=0, metavar="N",
                        help="run N busy-loop processes beside the benchmark (a loaded machine)")
    parser.add_argument("--profile", action="store_true",
                        help="also break one batch-1 decoding step of each glasslm model down (torch.profiler)")
    parser.add_argument("--compile", action="store_true",
                        help="also time each glasslm model decoding through a compiled step (compile=True; "
                             "compiling happens in the untimed warm-up)")
    parser.add_argument("--gguf", type=Path, metavar="FILE",
                        help="time one real GGUF file (llama.cpp on it, glasslm loading it) instead of --models")
    parser.add_argument("--full", action="store_true",
                        help="the whole table in about 10 minutes on 2 cores: batches 1,8, threads 1,2, a 512-token "
                             "prefill, 128 new tokens at batch 1 and 32 per row at batch 8, 3 repeats, --profile")
    parser.add_argument("--smoke", action="store_true",
                        help="with any other options: 2-layer models, 4 new tokens, 1 repeat, and with --compile "
                             "one compiled model on one thread count (checks that it runs)")
    args = parser.parse_args()
    if args.full:
        args.batches, args.threads, args.prefill, args.profile = "1,8", "1,2", True, True
        args.new_tokens, args.batch_new_tokens, args.repeats = 128, 32, 3
    if args.smoke:
        args.new_tokens, args.batch_new_tokens, args.repeats = 4, min(args.batch_new_tokens, 4), 1
        args.threads = args.threads[:1] if args.compile else args.threads  # a compiled graph per thread count
    args.batches = [int(b) for b in args.batches.split(",")]
    args.threads = [int(t) for t in args.threads.split(",")]
    # Each (model, batch, cache size) is its own compiled graph: more than dynamo's default limit of 8.
    torch._dynamo.config.recompile_limit = 64
    print("command:", " ".join([sys.executable, *sys.argv]))
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx", "avx_vnni", "avx2")))
    print(f"CPU: {cpu_name()}; flags: {' '.join(flags)}")
    print(f"torch {torch.__version__}; {configuration()}")
    bandwidth = {t: memory_bandwidth(t, 16 if args.smoke else 512) for t in args.threads}
    print(f"memory bandwidth (streaming torch sum of {16 if args.smoke else 512} MB): "
          + ", ".join(f"{bw / 1e9:.1f} GB/s on {t} thread{'s' * (t > 1)}" for t, bw in bandwidth.items()))
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    if busy:
        print(f"{args.busy} busy-loop process(es) running beside the benchmark")
    start = time.perf_counter()
    try:
        if args.gguf:
            run_file(args.gguf, args, bandwidth)
        else:
            with tempfile.TemporaryDirectory() as folder:
                for kind in args.models.split(","):
                    run_model(kind, Path(folder), args, bandwidth)
        print(f"\nbenchmark took {(time.perf_counter() - start) / 60:.1f} minutes")
    finally:
        for process in busy:
            process.kill()
            process.wait()


if __name__ == "__main__":
    main()
