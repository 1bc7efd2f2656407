"""Evaluation: perplexity of a uniform model is the vocabulary size, sliding windows score every
token once with the context they promise, and a short text is one forward pass."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from glasslm.io.checkpoint import save_checkpoint
from glasslm.cli import main
from glasslm.presets import get_preset
from glasslm.evaluation.perplexity import evaluate_text, evaluate_tokens, sliding_windows
from glasslm.core.model import TransformerLM
from glasslm.tokenizers import CharTokenizer

TEXT = "to be, or not to be, that is the question: whether 'tis nobler in the mind to suffer\n" * 3


def tiny(vocab: int, context: int = 16, family: str = "gpt2-small", seed: int = 0) -> TransformerLM:
    cfg = get_preset(family, vocab_size=vocab, n_layers=2, d_model=32, n_heads=2, context_length=context)
    torch.manual_seed(seed)
    model = TransformerLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(5.0)  # peaked predictions, so wrong context changes the loss visibly
    return model


def test_uniform_model_has_perplexity_equal_to_the_vocabulary_size():
    tok = CharTokenizer.from_text(TEXT)
    model = tiny(tok.vocab_size)
    with torch.no_grad():
        model.ln_final.weight.zero_()
        model.ln_final.bias.zero_()  # final hidden state 0, so every logit is 0
    result = evaluate_text(model, tok, TEXT, stride=5)
    assert result["perplexity"] == pytest.approx(tok.vocab_size, rel=1e-5)
    assert result["tokens"] == len(TEXT) - 1 and result["bytes"] == len(TEXT) - 1
    assert result["bits_per_byte"] == pytest.approx(math.log2(tok.vocab_size), rel=1e-5)


def test_short_text_is_a_single_forward_pass():
    tok = CharTokenizer.from_text(TEXT)
    model = tiny(tok.vocab_size, context=64)
    ids = torch.tensor(tok.encode(TEXT[:50]))
    with torch.no_grad():
        expected = F.cross_entropy(model(ids[None, :-1])[0], ids[1:]).item()
    for stride in (None, 7, 64):
        assert evaluate_tokens(model, ids, stride=stride)["loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_stride_equal_to_context_is_chunked_loss(batch_size):
    tok = CharTokenizer.from_text(TEXT)
    context = 16
    model = tiny(tok.vocab_size, context=context, family="llama-tiny")
    ids = torch.tensor(tok.encode(TEXT))
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, context):  # chunk k: inputs ids[start:start+16] -> next tokens
            inputs = ids[start:start + context + 1][:-1]
            targets = ids[start + 1:start + context + 1]
            nll += F.cross_entropy(model(inputs[None])[0], targets, reduction="sum").item()
            count += len(targets)
    result = evaluate_tokens(model, ids, stride=context, batch_size=batch_size)
    assert result["tokens"] == count == len(ids) - 1
    assert result["loss"] == pytest.approx(nll / count, rel=1e-5)


def test_smaller_stride_gives_every_target_more_context():
    tok = CharTokenizer.from_text(TEXT)
    context, stride = 16, 4
    model = tiny(tok.vocab_size, context=context)
    ids = torch.tensor(tok.encode(TEXT))
    # By hand: target t is predicted from the window that first covers it, as the sliding rule says.
    nll = 0.0
    with torch.no_grad():
        for t in range(1, len(ids)):
            start = 0 if t <= context else ((t - context - 1) // stride + 1) * stride
            logits = model(ids[start:t][None])[0, -1]
            assert t - start >= min(t, context - stride + 1)  # the context a stride promises
            nll += F.cross_entropy(logits[None], ids[t:t + 1], reduction="sum").item()
    result = evaluate_tokens(model, ids, stride=stride, batch_size=4)
    assert result["loss"] == pytest.approx(nll / (len(ids) - 1), rel=1e-5)
    chunked = evaluate_tokens(model, ids, stride=context)["loss"]
    assert result["loss"] != pytest.approx(chunked, rel=1e-3)  # the stride really changed the context


def test_windows_score_each_target_once():
    for n in (2, 3, 17, 18, 100):
        for context, stride in ((16, 16), (16, 1), (16, 5), (4, 3)):
            scored = []
            for start, end, first in sliding_windows(n, context, stride):
                assert end - start <= context
                scored += range(first, end + 1)
            assert scored == list(range(1, n))
    with pytest.raises(ValueError):
        sliding_windows(10, 4, 5)


def test_cli_eval_prints_loss_perplexity_and_bits_per_byte(tmp_path, capsys):
    tok = CharTokenizer.from_text(TEXT)
    model = tiny(tok.vocab_size, context=32)
    path = save_checkpoint(tmp_path / "ckpt", model, tok)
    (tmp_path / "text.txt").write_text(TEXT)
    assert main(["eval", "--checkpoint", str(path), "--data", str(tmp_path / "text.txt"), "--stride", "8",
                 "--split", "all"]) == 0
    out = capsys.readouterr().out
    expected = evaluate_text(model, tok, TEXT, stride=8)
    assert f"loss {expected['loss']:.4f}" in out
    assert f"perplexity {expected['perplexity']:.3f}" in out
    assert f"bits/byte {expected['bits_per_byte']:.4f}" in out


def _split_fixture(tmp_path):
    from glasslm.data import prepare

    text = "".join(f"line {i}: to be or not to be\n" for i in range(60))
    tok = CharTokenizer.from_text(text)
    model = tiny(tok.vocab_size, context=16)
    path = save_checkpoint(tmp_path / "ckpt", model, tok)
    (tmp_path / "text.txt").write_text(text)
    prepare([tmp_path / "text.txt"], tok, tmp_path / "ds", progress=False)
    return text, tok, model, path


def _scores(out: str) -> str:
    return out.splitlines()[-1].split("(")[0]  # "loss ...  perplexity ...  bits/byte ..."


def test_cli_eval_scores_the_validation_split_of_text_or_prepared_data(tmp_path, capsys):
    from glasslm.data import read_split, split_offset

    text, tok, model, path = _split_fixture(tmp_path)
    val = text.encode()[split_offset(tmp_path / "text.txt"):].decode()
    assert read_split(tmp_path / "text.txt", "val") == val and 0 < len(val) < len(text) // 5
    assert main(["eval", "--checkpoint", str(path), "--data", str(tmp_path / "text.txt")]) == 0  # default: val
    captured = capsys.readouterr()
    expected = evaluate_text(model, tok, val)
    assert f"loss {expected['loss']:.4f}" in captured.out and f"{expected['tokens']:,} tokens scored" in captured.out
    assert "eval" in captured.err and "tok" in captured.err  # the progress bar, on stderr
    # A prepared dataset's val.bin holds the same text, so the same scores.
    assert main(["eval", "--checkpoint", str(path), "--data", str(tmp_path / "ds"), "--quiet"]) == 0
    assert _scores(capsys.readouterr().out) == _scores(captured.out)
    for split, part in (("train", text[:len(text) - len(val)]), ("all", text)):
        assert main(["eval", "--checkpoint", str(path), "--data", str(tmp_path / "ds"), "--split", split,
                     "--quiet"]) == 0
        assert f"loss {evaluate_text(model, tok, part)['loss']:.4f}" in capsys.readouterr().out


def test_cli_eval_max_tokens_bounds_the_work(tmp_path, capsys):
    text, tok, model, path = _split_fixture(tmp_path)
    for data in (str(tmp_path / "text.txt"), str(tmp_path / "ds")):
        assert main(["eval", "--checkpoint", str(path), "--data", data, "--split", "all", "--max-tokens", "50",
                     "--quiet"]) == 0
        out = capsys.readouterr().out
        expected = evaluate_text(model, tok, text[:51])
        assert "50 tokens scored" in out and f"loss {expected['loss']:.4f}" in out
        assert f"bits/byte {expected['bits_per_byte']:.4f}" in out


def test_cli_eval_refuses_a_dataset_of_another_tokenizer(tmp_path, capsys):
    from glasslm.data import prepare

    text, tok, model, path = _split_fixture(tmp_path)
    other = CharTokenizer(list(reversed(tok.chars)))  # same size, different ids
    prepare([tmp_path / "text.txt"], other, tmp_path / "ds2", progress=False)
    assert main(["eval", "--checkpoint", str(path), "--data", str(tmp_path / "ds2")]) == 1
    assert "different tokenizer" in capsys.readouterr().err


def test_the_refusal_of_a_dataset_of_another_tokenizer_gives_advice_that_works_for_a_run_directory(tmp_path, capsys):
    # "prepare it with --tokenizer pointing at the checkpoint": `glasslm prepare` once refused a run
    # directory there (it held no tokenizer file of its own, only its checkpoints do).
    import shutil

    from glasslm.data import prepare
    from glasslm.io.checkpoint import write_pointer

    text, tok, model, path = _split_fixture(tmp_path)
    run = tmp_path / "run"
    shutil.copytree(path, run / "ckpt-000010")
    write_pointer(run, "latest", "ckpt-000010")
    prepare([tmp_path / "text.txt"], CharTokenizer(list(reversed(tok.chars))), tmp_path / "ds2", progress=False)
    assert main(["eval", "--checkpoint", str(run), "--data", str(tmp_path / "ds2")]) == 1
    assert "prepare it with --tokenizer pointing at the checkpoint" in capsys.readouterr().err
    assert main(["prepare", str(tmp_path / "text.txt"), "--tokenizer", str(run), "--out", str(tmp_path / "ds3"),
                 "--quiet"]) == 0
    capsys.readouterr()
    for data in (str(tmp_path / "ds3"), str(tmp_path / "text.txt")):
        assert main(["eval", "--checkpoint", str(run), "--data", data, "--quiet"]) == 0
    by_dataset, by_text = capsys.readouterr().out.strip().split("\n")[1::2]
    assert _scores(by_dataset) == _scores(by_text)
