"""The explorer's numbers (glasslm.interp.explore) against direct computations and glasslm's hooks."""

import pytest
import torch
import torch.nn.functional as F

from glasslm.interp import explore
from glasslm.presets import get_preset
from glasslm.evaluation.perplexity import evaluate_tokens
from glasslm.interp.hooks import logit_lens as hooks_logit_lens
from glasslm.interp.hooks import run_with_cache
from glasslm.core.model import TransformerLM
from glasslm.tokenizers import CharTokenizer

TEXT = "the cat sat on the mat"


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="module")
def setup():
    tok = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz .")
    torch.manual_seed(0)
    model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=tok.vocab_size, n_layers=2, d_model=32,
                                     n_heads=4, context_length=32)).eval()
    return model, tok, tok.encode(TEXT)


def test_next_token_probabilities_match_the_models_softmax(setup):
    model, tok, ids = setup
    table = explore.next_token(model, tok, ids, temperature=1.0, k=5)
    probs = torch.softmax(model(torch.tensor([ids]))[0, -1], dim=-1)
    expected = probs.topk(5)
    assert [row["id"] for row in table["top"]] == expected.indices.tolist()
    torch.testing.assert_close(torch.tensor([row["prob"] for row in table["top"]]), expected.values, rtol=1e-5, atol=1e-6)
    # No controls and temperature 1: the adjusted distribution is the model's own.
    torch.testing.assert_close(torch.tensor([row["adjusted"] for row in table["top"]]), expected.values, rtol=1e-5, atol=1e-6)
    assert table["kept"] == tok.vocab_size


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.5, 3, None), (2.0, None, 0.3), (1.0, 4, 0.5)])
def test_adjusted_probabilities_follow_temperature_top_k_top_p(setup, temperature, top_k, top_p):
    model, tok, ids = setup
    table = explore.next_token(model, tok, ids, temperature=temperature, top_k=top_k, top_p=top_p, k=tok.vocab_size)
    # Reference written out here: scale, keep the top k, then the smallest set with mass >= top_p.
    logits = model(torch.tensor([ids]))[0, -1] / temperature
    order = logits.argsort(descending=True)
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep[order[:top_k or len(order)]] = True
    probs = torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=-1)
    if top_p is not None:
        mass, kept = 0.0, torch.zeros_like(keep)
        for i in probs.argsort(descending=True):
            kept[i] = True
            mass += float(probs[i])
            if mass >= top_p:
                break
        probs = torch.softmax(logits.masked_fill(~kept, float("-inf")), dim=-1)
    got = torch.zeros_like(probs)
    for row in table["top"]:
        got[row["id"]] = row["adjusted"]
    torch.testing.assert_close(got, probs, rtol=1e-5, atol=1e-6)
    assert table["kept"] == int((probs > 0).sum())


def test_greedy_puts_all_mass_on_the_argmax(setup):
    model, tok, ids = setup
    table = explore.next_token(model, tok, ids, temperature=0.0, k=3)
    assert [row["adjusted"] for row in table["top"]] == [1.0, 0.0, 0.0]
    assert table["top"][0]["id"] == int(model(torch.tensor([ids]))[0, -1].argmax())


def test_token_loss_is_cross_entropy_of_each_next_token(setup):
    model, tok, ids = setup
    result = explore.token_loss(model, tok, ids)
    tokens = torch.tensor(ids)
    expected = F.cross_entropy(model(tokens[None])[0, :-1], tokens[1:], reduction="none")
    assert result["loss"][0] is None and result["texts"] == list(TEXT)
    torch.testing.assert_close(torch.tensor(result["loss"][1:]), expected, rtol=1e-5, atol=1e-5)
    assert result["mean_loss"] == pytest.approx(float(expected.mean()), rel=1e-5)


def test_token_loss_of_a_text_longer_than_the_context(setup):
    model, tok, _ = setup
    ids = tok.encode("the cat sat on the mat. " * 4)  # 96 tokens, context 32
    result = explore.token_loss(model, tok, ids)
    assert len(result["loss"]) == len(ids) and result["loss"][0] is None
    # Scored in windows: the total equals evaluate's sliding-window likelihood with the same stride.
    reference = evaluate_tokens(model, ids, stride=16)
    assert sum(result["loss"][1:]) == pytest.approx(reference["nll"], rel=1e-5)
    # Tokens inside the first window match one plain forward pass.
    first = F.cross_entropy(model(torch.tensor([ids[:32]]))[0, :-1], torch.tensor(ids[1:32]), reduction="none")
    torch.testing.assert_close(torch.tensor(result["loss"][1:32]), first, rtol=1e-5, atol=1e-5)


def test_attention_matches_the_cached_hook_pattern(setup):
    model, tok, ids = setup
    _, cache = run_with_cache(model, torch.tensor([ids]), names_filter=["blocks.1.attn.hook_pattern"])
    pattern = cache["blocks.1.attn.hook_pattern"][0]
    one = explore.attention(model, tok, ids, layer=1, head=2)
    every = explore.attention(model, tok, ids, layer=1)
    torch.testing.assert_close(torch.tensor(one["patterns"][0]), pattern[2])
    torch.testing.assert_close(torch.tensor(every["patterns"]), pattern)
    assert every["n_heads"] == 4 and len(every["patterns"]) == 4
    rows = torch.tensor(one["patterns"][0])
    torch.testing.assert_close(rows.sum(-1), torch.ones(len(ids)))
    assert float(rows.triu(diagonal=1).abs().max()) == 0.0  # causal: no query sees a later key


def test_attention_rejects_missing_layer_or_head(setup):
    model, tok, ids = setup
    with pytest.raises(ValueError, match="layer 5 does not exist"):
        explore.attention(model, tok, ids, layer=5)
    with pytest.raises(ValueError, match="head 4 does not exist"):
        explore.attention(model, tok, ids, layer=0, head=4)


def test_logit_lens_top_tokens_match_hooks_logit_lens(setup):
    model, tok, ids = setup
    result = explore.logit_lens(model, tok, ids)
    log_probs = hooks_logit_lens(model, torch.tensor([ids]))[:, 0]  # (layers, seq, vocab)
    top = log_probs.max(dim=-1)
    assert [[cell["id"] for cell in row] for row in result["layers"]] == top.indices.tolist()
    torch.testing.assert_close(torch.tensor([[cell["prob"] for cell in row] for row in result["layers"]]),
                               top.values.exp())
    # The last layer read through the lens is the model's own prediction.
    assert [cell["id"] for cell in result["layers"][-1]] == model(torch.tensor([ids]))[0].argmax(-1).tolist()


def test_too_long_or_empty_input_is_refused(setup):
    model, tok, _ = setup
    with pytest.raises(ValueError, match="more than the context length 32"):
        explore.logit_lens(model, tok, [0] * 33)
    with pytest.raises(ValueError, match="no tokens"):
        explore.logit_lens(model, tok, [])
