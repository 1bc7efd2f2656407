"""The explorer's numbers (glasslm.interp.explore) against direct computations and glasslm's hooks."""

import pytest
import torch
import torch.nn.functional as F

from glasslm.interp import explore
from glasslm.presets import get_preset
from glasslm.evaluation.perplexity import evaluate_tokens
from glasslm.interp.hooks import logit_lens as hooks_logit_lens
from glasslm.interp.attribution import head_logit_attribution, induction_score, repeated_random_tokens
from glasslm.interp.hooks import run_with_cache
from glasslm.interp.patching import patch_attn_out, patch_residual_stream
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


def perturbed(preset: str, **extra) -> TransformerLM:
    """A random model whose norm gains and biases are not 1 and 0, so weight processing has work to do."""
    torch.manual_seed(0)
    model = TransformerLM(get_preset(preset, vocab_size=28, n_layers=2, d_model=32, n_heads=4, context_length=32,
                                     **extra)).eval()
    for p in model.parameters():
        p.add_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.05))
    return model


ATTRIBUTION_MODELS = {"gpt2": ("gpt2-small", {}), "llama": ("llama-tiny", {"n_kv_heads": 2}),
                      "attention-only": ("induction-attn-only", {}),
                      "tied, unembed bias": ("shakespeare-char-cpu", {"tie_embeddings": True, "unembed_bias": True})}


@pytest.mark.parametrize("shape", ATTRIBUTION_MODELS)
def test_logit_attribution_adds_up_to_the_logit_minus_its_mean(setup, shape):
    preset, extra = ATTRIBUTION_MODELS[shape]
    model, tok, ids = perturbed(preset, **extra), setup[1], setup[2]
    before = {name: p.clone() for name, p in model.state_dict().items()}
    logits = model(torch.tensor([ids]))[0, -1]
    for token in (None, 7):
        result = explore.logit_attribution(model, tok, ids, token=token)
        chosen = int(logits.argmax()) if token is None else token
        assert result["token"]["id"] == chosen and result["token"]["rank"] == int((logits > logits[chosen]).sum())
        total = (sum(map(sum, result["heads"])) + sum(c["value"] for c in result["components"])
                 + result["unembed_bias"])
        # The model's own logit, centred over the vocabulary (softmax ignores the mean): an independent reference.
        assert total == pytest.approx(float(logits[chosen] - logits.mean()), abs=2e-5)
        assert result["logit_minus_mean"] == pytest.approx(float(logits[chosen] - logits.mean()), abs=2e-5)
        assert result["token"]["prob"] == pytest.approx(float(torch.softmax(logits, -1)[chosen]), rel=1e-5)
    labels = [c["label"] for c in result["components"]]
    assert labels[-1] == "bias" and "embed" in labels and len(result["heads"]) == 2 and len(result["heads"][0]) == 4
    assert ("0_mlp_out" in labels) == (shape != "attention-only")
    assert all(torch.equal(p, before[name]) for name, p in model.state_dict().items())  # the served model is untouched


def test_logit_attribution_heads_are_head_logit_attribution_on_processed_weights(setup):
    model, tok, ids = perturbed("gpt2-small"), setup[1], setup[2]
    result = explore.logit_attribution(model, tok, ids, token=4)
    direct = head_logit_attribution(explore.processed_copy(model), torch.tensor([ids]), token=4)[:, -1]
    torch.testing.assert_close(torch.tensor(result["heads"]), direct.view(2, 4))
    assert [row["id"] for row in result["top"]] == model(torch.tensor([ids]))[0, -1].topk(10).indices.tolist()
    with pytest.raises(ValueError, match="token id 28 is outside"):
        explore.logit_attribution(model, tok, ids, token=28)


def hand_scores(pattern: torch.Tensor, ids: list[int]) -> dict[str, torch.Tensor]:
    """The three head scores written out as loops over one sequence's (layers, heads, query, key) patterns."""
    targets = {"previous_token": lambda q: [q - 1] if q else [],
               "duplicate_token": lambda q: [k for k in range(q) if ids[k] == ids[q]],
               "induction": lambda q: [k for k in range(1, q) if ids[k - 1] == ids[q]]}
    scores = {}
    for name, keys in targets.items():
        rows = [pattern[..., q, keys(q)].sum(-1) for q in range(len(ids)) if keys(q)]
        scores[name] = torch.stack(rows).mean(0) if rows else None
    return scores


def test_head_scores_are_the_attention_to_each_heads_target(setup):
    model, tok, ids = setup
    result = explore.head_scores(model, tok, ids)
    names = [f"blocks.{i}.attn.hook_pattern" for i in range(2)]
    _, cache = run_with_cache(model, torch.tensor([ids]), names_filter=names)
    pattern = torch.stack([cache[name][0] for name in names])  # (layers, heads, query, key)
    for name, expected in hand_scores(pattern, ids).items():
        torch.testing.assert_close(torch.tensor(result["prompt"][name]["scores"]), expected)
    assert result["prompt"]["previous_token"]["queries"] == len(ids) - 1
    repeated = result["repeated_random"]
    assert (repeated["half"], repeated["batch"]) == (16, 10)  # min(50, context // 2) tokens, repeated
    tokens = repeated_random_tokens(tok.vocab_size, 16, 10, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(torch.tensor(repeated["induction"]["scores"]), induction_score(model, tokens))
    assert repeated["induction"]["queries"] >= 10 * 16  # every second-half position has one (first halves may too)
    # No token repeats: duplicate-token and induction scores have no query to average, so they are None.
    unique = explore.head_scores(model, tok, tok.encode("abc"))["prompt"]
    assert unique["induction"] == {"scores": None, "queries": 0} and unique["duplicate_token"]["scores"] is None


@pytest.mark.parametrize("hook,patch", [("resid_pre", patch_residual_stream), ("attn_out", patch_attn_out)])
def test_activation_patching_is_the_interp_grid_normalised_clean_1_corrupted_0(setup, hook, patch):
    model, tok, _ = setup
    clean, corrupted = tok.encode("the cat sat on a mat"), tok.encode("the bat sat on a mat")  # one token differs
    answer, wrong = tok.encode("s")[0], tok.encode("t")[0]
    result = explore.activation_patching(model, tok, clean, corrupted, answer, wrong, hook)

    def metric(logits):
        return logits[0, -1, answer] - logits[0, -1, wrong]

    clean_value, corrupted_value = (float(metric(model(torch.tensor([ids])))) for ids in (clean, corrupted))
    assert (result["clean_logit_diff"], result["corrupted_logit_diff"]) == pytest.approx((clean_value, corrupted_value))
    grid = patch(model, torch.tensor([clean]), torch.tensor([corrupted]), metric)
    torch.testing.assert_close(torch.tensor(result["logit_diff"]), grid)
    normalised = torch.tensor(result["patched"])
    torch.testing.assert_close(normalised, (grid - corrupted_value) / (clean_value - corrupted_value))
    if hook == "resid_pre":  # layer 0's input is the embeddings: the changed token's position restores it all
        expected = torch.zeros(len(clean))
        expected[4] = 1.0
        torch.testing.assert_close(normalised[0], expected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="must be as long"):
        explore.activation_patching(model, tok, clean, corrupted[:-1], answer, wrong)


def test_served_logit_attribution_on_gemma3_names_transformers_top_token_and_adds_up(tmp_path):
    """An imported Gemma 3 ((1 + w) norms, sandwich post-norms, q/k norms, scaled embeddings), served:
    /api/logit-attribution processes a copy as TransformerLens does and must not change its predictions."""
    pytest.importorskip("fastapi")
    pytest.importorskip("transformers")
    from glasslm.hf import import_hf
    from glasslm.serving.app import create_app
    from glasslm.serving.config import ServeConfig
    from glasslm.serving.server import serving_in_thread
    from tests.hf.test_hf_families import VOCAB, random_model
    from tests.hf.test_hf_new_families import FAMILIES
    from tests.serving.test_serve import call

    hf_model = random_model(FAMILIES["gemma3-shape"]())  # norm weights 1 + noise: each norm scales by ~2
    hf_model.save_pretrained(tmp_path / "gemma3")
    model = import_hf(tmp_path / "gemma3")
    tok = CharTokenizer([chr(ord("!") + i) for i in range(VOCAB - 3)] + [" ", "\n", "\t"])
    ids = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(4)).tolist()
    expected = hf_model(torch.tensor([ids])).logits[0, -1]
    with serving_in_thread(create_app(model, tok, ServeConfig(name="gemma3"))) as url:
        status, got = call(url, "/api/logit-attribution", {"tokens": ids})
    assert status == 200 and got["token"]["id"] == int(expected.argmax())
    assert [row["id"] for row in got["top"]] == expected.topk(10).indices.tolist()
    total = sum(map(sum, got["heads"])) + sum(c["value"] for c in got["components"]) + got["unembed_bias"]
    top = int(expected.argmax())
    assert total == pytest.approx(float(expected[top] - expected.mean()), abs=1e-4)
    assert got["logit_minus_mean"] == pytest.approx(float(expected[top] - expected.mean()), abs=1e-4)


def test_page_defaults_are_the_usual_texts_where_they_encode_else_made_from_the_vocabulary():
    from glasslm.interp.induction import TOKEN_CHARS

    usual = CharTokenizer.from_text("".join(explore.STANDARD_TEXTS.values()))
    assert explore.page_defaults(usual, 64) == {"texts": explore.STANDARD_TEXTS, "from_vocabulary": False}
    study = CharTokenizer(list(TOKEN_CHARS))  # the induction study's 64 characters: no ':', ',' or space
    with pytest.raises(ValueError, match="':' is not in"):
        study.encode(explore.STANDARD_TEXTS["prompt"])
    made = explore.page_defaults(study, 48)
    texts, ids = made["texts"], {name: study.encode(text) for name, text in made["texts"].items()}
    assert made["from_vocabulary"] and all(ids.values())
    clean, corrupted = ids["inspect_text"], ids["corrupted_text"]
    assert len(clean) == len(corrupted) <= 48 and sum(a != b for a, b in zip(clean, corrupted)) == 1
    # An induction head's answer: the token that followed the last token's earlier copy ...
    answer = clean[clean.index(clean[-1]) + 1]
    assert ids["answer"] == [answer] and ids["wrong_answer"] != ids["answer"]
    # ... which the corrupted text no longer has: the token before that copy is the wrong answer instead.
    assert corrupted[corrupted.index(ids["wrong_answer"][0]) + 1] == answer and clean[-1] not in corrupted[:-8]
    assert len(ids["prompt"]) < 48 and texts["loss_text"] == texts["loss_text"][:8] * 3


def test_expert_choices_are_each_tokens_top_k_of_its_routers_softmax():
    """Against the router applied by hand to each MoE layer's input: softmax, top-k, renormalised or not."""
    tok = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz .")
    torch.manual_seed(0)
    for renormalize in (True, False):
        model = TransformerLM(get_preset("shakespeare-char-cpu-moe", vocab_size=tok.vocab_size, n_layers=2,
                                         context_length=32, router_renormalize=renormalize)).eval()
        for p in model.parameters():
            p.normal_(0, 0.3)
        ids = tok.encode(TEXT)
        inputs = {}
        handles = [block.mlp.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args[0][0]))
                   for i, block in enumerate(model.blocks)]
        result = explore.expert_choices(model, tok, ids)
        for handle in handles:
            handle.remove()
        assert [row["layer"] for row in result["layers"]] == [0, 1] and result["n_experts"] == 4
        for row in result["layers"]:
            probs = torch.softmax(inputs[row["layer"]] @ model.blocks[row["layer"]].mlp.router.weight.T, dim=-1)
            top = probs.topk(2, dim=-1)
            weights = top.values / top.values.sum(-1, keepdim=True) if renormalize else top.values
            assert row["experts"] == top.indices.tolist()
            torch.testing.assert_close(torch.tensor(row["weights"]), weights)
            assert len({tuple(e) for e in row["experts"]}) > 1  # the tokens do not all go the same way
    dense = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=tok.vocab_size, n_layers=2)).eval()
    assert explore.expert_choices(dense, tok, tok.encode(TEXT))["layers"] == []
