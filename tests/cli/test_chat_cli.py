"""`glasslm chat` through the CLI: each turn renders the whole conversation with the checkpoint's
chat template and answers with glasslm's own generation; /reset, --system, eos stopping, Ctrl-C."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from glasslm.cli import main
from glasslm.core.model import TransformerLM
from glasslm.generation import generate_text
from glasslm.io.checkpoint import save_checkpoint
from glasslm.presets import get_preset
from glasslm.tokenizers import CharTokenizer
from glasslm.tokenizers.chat import CHAT_TEMPLATE_FILE, render_chat
from terminal_session import interrupt_two_answers

TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tok = CharTokenizer(list("\n :abcdefghijklmnopqrstuvwxyz"))
    torch.manual_seed(0)
    model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=tok.vocab_size, n_layers=1, d_model=32,
                                     n_heads=2, context_length=128)).eval()
    with torch.no_grad():  # larger weights: answers that depend on the context, so the history shows
        for weight in model.parameters():
            weight.mul_(4.0)
    path = save_checkpoint(tmp_path_factory.mktemp("chat") / "ckpt", model, tok)
    (Path(path) / CHAT_TEMPLATE_FILE).write_text(TEMPLATE, encoding="utf-8")
    return path, model, tok


def _answer(model, tok, messages):
    prompt = render_chat(TEMPLATE, messages, add_generation_prompt=True)
    return generate_text(model, tok, prompt, max_new_tokens=8, temperature=1.0, seed=3)


def test_chat_keeps_the_history_and_reset_forgets_it(checkpoint, capsys, monkeypatch):
    path, model, tok = checkpoint
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nand you\n/reset\nhello\n"))
    assert main(["chat", "--checkpoint", str(path), "--system", "be brief", "--max-new-tokens", "8",
                 "--seed", "3"]) == 0
    out = capsys.readouterr().out
    system = {"role": "system", "content": "be brief"}
    first = _answer(model, tok, [system, {"role": "user", "content": "hello"}])
    second = _answer(model, tok, [system, {"role": "user", "content": "hello"}, {"role": "assistant", "content": first},
                                  {"role": "user", "content": "and you"}])
    assert out == f"{first}\n{second}\n{first}\n"  # after /reset the first answer comes again
    assert second != _answer(model, tok, [system, {"role": "user", "content": "and you"}])  # the history mattered


def test_chat_without_a_template_says_how_to_give_one(tmp_path, capsys):
    tok = CharTokenizer(list("\n :abcdefghijklmnopqrstuvwxyz"))
    path = save_checkpoint(tmp_path / "plain", TransformerLM(get_preset("llama-tiny", vocab_size=tok.vocab_size)), tok)
    assert main(["chat", "--checkpoint", str(path)]) == 1
    assert "--chat-template FILE" in capsys.readouterr().err
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sys.stdin", io.StringIO("ab\n"))
        assert main(["chat", "--checkpoint", str(path), "--chat-template", str(tmp_path / "t.jinja"),
                     "--max-new-tokens", "2"]) == 0


@pytest.mark.slow
def test_chat_with_an_imported_llama_stops_at_its_eos(llama_chat, capsys, monkeypatch):
    directory, hf_model, hf_tok = llama_chat
    messages = [{"role": "user", "content": "hi"}]
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    out = hf_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    assert main(["chat", "--checkpoint", str(directory), "--max-new-tokens", "16", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == hf_tok.decode(out[:-1]) + "\n"


@pytest.mark.slow
def test_ctrl_c_stops_the_answer_not_the_conversation(checkpoint):
    interrupt_two_answers(["chat", "--checkpoint", str(checkpoint[0]), "--max-new-tokens", "1000000", "--ignore-eos"],
                          "you> ", b"hello\n")
