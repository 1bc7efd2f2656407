"""A character model trained by glasslm, exported with `glasslm convert --to-hf`: its tokenizer has
`<|endoftext|>` as bos and eos, transformers' `generate` stops at it exactly where glasslm's does,
and lm-eval's `--model hf` runs generate_until tasks on the export (before char tokenizers had an
end-of-text, it crashed there: `'None' is not an instance of 'Sequence'`)."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from glasslm.cli import main
from glasslm.generation import generate_text, generate_tokens
from glasslm.hf import load_model
from glasslm.io.checkpoint import load_checkpoint, save_checkpoint

PROMPT = "ROMEO:\n"
MAX_NEW = 24


def _greedy(model, ids: list[int], n: int = MAX_NEW) -> list[int]:
    """transformers' greedy continuation of `ids` (stopping at generation_config's eos)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def char_export(tmp_path_factory, shakespeare_text):
    """(trained run's checkpoint, HF export, the greedy tokens before rigging, the rigged step)."""
    root = tmp_path_factory.mktemp("char-eot")
    (root / "text.txt").write_text(shakespeare_text[:20_000])
    assert main(["train", "--preset", "shakespeare-char-cpu", "--data", str(root / "text.txt"), "--out",
                 str(root / "run"), "--max-steps", "2", "--n-layers", "1", "--d-model", "32", "--n-heads", "2",
                 "--context-length", "32", "--batch-size", "4", "--eval-iters", "1", "--no-progress",
                 "--sample-tokens", "0", "--no-qk-norm"]) == 0  # (with the preset's q/k norms, perturbed
    # weights as below repeat one character: no step where a new token could be rigged)
    model, tokenizer, meta = load_checkpoint(root / "run")
    end = tokenizer.special_tokens["<|endoftext|>"]
    assert end == tokenizer.vocab_size - 1 == model.config.vocab_size - 1 and model.eos_token_ids == (end,)
    ids = tokenizer.encode(PROMPT)
    # A few steps leave greedy decoding repeating one character: weights far from that give varied text.
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    before_ids = list(generate_tokens(model.eval(), ids, max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    natural_end = before_ids.index(end) if end in before_ids else MAX_NEW
    # Rig the (tied) table so <|endoftext|> scores 1% above the token greedy decoding picks at
    # `step`, a token it has not picked before: there the model ends its text.
    step = next(k for k in range(6, natural_end) if before_ids[k] not in before_ids[:k])
    with torch.no_grad():
        model.embed.weight[end] = 1.01 * model.embed.weight[before_ids[step]]
    save_checkpoint(root / "rigged", model, tokenizer, meta)
    assert main(["convert", "--to-hf", "--checkpoint", str(root / "rigged"), "--out", str(root / "hf")]) == 0
    return root, ids, before_ids, step


def test_the_export_names_endoftext_as_bos_and_eos(char_export):
    root, ids, _, _ = char_export
    _, tokenizer, _ = load_checkpoint(root / "rigged")
    end = tokenizer.special_tokens["<|endoftext|>"]
    auto = AutoTokenizer.from_pretrained(root / "hf")
    assert (auto.bos_token, auto.eos_token) == ("<|endoftext|>", "<|endoftext|>")
    assert (auto.bos_token_id, auto.eos_token_id) == (end, end) and len(auto) == tokenizer.vocab_size
    assert auto.encode(PROMPT + "<|endoftext|>", add_special_tokens=False) == ids + [end]
    assert auto.decode(ids + [end]) == PROMPT + "<|endoftext|>"
    config = json.loads((root / "hf" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (end, end)
    assert GenerationConfig.from_pretrained(root / "hf").eos_token_id == end


def test_transformers_and_glasslm_stop_at_endoftext_in_the_same_place(char_export):
    root, ids, before_ids, step = char_export
    hf_model = AutoModelForCausalLM.from_pretrained(root / "hf").eval()
    theirs = _greedy(hf_model, ids)
    end = theirs[-1]
    assert theirs[:-1] == before_ids[:step] and end == hf_model.generation_config.eos_token_id  # stopped at eos
    for model, tokenizer in (load_checkpoint(root / "rigged")[:2], load_model(root / "hf")):
        text = generate_text(model.eval(), tokenizer, PROMPT, max_new_tokens=MAX_NEW, temperature=0.0)
        assert tokenizer.encode(text) == theirs[:-1]
        longer = generate_text(model, tokenizer, PROMPT, max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        assert tokenizer.encode(longer)[: step + 1] == theirs  # --ignore-eos goes on past it


UNTIL_TASK = """task: char_until
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["?"]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.mark.slow  # lm-eval reads every task definition it ships (~6 s)
def test_lm_eval_hf_generate_until_runs_on_the_export_and_stops_at_eos(char_export, monkeypatch):
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root, ids, before_ids, step = char_export
    tasks = root / "tasks"
    tasks.mkdir(exist_ok=True)
    questions = [PROMPT, "JULIET:\n", "First Citizen:\n"]
    (tasks / "docs.jsonl").write_text("".join(json.dumps({"question": q, "answer": "x"}) + "\n" for q in questions))
    (tasks / "char_until.yaml").write_text(UNTIL_TASK.format(docs=tasks / "docs.jsonl"))
    results = simple_evaluate(model="hf", model_args=f"pretrained={root / 'hf'},dtype=float32", device="cpu",
                              tasks=["char_until"], task_manager=TaskManager(include_path=str(tasks)),
                              log_samples=True, batch_size=1)
    by_question = {s["doc"]["question"]: s["resps"][0][0] for s in results["samples"]["char_until"]}
    model, tokenizer, _ = load_checkpoint(root / "rigged")
    # glasslm's greedy text, cut at eos and at lm-eval's "?" (prompt + 16 tokens fit the context of 32,
    # so lm-eval cuts nothing off the prompt).
    for question in questions:
        ours = generate_text(model.eval(), tokenizer, question, max_new_tokens=16, temperature=0.0, stop_strings=["?"])
        assert by_question[question] == ours, question
    assert by_question[PROMPT] == tokenizer.decode(before_ids[:step])  # ended at <|endoftext|>
