"""One rendering for training and inference (issue 32): a template's `{{ eos_token }}` is the
tokenizer's real eos in fine-tuning data as in `glasslm chat`, so a fine-tuned model writes its
answer, then the eos, and generation stops there with no extra flags."""

from __future__ import annotations

import io
import json

import torch

from glasslm.cli import main
from glasslm.core.model import TransformerLM
from glasslm.data.sft import IGNORE_INDEX, encode_conversation
from glasslm.io.checkpoint import save_checkpoint
from glasslm.presets import get_preset
from glasslm.tokenizers import CharTokenizer, special_token_ids
from glasslm.tokenizers.chat import chat_prompt

# The eos closes each answer, as Llama 2, Mistral and Zephyr templates write it.
TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}"
            "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %};{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")
TOKENIZER = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz ua:;!")
PAIRS = [("hi", "hello there"), ("bye", "good night"), ("who", "a tiny model"), ("why", "just because")]


def _conversation(user: str, answer: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def test_training_text_is_the_chat_prompt_then_the_answer_and_the_real_eos():
    eos = special_token_ids(TOKENIZER)["eos"]
    example = encode_conversation(TOKENIZER, TEMPLATE, _conversation("hi", "hello there"))
    prompt = TOKENIZER.encode(chat_prompt(TEMPLATE, [{"role": "user", "content": "hi"}], TOKENIZER))
    answer = TOKENIZER.encode("hello there")
    # What `glasslm chat` sends is exactly the start of what training saw; the eos id follows the answer.
    assert example.ids == prompt + answer + [eos] + TOKENIZER.encode(";")
    trained = [label for label in example.labels if label != IGNORE_INDEX]
    assert trained == answer + [eos] + TOKENIZER.encode(";")  # the model is taught to write the eos


def test_a_finetuned_model_stops_where_its_training_answers_stopped(tmp_path, capsys, monkeypatch):
    torch.manual_seed(0)
    config = get_preset("llama-tiny", vocab_size=TOKENIZER.vocab_size, context_length=32, n_layers=2, d_model=64,
                        n_heads=4, n_kv_heads=4, d_mlp=128)
    save_checkpoint(tmp_path / "base", TransformerLM(config), TOKENIZER)
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": _conversation(u, a)}) + "\n"
                                                 for u, a in PAIRS * 8))
    (tmp_path / "template.jinja").write_text(TEMPLATE)
    assert main(["finetune", "--checkpoint", str(tmp_path / "base"), "--data", str(tmp_path / "chat.jsonl"),
                 "--chat-template", str(tmp_path / "template.jinja"), "--full", "--lr", "3e-3", "--max-steps", "120",
                 "--warmup-steps", "10", "--val-fraction", "0", "--out", str(tmp_path / "ft"), "--no-progress",
                 "--device", "cpu", "--threads", "1"]) == 0
    capsys.readouterr()
    # No --chat-template (the checkpoint kept it), no --max-new-tokens or --stop: only the eos ends each answer.
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{user}\n/reset\n" for user, _ in PAIRS)))
    assert main(["chat", "--checkpoint", str(tmp_path / "ft"), "--seed", "0"]) == 0
    assert capsys.readouterr().out == "".join(f"{answer}\n" for _, answer in PAIRS)
