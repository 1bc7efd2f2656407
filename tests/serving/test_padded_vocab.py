"""A model with more embedding rows than tokenizer entries, served (issue 36's reproduction): a Qwen3 saved
by transformers with 50,304 rows beside GPT-2's tokenizer plus two special tokens (50,259 entries), whose
padding rows carry almost all of its probability (tests/padded_models.py), imported through glasslm.

Padding ids are never chosen, greedy or sampled (transformers' own `suppress_tokens` is the greedy
reference), and a generated token's log-probability and its likeliest alternatives are those of the
distribution sampling draws from, the tokenizer's tokens (issue 47: padding alternatives all read "",
so 20 of them collapsed into one `{"": ...}` entry); in a prompt they read as "", as transformers
decodes them. Every request the issue saw fail is answered; a stream that fails on the way
still ends with an error event and `[DONE]`."""

import http.client
import json

import pytest
import torch

pytest.importorskip("fastapi")

from glasslm.generation import generate  # noqa: E402
from glasslm.hf import load_model  # noqa: E402
from glasslm.serving.app import create_app  # noqa: E402
from glasslm.serving.config import ServeConfig  # noqa: E402
from glasslm.serving.server import serving_in_thread  # noqa: E402

from test_serve import call  # noqa: E402

TOKENS = 50259  # GPT-2's 50,257 and two added special tokens; the model has 50,304 rows
PROMPT = "Hello world"


@pytest.fixture(scope="module")
def served(padded_qwen3):
    directory, hf_model, hf_tok = padded_qwen3
    model, tokenizer = load_model(directory)
    app = create_app(model, tokenizer, ServeConfig(name="padded", max_batch=32, max_queue=64))
    with serving_in_thread(app) as url:
        yield url, model, tokenizer, hf_model, hf_tok


def _hf_log_softmax(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)  # (seq, rows)


def _hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy decoding with the padding rows suppressed: what glasslm must pick."""
    out = hf_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                            suppress_tokens=list(range(TOKENS, hf_model.config.vocab_size)))
    return out[0, len(ids):].tolist()


def test_the_padding_rows_hold_nearly_all_of_the_models_probability(served):
    _, model, tokenizer, hf_model, hf_tok = served
    assert (model.config.vocab_size, tokenizer.vocab_size, len(hf_tok)) == (50304, TOKENS, TOKENS)
    last = _hf_log_softmax(hf_model, hf_tok.encode(PROMPT))[-1].exp()
    assert int(last.argmax()) >= TOKENS and float(last[TOKENS:].sum()) > 0.99  # unmasked, padding is drawn


def _hf_token_log_softmax(hf_model, ids: list[int]) -> torch.Tensor:
    """log p over the tokenizer's tokens alone: the distribution glasslm samples from (padding rows masked)."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, :, :TOKENS].float(), dim=-1)  # (seq, tokens)


def test_greedy_with_20_logprobs_chooses_tokens_and_lists_20_token_alternatives(served):
    url, _, _, hf_model, hf_tok = served
    status, body = call(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 20,
                                                 "return_token_ids": True})
    assert status == 200, body
    choice, prompt = body["choices"][0], hf_tok.encode(PROMPT)
    assert choice["token_ids"] == _hf_greedy(hf_model, prompt, 6)
    assert choice["text"] == hf_tok.decode(choice["token_ids"])
    rows = _hf_token_log_softmax(hf_model, prompt + choice["token_ids"])[len(prompt) - 1:-1]  # (6, tokens)
    expected = rows.gather(1, torch.tensor(choice["token_ids"])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(choice["logprobs"]["token_logprobs"]), expected, rtol=0, atol=1e-4)
    for top, row in zip(choice["logprobs"]["top_logprobs"], rows):
        best = row.topk(20)
        assert "" not in top  # no padding row among the alternatives
        expected_top = {}
        for i, v in zip(best.indices.tolist(), best.values.tolist()):
            expected_top.setdefault(hf_tok.decode([i]), v)  # two ids of one text: the likelier one's
        assert top == pytest.approx(expected_top, abs=1e-4) and len(top) >= 15


def test_20_choices_at_temperature_1_5_never_draw_padding_and_match_the_library(served):
    url, model, tokenizer, _, hf_tok = served
    status, body = call(url, "/v1/completions", {"prompt": PROMPT, "n": 20, "temperature": 1.5, "max_tokens": 8,
                                                 "seed": 2, "logprobs": 5, "return_token_ids": True})
    assert status == 200, body
    drawn = [c["token_ids"] for c in body["choices"]]
    assert all(0 <= t < TOKENS for ids in drawn for t in ids) and len({tuple(ids) for ids in drawn}) > 1
    assert [c["text"] for c in body["choices"]] == [hf_tok.decode(ids) for ids in drawn]
    prompt = tokenizer.encode(PROMPT)
    for i in (0, 7, 19):  # choice i is seed 2 + i, as the library draws it (which masks the padding too)
        alone = generate(model, [prompt], max_new_tokens=8, temperature=1.5, seed=2 + i, tokenizer=tokenizer)[0]
        assert drawn[i][:len(alone.tokens)] == alone.tokens


def _stream(url: str, path: str, body: dict) -> list[str]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    lines = [line.decode().strip() for line in response if line.strip()]  # to the end of the stream
    conn.close()
    return lines


def test_a_streamed_request_with_logprobs_and_sampling_streams_to_done(served):
    url, _, _, _, hf_tok = served
    lines = _stream(url, "/v1/completions", {"prompt": PROMPT, "n": 3, "temperature": 1.5, "max_tokens": 10,
                                             "logprobs": 20, "echo": True, "return_token_ids": True})
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert not [c for c in chunks if "error" in c]
    for index in range(3):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        ids = [t for c in mine for t in c.get("token_ids", [])]
        assert len(ids) == 10 and all(t < TOKENS for t in ids) and mine[-1]["finish_reason"] == "length"
        assert "".join(c["text"] for c in mine) == PROMPT + hf_tok.decode(ids)


def test_padding_ids_in_a_prompt_read_as_empty_text_as_transformers_decodes_them(served):
    url, _, _, hf_model, hf_tok = served
    ids = hf_tok.encode("Hello") + [50300] + hf_tok.encode(" world")
    status, body = call(url, "/v1/completions", {"prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 0})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["text"] == hf_tok.decode(ids) == "Hello world"
    assert choice["logprobs"]["tokens"] == [hf_tok.decode([t]) for t in ids] == ["Hello", "", " world"]
    scores = _hf_log_softmax(hf_model, ids)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(choice["logprobs"]["token_logprobs"][1:]), scores, rtol=0, atol=1e-4)
    assert call(url, "/detokenize", {"tokens": ids}) == (200, {"prompt": "Hello world"})


def test_chat_and_its_stream_never_choose_padding(served, padded_qwen3):
    url, _, _, hf_model, hf_tok = served
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0, "logprobs": True,
            "top_logprobs": 20}
    status, reply = call(url, "/v1/chat/completions", body)
    assert status == 400 and "chat template" in reply["error"]["message"]  # this model has none: it says so
    app = create_app(*load_model(padded_qwen3[0]), ServeConfig(name="padded"),
                     chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with serving_in_thread(app) as chat_url:
        status, reply = call(chat_url, "/v1/chat/completions", body)
        assert status == 200, reply
        content = reply["choices"][0]["logprobs"]["content"]
        assert [c["token"] for c in content] == [hf_tok.decode([t]) for t in _hf_greedy(hf_model, hf_tok.encode("hi"), 5)]
        assert all(len(c["top_logprobs"]) == 20 and all(t["bytes"] for t in c["top_logprobs"]) for c in content)
        lines = _stream(chat_url, "/v1/chat/completions", {**body, "temperature": 1.5, "n": 4})
        assert lines[-1] == "data: [DONE]" and not [line for line in lines if '"error"' in line]


def test_a_stream_that_fails_on_the_way_ends_with_an_error_event_and_done(served, padded_qwen3, monkeypatch):
    from glasslm.serving import schemas
    from glasslm.serving.routes import chat

    url = served[0]
    shown = schemas.Completion.delta
    calls = []

    def failing(self, event):
        calls.append(event)
        if len(calls) == 3:
            raise ValueError("token id 50300 is outside the vocabulary (size 50259)")  # as the stream died
        return shown(self, event)

    monkeypatch.setattr(schemas.Completion, "delta", failing)
    lines = _stream(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 1})
    assert len(lines) == 4 and lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == 500 and "ValueError: token id 50300" in error["message"]
    monkeypatch.setattr(chat._Chat, "chunk", lambda *args, **kwargs: 1 / 0)
    app = create_app(*load_model(padded_qwen3[0]), ServeConfig(name="padded"), chat_template="{{ 'x' }}")
    with serving_in_thread(app) as chat_url:
        lines = _stream(chat_url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert len(lines) == 2 and "ZeroDivisionError" in lines[0] and lines[1] == "data: [DONE]"
