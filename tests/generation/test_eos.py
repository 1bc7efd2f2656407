"""End of sequence as transformers does it: generation stops at the model's eos ids by default.

The slow tests compare with transformers' own greedy `generate` on a Llama saved by transformers
(generation_config.json lists `</s>` and `<|eot|>`; tests/chat_models.py), through the Python API,
`glasslm generate` (on the HF directory and on a converted checkpoint) and --ignore-eos.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from glasslm.core.model import TransformerLM
from glasslm.generation import GenerationConfig, generate, generate_text, generate_tokens, stream_text
from glasslm.io.checkpoint import load_checkpoint, save_checkpoint
from glasslm.presets import get_preset
from glasslm.tokenizers import CharTokenizer, eos_token_ids, train_tokenizer_from_text


def _greedy_run(model, prompt, n=24):
    return list(generate_tokens(model, prompt, max_new_tokens=n, temperature=0.0, ignore_eos=True))


def test_generation_stops_at_the_models_eos_ids_unless_ignore_eos():
    torch.manual_seed(0)
    model = TransformerLM(get_preset("llama-tiny")).eval()
    full = _greedy_run(model, [1, 2, 3])
    eos = full[5]  # a token the model really produces, made its end of sequence
    model.eos_token_ids = (eos, 10_000)
    expected = full[:full.index(eos)]
    assert list(generate_tokens(model, [1, 2, 3], max_new_tokens=24, temperature=0.0)) == expected
    [batched] = generate(model, [[1, 2, 3]], GenerationConfig(max_new_tokens=24, temperature=0.0))
    assert batched.tokens == expected and batched.finish_reason == "stop_token"
    assert _greedy_run(model, [1, 2, 3]) == full  # ignore_eos goes on


def test_a_trained_bpe_ends_at_endoftext_and_an_empty_prompt_starts_from_it(tmp_path):
    tokenizer = train_tokenizer_from_text("the cat sat on the mat. " * 30, vocab_size=280)
    end = tokenizer.special_tokens["<|endoftext|>"]
    assert eos_token_ids(tokenizer) == (end,)
    save_checkpoint(tmp_path, TransformerLM(get_preset("llama-tiny", vocab_size=tokenizer.vocab_size)), tokenizer)
    model, tokenizer, _ = load_checkpoint(tmp_path)
    assert model.eos_token_ids == (end,)
    text = generate_text(model.eval(), tokenizer, "", max_new_tokens=5, temperature=0.0, ignore_eos=True)
    from_bos = tokenizer.decode(list(generate_tokens(model, [end], max_new_tokens=5, temperature=0.0,
                                                     ignore_eos=True)))
    assert text == from_bos


def test_an_old_character_model_has_no_eos_and_starts_from_a_newline():
    tok = CharTokenizer(["\n", "a", "b"])  # as a tokenizer.json from before char tokenizers had <|endoftext|>
    assert eos_token_ids(tok) == ()
    model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=3, n_layers=1)).eval()
    pieces = "".join(stream_text(model, tok, "", max_new_tokens=6, temperature=0.0))
    assert pieces == tok.decode(list(generate_tokens(model, tok.encode("\n"), max_new_tokens=6, temperature=0.0)))
    assert len(pieces) == 6


def test_a_character_model_ends_at_endoftext_and_an_empty_prompt_starts_from_it():
    tok = CharTokenizer.from_text("abcdefghij \n")
    end = tok.special_tokens["<|endoftext|>"]
    assert end == tok.vocab_size - 1 == 12 and eos_token_ids(tok) == (end,)
    torch.manual_seed(0)
    # Without the preset's q/k norms: with them, these random weights repeat one character after the
    # first, and the rigged eos below would win at every position rather than at the fifth.
    model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=tok.vocab_size, n_layers=1,
                                     tie_embeddings=False, qk_norm=False)).eval()
    with torch.no_grad():
        for p in model.parameters():  # far from the init's near-uniform logits: varied text
            p.normal_(0.0, 0.5)
    before = _greedy_run(model, [end], n=12)  # from bos
    with torch.no_grad():  # rigged: <|endoftext|> scores 1% above the 5th token, so it takes its place
        model.unembed.weight[end] = 1.01 * model.unembed.weight[before[4]]
    full = _greedy_run(model, [end], n=12)  # going on past every eos
    assert full[:5] == before[:4] + [end] and end not in before[:4]
    text = generate_text(model, tok, "", max_new_tokens=12, temperature=0.0)  # from bos, stopping at eos
    assert text == tok.decode(before[:4])

def _hf_greedy(hf_model, ids, n=16):
    out = hf_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.mark.slow
def test_an_imported_llama_stops_where_transformers_stops(llama_chat, tmp_path):
    from glasslm.hf import load_model

    directory, hf_model, hf_tok = llama_chat
    model, tokenizer = load_model(directory)
    assert model.eos_token_ids == (2, 3) and tokenizer.encode("hello") == hf_tok.encode("hello", add_special_tokens=False)
    for text in ("", "hello there"):
        ids = tokenizer.encode(text) if text else [hf_tok.bos_token_id]
        theirs = _hf_greedy(hf_model, ids)
        assert theirs[-1] in (2, 3) and len(theirs) < 16  # transformers stopped at an eos
        ours = generate_text(model, tokenizer, text, max_new_tokens=16, temperature=0.0)
        assert ours == hf_tok.decode(theirs[:-1])
        [row] = generate(model, [ids], GenerationConfig(max_new_tokens=16, temperature=0.0), tokenizer)
        assert row.tokens == theirs[:-1] and row.finish_reason == "stop_token"
    # Through the CLI, on the HF directory itself and on a converted glasslm checkpoint.
    converted = tmp_path / "converted"
    subprocess.run([sys.executable, "-m", "glasslm.cli", "convert", "--from-hf", str(directory), "--out",
                    str(converted)], check=True, capture_output=True)
    assert (converted / "generation_config.json").is_file() and (converted / "chat_template.jinja").is_file()
    expected = "hello there" + hf_tok.decode(_hf_greedy(hf_model, tokenizer.encode("hello there"))[:-1])
    for source in (directory, converted):
        out = _cli_generate(source, "hello there")
        assert out == expected + "\n"
    longer = _cli_generate(converted, "hello there", "--ignore-eos")
    assert longer.startswith(expected) and len(longer) > len(expected) + 1


def _cli_generate(source, prompt, *extra):
    result = subprocess.run([sys.executable, "-m", "glasslm.cli", "generate", "--checkpoint", str(source), "--prompt",
                             prompt, "--temperature", "0", "--max-new-tokens", "16", *extra],
                            check=True, capture_output=True, text=True)
    return result.stdout
