"""A model that has a chat template carries it through every command (issue 32): a fine-tune's
`--chat-template FILE` stays in its checkpoints, and `merge`, `quantize`, `convert --to-hf` keep or
export it, so transformers' `apply_chat_template` and `lm_eval --apply_chat_template` work on the
export and render what glasslm renders."""

from __future__ import annotations

import json

import pytest
import torch

from glasslm.cli import main
from glasslm.core.model import TransformerLM
from glasslm.hf import load_chat_template, load_model
from glasslm.io.checkpoint import save_checkpoint
from glasslm.presets import get_preset
from glasslm.tokenizers import CharTokenizer
from glasslm.tokenizers.chat import CHAT_TEMPLATE_FILE, ChatFormat

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}"
            "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %};{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")
TOKENIZER = CharTokenizer.from_text("abcdefgh ua:;")
MESSAGES = [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "cba"},
            {"role": "user", "content": "hg"}]


@pytest.fixture
def tuned(tmp_path):
    """A LoRA fine-tune of a char model, rendered with a --chat-template file."""
    torch.manual_seed(0)
    base = TransformerLM(get_preset("llama-tiny", vocab_size=TOKENIZER.vocab_size, context_length=32, n_layers=1))
    save_checkpoint(tmp_path / "base", base, TOKENIZER)
    rows = [{"messages": [{"role": "user", "content": u}, {"role": "assistant", "content": u[::-1]}]}
            for u in ("abc", "hg fe", "d", "ab cd")] * 2
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    assert main(["finetune", "--checkpoint", str(tmp_path / "base"), "--data", str(tmp_path / "chat.jsonl"),
                 "--chat-template", str(tmp_path / "t.jinja"), "--out", str(tmp_path / "ft"), "--max-steps", "2",
                 "--batch-size", "2", "--eval-interval", "1", "--keep-last", "0", "--no-progress",
                 "--device", "cpu"]) == 0
    return tmp_path


def test_every_checkpoint_of_a_finetune_keeps_its_template(tuned):
    checkpoints = sorted((tuned / "ft").glob("ckpt-*"))
    assert len(checkpoints) == 2
    assert all((c / CHAT_TEMPLATE_FILE).read_text() == TEMPLATE for c in checkpoints)
    model, tokenizer = load_model(tuned / "ft")
    assert load_chat_template(tuned / "ft", tokenizer) == TEMPLATE  # chat, serve: no --chat-template needed


def test_merge_and_quantize_keep_the_template(tuned):
    assert main(["merge", "--checkpoint", str(tuned / "ft"), "--out", str(tuned / "merged")]) == 0
    assert main(["quantize", "--checkpoint", str(tuned / "merged"), "--out", str(tuned / "q")]) == 0
    for name in ("merged", "q"):
        assert load_chat_template(tuned / name, load_model(tuned / name)[1]) == TEMPLATE


def test_an_old_finetune_checkpoint_finds_the_template_its_meta_records(tuned):
    """Checkpoints written before they kept chat_template.jinja recorded the template in meta.json."""
    checkpoint = sorted((tuned / "ft").glob("ckpt-*"))[-1]
    (checkpoint / CHAT_TEMPLATE_FILE).unlink()
    assert load_chat_template(tuned / "ft", load_model(tuned / "ft")[1]) == TEMPLATE


def test_a_merged_hf_export_renders_in_transformers_as_in_glasslm(tuned):
    transformers = pytest.importorskip("transformers")
    assert main(["merge", "--checkpoint", str(tuned / "ft"), "--out", str(tuned / "hf"), "--to-hf"]) == 0
    theirs = transformers.AutoTokenizer.from_pretrained(tuned / "hf")
    ours = ChatFormat.for_tokenizer(TEMPLATE, TOKENIZER)
    assert theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == ours.prompt(MESSAGES)
    assert theirs.apply_chat_template(MESSAGES[:2], tokenize=False) == ours.render(MESSAGES[:2])
    assert "<|endoftext|>" in ours.render(MESSAGES[:2])  # the eos really is written, by both


def test_an_imported_chat_model_exports_its_template(llama_chat, tmp_path):
    transformers = pytest.importorskip("transformers")
    directory, _, hf_tokenizer = llama_chat
    assert main(["convert", "--from-hf", str(directory), "--out", str(tmp_path / "imported")]) == 0
    assert main(["convert", "--to-hf", "--checkpoint", str(tmp_path / "imported"), "--out", str(tmp_path / "hf")]) == 0
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    messages = [{"role": "user", "content": "hi there"}]
    assert exported.chat_template == hf_tokenizer.chat_template
    assert exported.apply_chat_template(messages, add_generation_prompt=True) == \
        hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def _task(docs) -> str:
    """A generate-until lm-eval task over `docs` (JSON, which is YAML too)."""
    return json.dumps({"task": "tiny_chat", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(docs)}},
                       "test_split": "test", "output_type": "generate_until", "doc_to_text": "{{question}}",
                       "doc_to_target": "{{answer}}", "metric_list": [{"metric": "exact_match"}],
                       "generation_kwargs": {"until": ["."], "max_gen_toks": 4, "do_sample": False}})


@pytest.mark.slow  # lm-eval reads every task definition it ships (~6 s)
def test_lm_eval_applies_the_chat_template_of_an_imported_then_exported_chat_model(llama_chat, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    directory, _, hf_tokenizer = llama_chat
    assert main(["convert", "--from-hf", str(directory), "--out", str(tmp_path / "imported")]) == 0
    assert main(["convert", "--to-hf", "--checkpoint", str(tmp_path / "imported"), "--out", str(tmp_path / "hf")]) == 0
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"question": q, "answer": "a"}) + "\n"
                                                 for q in ("hi", "hello there")))
    (tmp_path / "tiny_chat.yaml").write_text(_task(tmp_path / "docs.jsonl"))
    results = simple_evaluate(model="hf", model_args=f"pretrained={tmp_path / 'hf'},dtype=float32", device="cpu",
                              tasks=["tiny_chat"], apply_chat_template=True, log_samples=True, batch_size=1,
                              task_manager=TaskManager(include_path=str(tmp_path)))
    prompts = [s["arguments"][0][0] for s in results["samples"]["tiny_chat"]]
    assert sorted(prompts) == sorted(hf_tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                                      add_generation_prompt=True)
                                     for q in ("hi", "hello there"))
