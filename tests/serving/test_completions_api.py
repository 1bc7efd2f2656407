"""/v1/completions as lm-evaluation-harness and OpenAI's legacy API use it: echo with per-token prompt
log-probabilities, max_tokens 0, batched prompts (strings, ids), n > 1, usage; /tokenize and /detokenize.
Every number is checked against the model's own log-softmax or against one-prompt requests."""

import json

import pytest
import torch

pytest.importorskip("fastapi")

from glasslm.serving.app import create_app  # noqa: E402
from glasslm.serving.config import ServeConfig  # noqa: E402
from glasslm.serving.server import serving_in_thread  # noqa: E402

from test_serve import CONTEXT, call, stream, tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def served():
    model, tok = tiny_model()
    app = create_app(model, tok, ServeConfig(name="tiny", max_batch=8, max_queue=16))
    with serving_in_thread(app) as url:
        yield url, model, tok, app.state.engine


def _log_softmax(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]))[0].float(), dim=-1)  # (seq, vocab)


def test_echo_scores_every_prompt_token_like_the_models_log_softmax(served):
    url, model, tok, _ = served
    prompt = "To be, or not"
    status, body = call(url, "/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 3, "max_tokens": 0})
    assert status == 200, body
    choice, ids = body["choices"][0], tok.encode(prompt)
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["tokens"] == [tok.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = _log_softmax(model, ids)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:]), expected, rtol=0, atol=1e-4)
    rows = _log_softmax(model, ids)[:-1]
    for top, row in zip(lp["top_logprobs"][1:], rows):
        best = row.topk(3)
        assert list(top) == [tok.decode([t]) for t in best.indices.tolist()]
        torch.testing.assert_close(torch.tensor(list(top.values())), best.values, rtol=0, atol=1e-4)
    assert lp["text_offset"] == [len(prompt[:i]) for i in range(len(prompt))]  # one character per token
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}


def test_echo_then_generated_tokens_carry_logprobs_and_offsets_after_the_prompt(served):
    url, model, tok, _ = served
    status, body = call(url, "/v1/completions", {"prompt": "Hark", "echo": True, "logprobs": 1, "max_tokens": 5,
                                                 "temperature": 0, "return_token_ids": True})
    assert status == 200, body
    choice = body["choices"][0]
    new = choice["token_ids"]
    ids = tok.encode("Hark") + new
    assert choice["text"] == "Hark" + tok.decode(new)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["text_offset"] == list(range(len(ids)))
    expected = _log_softmax(model, ids)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:]), expected, rtol=0, atol=1e-4)
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}


def test_echo_without_logprobs_and_max_tokens_0_returns_the_prompt(served):
    url, _, tok, _ = served
    status, body = call(url, "/v1/completions", {"prompt": [tok.encode("Hi"), tok.encode("Yo!")], "echo": True,
                                                 "max_tokens": 0})
    assert status == 200, body
    assert [c["text"] for c in body["choices"]] == ["Hi", "Yo!"] and body["choices"][0]["logprobs"] is None


def test_a_list_of_prompts_is_decoded_in_one_batch_each_as_alone(served):
    url, _, tok, engine = served
    prompts = ["ROMEO:", "O", "What light through yonder"]
    alone = [call(url, "/v1/completions", {"prompt": p, "max_tokens": 6, "temperature": 0, "echo": True,
                                           "logprobs": 2})[1]["choices"][0] for p in prompts]
    steps = engine.stats["steps"]
    for prompt in (prompts, [tok.encode(p) for p in prompts]):  # strings, then lists of ids
        status, body = call(url, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                     "echo": True, "logprobs": 2})
        assert status == 200, body
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        for got, want in zip(body["choices"], alone):
            assert got["text"] == want["text"] and got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
            assert got["logprobs"]["top_logprobs"][0] is None
            torch.testing.assert_close(torch.tensor(got["logprobs"]["token_logprobs"][1:]),
                                       torch.tensor(want["logprobs"]["token_logprobs"][1:]), rtol=0, atol=1e-4)
        n_prompt = sum(len(tok.encode(p)) for p in prompts)
        assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 18, "total_tokens": n_prompt + 18}
    assert engine.stats["steps"] - steps == 2 * 6  # all three rows in each of the 6 steps of each request


def test_scoring_more_logits_than_the_limit_prefills_in_groups_with_the_same_numbers(served):
    url, model, tok, engine = served
    prompts = ["To be, or not", "O", "What light", "Hark"]
    body = {"prompt": prompts, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2}
    whole = call(url, "/v1/completions", body)[1]
    steps = engine.stats["steps"]
    engine.scoring_logits_limit = 14 * model.config.vocab_size  # 14 prompt tokens' logits at once
    try:
        grouped = call(url, "/v1/completions", body)[1]
    finally:
        engine.scoring_logits_limit = 2**28
    assert engine.stats["steps"] - steps == 3  # groups prefill apart, then decode as one batch
    for a, b in zip(grouped["choices"], whole["choices"]):
        assert a["text"] == b["text"] and a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
        torch.testing.assert_close(torch.tensor(a["logprobs"]["token_logprobs"][1:]),
                                   torch.tensor(b["logprobs"]["token_logprobs"][1:]), rtol=0, atol=1e-4)


def test_n_choices_are_seeded_seed_plus_index_and_usage_counts_the_prompt_once(served):
    url, _, tok, _ = served
    body = {"prompt": ["ROMEO:", "JULIET:"], "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 3}
    status, reply = call(url, "/v1/completions", body)
    assert status == 200, reply
    texts = [c["text"] for c in reply["choices"]]
    assert [c["index"] for c in reply["choices"]] == list(range(6))
    for k, prompt in enumerate(body["prompt"]):
        for i in range(3):
            alone = call(url, "/v1/completions", {**body, "prompt": prompt, "n": 1, "seed": 7 + i})[1]
            assert texts[k * 3 + i] == alone["choices"][0]["text"]
    assert len(set(texts[:3])) > 1  # different seeds, different samples
    prompt_tokens = len(tok.encode("ROMEO:")) + len(tok.encode("JULIET:"))
    assert reply["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 48,
                              "total_tokens": prompt_tokens + 48}


def test_streaming_echo_and_n_gives_the_same_choices_as_one_response(served):
    url = served[0]
    body = {"prompt": "Hark", "max_tokens": 5, "temperature": 0.8, "seed": 3, "n": 2, "echo": True, "logprobs": 1,
            "stream_options": {"include_usage": True}}
    whole = call(url, "/v1/completions", body)[1]
    conn, events = stream(url, body)
    chunks = list(events)
    conn.close()
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert [t for c in mine if c["logprobs"] for t in c["logprobs"]["tokens"]] == choice["logprobs"]["tokens"]
        assert mine[-1]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == whole["usage"]


def test_the_openai_client_scores_with_echo_and_max_tokens_0(served):
    openai = pytest.importorskip("openai")
    url, model, tok, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    reply = client.completions.create(model="tiny", prompt=["Good night", "Parting"], echo=True, logprobs=2,
                                      max_tokens=0)
    for choice, prompt in zip(reply.choices, ["Good night", "Parting"]):
        ids = tok.encode(prompt)
        expected = _log_softmax(model, ids)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        assert choice.text == prompt and choice.logprobs.token_logprobs[0] is None
        torch.testing.assert_close(torch.tensor(choice.logprobs.token_logprobs[1:]), expected, rtol=0, atol=1e-4)
        assert all(len(top) == 2 for top in choice.logprobs.top_logprobs[1:])
    assert reply.usage.completion_tokens == 0


def test_tokenize_and_detokenize_round_trip(served):
    url, _, tok, _ = served
    status, body = call(url, "/tokenize", {"prompt": "To be"})
    assert status == 200, body
    assert body == {"tokens": tok.encode("To be"), "count": 5, "max_model_len": CONTEXT}
    status, body = call(url, "/detokenize", {"tokens": tok.encode("To be")})
    assert (status, body) == (200, {"prompt": "To be"})


@pytest.mark.parametrize("path,body,words", [
    ("/detokenize", {"tokens": [1, 10_000]}, "tokens: token id 10000 is outside"),
    ("/detokenize", {"tokens": [-1]}, "tokens: token id -1"),
    ("/tokenize", {"prompt": "caf\u00e9"}, "prompt:"),
    ("/tokenize", {"prompt": "x", "text": "x"}, "text: unknown field"),
    ("/tokenize", {}, "prompt: Field required"),
    ("/tokenize", {"prompt": "x", "model": "gpt-9"}, "'gpt-9' not found"),
    ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 9}, "n: 3 prompts x n=9 is 27 completions"),
])
def test_bad_input_is_refused_naming_the_field(served, path, body, words):
    status, reply = call(served[0], path, body)
    assert status in (400, 404) and words in reply["error"]["message"], reply
    assert json.dumps(reply).count("Traceback") == 0
