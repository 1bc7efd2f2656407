"""A padded embedding table (more rows than the tokenizer has tokens): no way glasslm picks a token ever
picks a padding row, and picking keeps exactly the distribution of the real tokens. Tiny temperatures
neither overflow nor break sampling. Checked against closed forms (softmax of the real rows),
transformers' own `suppress_tokens`, and `glasslm generate` on an imported padded Qwen3."""

from __future__ import annotations

import pytest
import torch

from glasslm.cli import main
from glasslm.core.model import TransformerLM
from glasslm.generation import (
    SMALLEST_TEMPERATURE, GenerationConfig, TextStreamer, generate, generate_text, generate_tokens, sample_next,
    speculative_tokens, stream_text, vocab_limit, with_vocab_limit,
)
from glasslm.presets import get_preset
from glasslm.tokenizers import CharTokenizer

TOKENS, ROWS = 5, 12  # a tokenizer of 5 ids beside an embedding table of 12 rows


def padded_model(seed: int = 0) -> tuple[TransformerLM, CharTokenizer]:
    """A tiny model whose 7 padding rows outweigh its 5 tokens by far (random, then scaled up)."""
    tokenizer = CharTokenizer(list("abcd\n"))
    torch.manual_seed(seed)
    model = TransformerLM(get_preset("llama-tiny", vocab_size=ROWS, n_layers=1, context_length=32)).eval()
    with torch.no_grad():
        model.unembed.weight[TOKENS:] *= 50.0
    return model, tokenizer


def test_the_limit_is_the_tokenizers_size_only_where_the_table_is_padded():
    model, tokenizer = padded_model()
    assert vocab_limit(model, tokenizer) == TOKENS and vocab_limit(model, None) is None
    assert vocab_limit(model, CharTokenizer(list("abcdefghijklmn"))) is None  # 14 ids: nothing to mask
    config = with_vocab_limit(GenerationConfig(), model, tokenizer)
    assert config.vocab_limit == TOKENS and with_vocab_limit(config, model, None) is config
    with pytest.raises(ValueError, match="vocab_limit"):
        GenerationConfig(vocab_limit=0)


def test_sampling_with_a_limit_draws_the_softmax_of_the_real_rows_only():
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.7, 9.0, 8.0]])  # the last two are padding, and the likeliest
    expected = torch.softmax(logits[0, :4] / 0.9, dim=-1).double()
    n = 40_000
    draws = sample_next(logits.expand(n, -1), temperature=0.9, vocab_limit=4, generator=torch.Generator().manual_seed(0))
    frequencies = torch.bincount(draws, minlength=6).double() / n
    assert frequencies[4:].sum() == 0
    tolerance = 5 * (expected * (1 - expected) / n).sqrt()  # five standard errors of a mean of n draws
    assert ((frequencies[:4] - expected).abs() <= tolerance).all(), (frequencies, expected)
    assert sample_next(logits, temperature=0.0, vocab_limit=4).tolist() == [0]
    assert sample_next(logits, temperature=0.0).tolist() == [4]  # unlimited, the padding would win


@pytest.mark.parametrize("temperature", [1e-3, 1e-30, 1e-38, SMALLEST_TEMPERATURE, 1e-40, 1e-45, 5e-324])
def test_tiny_temperatures_sample_the_argmax_without_inf_or_nan(temperature):
    logits = torch.tensor([[3.0, 40.0, 39.5, -2.0], [1e30, 0.0, -1e30, 5.0]])
    draws = sample_next(logits.repeat(200, 1), temperature=temperature, generator=torch.Generator().manual_seed(1))
    # At 1e-3 the runner-up (0.5 lower) has probability e^-500: the same draw as greedy, in closed form.
    assert draws.view(200, 2).tolist() == [[1, 0]] * 200


def test_sampling_at_an_ordinary_temperature_is_unchanged_by_the_shift():
    logits = torch.tensor([[1.0, 0.5, -0.3]])
    expected = torch.softmax(logits[0] / 0.05, dim=-1).double()  # huge scaled logits: the shift keeps them finite
    n = 40_000
    draws = sample_next(logits.expand(n, -1), temperature=0.05, generator=torch.Generator().manual_seed(2))
    frequencies = torch.bincount(draws, minlength=3).double() / n
    assert ((frequencies - expected).abs() <= 5 * (expected * (1 - expected) / n).sqrt() + 1e-9).all()


def test_every_way_of_generating_skips_the_padding_rows():
    model, tokenizer = padded_model()
    prompt = tokenizer.encode("ab")
    with torch.no_grad():
        assert int(model(torch.tensor([prompt]))[0, -1].argmax()) >= TOKENS  # unmasked, greedy picks padding
    for temperature in (0.0, 1.5):
        out = generate(model, [prompt, tokenizer.encode("c")], max_new_tokens=12, temperature=temperature, seed=3,
                       tokenizer=tokenizer)
        assert all(t < TOKENS for g in out for t in g.tokens) and all(len(g.tokens) == 12 for g in out)
        text = generate_text(model, tokenizer, "ab", max_new_tokens=12, temperature=temperature, seed=3)
        assert text == "".join(stream_text(model, tokenizer, "ab", max_new_tokens=12, temperature=temperature, seed=3))
        alone = generate(model, [prompt], max_new_tokens=12, temperature=temperature, seed=3, tokenizer=tokenizer)
        assert text == alone[0].text
    limited = GenerationConfig(max_new_tokens=12, temperature=0.0, vocab_limit=TOKENS)
    greedy = list(generate_tokens(model, prompt, config=limited))
    assert greedy == generate(model, [prompt], limited.replace(vocab_limit=None), tokenizer=tokenizer)[0].tokens
    draft = TransformerLM(get_preset("llama-tiny", vocab_size=ROWS, n_layers=1, context_length=64)).eval()
    assert list(speculative_tokens(model, draft, prompt, 12, vocab_limit=TOKENS)) == greedy


def test_a_stop_string_stays_in_the_text_when_asked():
    tokenizer = CharTokenizer(list("abc."))
    streamer = TextStreamer(tokenizer, ["c.", "c"], include_stop=True)
    assert "".join(streamer.push(t) for t in tokenizer.encode("abcab")) == "abc" and streamer.stopped
    streamer = TextStreamer(tokenizer, ["b.a"], include_stop=True)
    assert "".join(streamer.push(t) for t in tokenizer.encode("ab.ac")) + streamer.finish() == "ab.a"


def test_glasslm_generate_on_the_imported_padded_qwen3(padded_qwen3, capsys):
    directory, hf_model, hf_tok = padded_qwen3
    args = ["generate", "--checkpoint", str(directory), "--prompt", "Hello", "--max-new-tokens", "30",
            "--ignore-eos", "--threads", "1"]
    assert main([*args, "--temperature", "1.5", "--seed", "2"]) == 0  # stopped mid-text before
    out, err = capsys.readouterr()
    assert out.startswith("Hello") and "[30 tokens in" in err
    assert main([*args, "--temperature", "0", "--draft", str(directory), "--lookahead", "3"]) == 0
    greedy = hf_model.generate(torch.tensor([hf_tok.encode("Hello")]), max_new_tokens=30, min_new_tokens=30,
                               do_sample=False, suppress_tokens=list(range(len(hf_tok), hf_model.config.vocab_size)))
    assert capsys.readouterr().out == hf_tok.decode(greedy[0]) + "\n"  # transformers' greedy with padding suppressed
