"""Which LoRA settings learn on the models the README makes: learning curves of candidate defaults
(sites, rank, learning rate, steps) fine-tuning the demo model on a small chat set, and whether the
result answers and stops.

    python benchmarks/bench_lora_defaults.py --base runs/shakespeare-char-cpu       # every candidate
    python benchmarks/bench_lora_defaults.py --base runs/shakespeare-char-cpu --candidates default,old-default
    python benchmarks/bench_lora_defaults.py --smoke    # two candidates, 4 steps, on a tiny random base (the suite's)

The base is `bash scripts/demo.sh`'s model; the data is examples/chat/shakespeare.jsonl (240
conversations: four requests, "Greet NAME." -> "Good morrow, NAME!" and the like, over 60 names from
the plays) rendered with examples/chat/template.jinja, whose answers end with the eos. A tenth is
held out (`--val-fraction`, as `glasslm finetune` splits it). Each candidate is a `glasslm finetune`
run in process (prepare_model, chat_batches, train) on `--threads` (1) thread, with glasslm
finetune's settings where the candidate names none (`--steps`: its max_steps, else theirs); the
validation loss is recorded every `--eval-every` steps. At the end the prompts of the first
`--asked` (48) training and held-out conversations are answered greedily: "answered" counts answers
that are exactly right and end with the eos (generation stopped by itself). The load average is
printed before and after each candidate (other jobs make the seconds noise, not the curves).
Results as JSON with --json FILE.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict

import torch

from glasslm.data.sft import read_conversations, split_examples
from glasslm.generation import generate_tokens
from glasslm.tokenizers import special_token_ids
from glasslm.tokenizers.chat import ChatFormat
from glasslm.training.config import TrainConfig
from glasslm.training.finetune import FinetuneConfig, chat_batches, prepare_model
from glasslm.training.loop import train

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(HERE, "..", "examples", "chat")
BLOCKS = "q,k,v,attn_out,mlp_up,mlp_gate,mlp_down"
# name -> (FinetuneConfig fields, TrainConfig fields); "default" is what `glasslm finetune` runs.
CANDIDATES = {
    "old-default": (dict(lora_rank=8, lora_alpha=16.0, lora_sites="q,v", lora_dropout=0.05), dict(lr=2e-4)),
    "qv-lr1e-3": (dict(lora_rank=8, lora_alpha=16.0, lora_sites="q,v", lora_dropout=0.05), dict(lr=1e-3)),
    "qv-lr1e-2": (dict(lora_rank=8, lora_alpha=16.0, lora_sites="q,v", lora_dropout=0.0), dict(lr=1e-2)),
    "blocks-r8-lr1e-3": (dict(lora_rank=8, lora_alpha=16.0, lora_sites=BLOCKS, lora_dropout=0.0), dict(lr=1e-3)),
    "blocks-r8-lr3e-3": (dict(lora_rank=8, lora_alpha=16.0, lora_sites=BLOCKS, lora_dropout=0.0), dict(lr=3e-3)),
    "blocks-r16-lr3e-3": (dict(lora_rank=16, lora_alpha=16.0, lora_sites=BLOCKS, lora_dropout=0.0), dict(lr=3e-3)),
    "blocks-r8-lr1e-2": (dict(lora_rank=8, lora_alpha=16.0, lora_sites=BLOCKS, lora_dropout=0.0), dict(lr=1e-2)),
    "blocks-r16-lr1e-2": (dict(lora_rank=16, lora_alpha=16.0, lora_sites=BLOCKS, lora_dropout=0.0), dict(lr=1e-2)),
    "blocks-r16-lr1e-2-b16": (dict(lora_rank=16, lora_alpha=16.0, lora_sites=BLOCKS, lora_dropout=0.0),
                              dict(lr=1e-2, batch_size=16)),
    "blocks-r16-a32-lr3e-3": (dict(lora_rank=16, lora_alpha=32.0, lora_sites=BLOCKS, lora_dropout=0.0), dict(lr=3e-3)),
    "default": ({}, {}),
}


def answered(model, tokenizer, chat: ChatFormat, conversations, max_new_tokens: int = 40) -> float:
    """Share of conversations whose greedy answer is exactly the assistant's and ends with the eos."""
    eos = special_token_ids(tokenizer)["eos"]
    model.eval()
    hits = 0
    for messages in conversations:
        prompt = tokenizer.encode(chat.prompt(messages[:-1]))
        ids = list(generate_tokens(model, prompt, max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True))
        if eos in ids:
            hits += tokenizer.decode(ids[:ids.index(eos)]) == messages[-1]["content"]
    return hits / max(1, len(conversations))


def run_candidate(name: str, args: argparse.Namespace) -> dict:
    """Fine-tune the base with one candidate's settings; its curve, answers and time."""
    from glasslm.cli.finetune import FINETUNE_DEFAULTS

    method, training = CANDIDATES[name]
    config = FinetuneConfig(**method)
    steps = {"max_steps": args.steps} if args.steps else {}
    cfg = TrainConfig(**{**FINETUNE_DEFAULTS, **training, **steps, "eval_interval": args.eval_every,
                         "progress": False, "device": "cpu", "seed": args.seed})
    model, tokenizer, _ = prepare_model(args.base, config, seed=args.seed)
    template = open(args.template, encoding="utf-8").read()
    train_batches, val_batches = chat_batches(args.data, tokenizer, template, model.config.context_length,
                                              config.val_fraction, args.seed)
    curve: list[tuple[int, float]] = []
    started = time.perf_counter()
    result = train(model, cfg, train_batches, val_batches, on_eval=lambda step, loss, _: curve.append((step, loss)))
    seconds = time.perf_counter() - started
    conversations = read_conversations(args.data)
    train_ids, val_ids = split_examples(list(range(len(conversations))), config.val_fraction, args.seed)
    chat = ChatFormat.for_tokenizer(template, tokenizer)
    return {"name": name, "method": asdict(config), "lr": cfg.lr, "steps": cfg.max_steps, "seconds": seconds,
            "curve": curve, "final_train_loss": sum(result.train_losses[-10:]) / 10,
            "answered_train": answered(result.model, tokenizer, chat, [conversations[i] for i in train_ids[:args.asked]]),
            "answered_held_out": answered(result.model, tokenizer, chat,
                                          [conversations[i] for i in val_ids[:args.asked]])}


def smoke_base(data: str, folder: str) -> str:
    """A one-layer random char model whose vocabulary covers `data` and the template's words, saved in `folder`."""
    from glasslm.core.model import TransformerLM
    from glasslm.io.checkpoint import save_checkpoint
    from glasslm.presets import get_preset
    from glasslm.tokenizers import CharTokenizer

    with open(data, encoding="utf-8") as f:
        tokenizer = CharTokenizer.from_text(f.read() + "USER: ASSISTANT\n")
    torch.manual_seed(0)
    config = get_preset("shakespeare-char-cpu", vocab_size=tokenizer.vocab_size, n_layers=1, d_model=32, n_heads=2)
    return str(save_checkpoint(os.path.join(folder, "base"), TransformerLM(config), tokenizer))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="runs/shakespeare-char-cpu", help="the base checkpoint (the demo's run)")
    parser.add_argument("--data", default=os.path.join(EXAMPLES, "shakespeare.jsonl"))
    parser.add_argument("--template", default=os.path.join(EXAMPLES, "template.jinja"))
    parser.add_argument("--candidates", default=",".join(CANDIDATES), help="comma-separated names")
    parser.add_argument("--steps", type=int, default=None, help="default: glasslm finetune's")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=TrainConfig().seed, help="default: glasslm finetune's")
    parser.add_argument("--asked", type=int, default=48, help="conversations answered, of each split")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", metavar="FILE", help="write the results here")
    parser.add_argument("--smoke", action="store_true", help="a check that it runs: two candidates, 4 steps, "
                                                             "a tiny random base written to a temporary folder")
    args = parser.parse_args()
    if args.smoke:
        args.base = smoke_base(args.data, tempfile.mkdtemp())
        args.candidates, args.steps, args.eval_every, args.asked = "default,old-default", 4, 2, 4
    torch.set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()[0]:.2f}", file=sys.stderr)
    results = []
    for name in args.candidates.split(","):
        row = run_candidate(name, args)
        results.append(row)
        curve = " ".join(f"{step}:{loss:.3f}" for step, loss in row["curve"])
        print(f"{name:18s} {row['seconds']:6.1f} s  answered train {row['answered_train']:.0%} held-out "
              f"{row['answered_held_out']:.0%}  val {curve}  (load {os.getloadavg()[0]:.2f})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
