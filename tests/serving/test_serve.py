"""glasslm serve over real HTTP on 127.0.0.1: the OpenAI client, batching, limits, errors, shutdown."""

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from glasslm.interp import explore  # noqa: E402
from glasslm.io.checkpoint import save_checkpoint  # noqa: E402
from glasslm.presets import get_preset# noqa: E402
from glasslm.generation import GenerationConfig, generate  # noqa: E402
from glasslm.core.model import TransformerLM  # noqa: E402
from glasslm.serving.config import ServeConfig  # noqa: E402
from glasslm.serving.app import create_app  # noqa: E402
from glasslm.serving.server import serving_in_thread  # noqa: E402
from glasslm.tokenizers import CharTokenizer  # noqa: E402

CHARS = "\n !',.:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
CONTEXT = 32


def tiny_model() -> tuple[TransformerLM, CharTokenizer]:
    tok = CharTokenizer(list(CHARS))
    torch.manual_seed(0)
    config = get_preset("shakespeare-char-cpu", vocab_size=tok.vocab_size, n_layers=2, d_model=32, n_heads=4,
                        context_length=CONTEXT)
    return TransformerLM(config).eval(), tok


@pytest.fixture(scope="module")
def served():
    model, tok = tiny_model()
    app = create_app(model, tok, ServeConfig(name="tiny", max_batch=8, max_queue=16, max_tokens_limit=5000))
    with serving_in_thread(app) as url:
        yield url, model, tok, app.state.engine


def call(url: str, path: str, body=None, data: bytes | None = None, method: str | None = None):
    """(status, parsed JSON) of one request; HTTP errors are returned, not raised."""
    if body is not None:
        data = json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method or ("POST" if data is not None else "GET"),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def stream(url: str, body: dict):
    """Open a streaming completion; returns (connection, iterator of parsed SSE payloads)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    assert response.getheader("content-type").startswith("text/event-stream")

    def events():
        for line in response:
            line = line.decode().strip()
            if line == "data: [DONE]":
                return
            if line.startswith("data: "):
                yield json.loads(line[6:])
    return conn, events()


def reference(model, tok, prompt: str, **controls):
    """What the library itself generates for this prompt alone."""
    config = GenerationConfig(**controls)
    return generate(model, [tok.encode(prompt)], config, tokenizer=tok)[0]


def test_openai_client_completes_and_streams_like_the_library(served):
    openai = pytest.importorskip("openai")
    url, model, tok, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    expected = reference(model, tok, "ROMEO:", max_new_tokens=12, temperature=0.0)
    done = client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=12, temperature=0)
    assert done.choices[0].text == expected.text
    assert done.choices[0].finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (6, 12)
    pieces = [c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="ROMEO:", max_tokens=12, temperature=0, stream=True) if c.choices]
    assert len(pieces) > 1 and "".join(pieces) == expected.text  # streamed in pieces, same text


def test_concurrent_requests_are_batched_and_each_matches_decoding_alone(served):
    url, model, tok, engine = served
    # Different prompt lengths and lengths beyond the context (the window slides) in one batch.
    jobs = [("To be", 40), ("ROMEO: Wherefore art thou", 12), ("a", 25), ("Now is the winter", 50),
            ("O", 5), ("First Citizen:\nBefore we", 30)]

    def run(job):
        prompt, n = job
        return call(url, "/v1/completions", {"prompt": prompt, "max_tokens": n, "temperature": 0,
                                             "return_token_ids": True})

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    for (prompt, n), (status, body) in zip(jobs, results):
        assert status == 200, body
        expected = reference(model, tok, prompt, max_new_tokens=n, temperature=0.0)
        assert body["choices"][0]["token_ids"] == expected.tokens, prompt
    assert engine.stats["largest_batch"] >= 2  # they really were decoded together


def test_seeded_sampling_is_reproducible_and_matches_the_library(served):
    url, model, tok, _ = served
    body = {"prompt": "KING:", "max_tokens": 20, "temperature": 0.9, "top_k": 20, "top_p": 0.9, "seed": 7,
            "return_token_ids": True}
    with ThreadPoolExecutor(3) as pool:  # the same request three times at once: rows of one batch
        results = list(pool.map(lambda _: call(url, "/v1/completions", body), range(3)))
    ids = [r[1]["choices"][0]["token_ids"] for r in results]
    expected = reference(model, tok, "KING:", max_new_tokens=20, temperature=0.9, top_k=20, top_p=0.9, seed=7)
    assert ids == [expected.tokens] * 3


def test_stop_strings_end_the_text_before_them(served):
    url, model, tok, _ = served
    expected = reference(model, tok, "Ay", max_new_tokens=200, temperature=0.0)
    stop = expected.text[5:7]  # a string the greedy continuation is known to contain
    status, body = call(url, "/v1/completions", {"prompt": "Ay", "max_tokens": 200, "temperature": 0, "stop": [stop]})
    assert status == 200
    assert body["choices"][0]["text"] == expected.text[:expected.text.find(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"
    conn, events = stream(url, {"prompt": "Ay", "max_tokens": 200, "temperature": 0, "stop": stop})
    chunks = list(events)
    conn.close()
    assert "".join(c["choices"][0]["text"] for c in chunks) == body["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_logprobs_are_the_models_log_softmax(served):
    url, model, tok, _ = served
    status, body = call(url, "/v1/completions", {"prompt": "Hark", "max_tokens": 6, "temperature": 0, "logprobs": 3,
                                                 "return_token_ids": True})
    assert status == 200
    choice = choice = body["choices"][0]
    ids = tok.encode("Hark") + choice["token_ids"]
    with torch.no_grad():
        log_probs = torch.log_softmax(model(torch.tensor([ids]))[0], dim=-1)[3:-1]  # predicting each new token
    expected = log_probs.gather(-1, torch.tensor(choice["token_ids"])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(choice["logprobs"]["token_logprobs"]), expected, rtol=1e-4, atol=1e-4)
    for top, row, token in zip(choice["logprobs"]["top_logprobs"], log_probs, choice["token_ids"]):
        assert len(top) == 3 and tok.decode([token]) in top  # greedy: the chosen token is the top one
        assert max(top.values()) == pytest.approx(float(row.max()), abs=1e-4)
    assert choice["logprobs"]["tokens"] == [tok.decode([t]) for t in choice["token_ids"]]


@pytest.mark.parametrize("body,data,status,words", [
    ({"prompt": "hi", "max_token": 5}, None, 400, "max_token: unknown field"),
    ({"prompt": "hi", "max_tokens": -1}, None, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10_000}, None, 400, "limit 5000"),
    ({"prompt": "x" * (CONTEXT + 1)}, None, 400, f"at most {CONTEXT}"),
    ({"prompt": "hi \u00e9"}, None, 400, "not in this tokenizer's vocabulary"),
    ({"prompt": [0, 999]}, None, 400, "token id 999"),
    ({"prompt": "hi", "temperature": -0.5}, None, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, None, 400, "top_p"),
    ({"prompt": "hi", "n": 0}, None, 400, "n:"),
    ({"prompt": "hi", "n": 2, "best_of": 3}, None, 400, "best_of: only best_of equal to n"),
    ({"prompt": "hi", "frequency_penalty": 0.5}, None, 400, "frequency_penalty: not supported"),
    ({"prompt": "hi", "logit_bias": {"3": 500.0}}, None, 400, "logit_bias: values are in [-100, 100]"),
    ({"prompt": ["hi", [0, 999]]}, None, 400, "prompt"),
    ({"prompt": ["hi", "x" * (CONTEXT + 1)]}, None, 400, "prompt[1]"),
    ({"prompt": [[1, 2], [0, 999]]}, None, 400, "prompt[1]: token id 999"),
    ({"prompt": "hi", "stop": [""]}, None, 400, "stop"),
    ({"prompt": "hi", "model": "gpt-9"}, None, 404, "'gpt-9' not found"),
    (None, b'{"prompt": "\xff\xfe"}', 400, "UTF-8"),
    (None, b"{not json", 400, "not valid JSON"),
    (None, b"[]", 400, ""),
])
def test_bad_requests_get_a_4xx_with_a_message(served, body, data, status, words):
    url = served[0]
    got, reply = call(url, "/v1/completions", body, data=data)
    assert got == status, reply
    assert words in reply["error"]["message"] and "Traceback" not in reply["error"]["message"]


def test_health_and_models(served):
    url = served[0]
    status, health = call(url, "/health")
    assert status == 200 and health["status"] == "ok" and health["model"] == "tiny"
    status, models = call(url, "/v1/models")
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == CONTEXT


def test_client_disconnect_cancels_its_generation(served):
    url, _, _, engine = served
    cancelled = engine.stats["cancelled"]
    conn, events = stream(url, {"prompt": "Hear", "max_tokens": 5000})
    next(events), next(events)  # generation is running
    conn.sock.shutdown(2)
    conn.close()
    deadline = time.monotonic() + 20
    while engine.stats["cancelled"] == cancelled or engine.active:
        assert time.monotonic() < deadline, "the job went on after its client left"
        time.sleep(0.05)
    assert engine.stats["cancelled"] == cancelled + 1


def test_explorer_endpoints_return_the_explore_numbers(served):
    url, model, tok, _ = served
    text = "To be or not"
    ids = tok.encode(text)
    status, got = call(url, "/api/attention", {"text": text, "layer": 1, "head": 3})
    assert status == 200 and got == json.loads(json.dumps(explore.attention(model, tok, ids, 1, 3)))
    assert call(url, "/api/logit-lens", {"text": text})[1] == json.loads(json.dumps(explore.logit_lens(model, tok, ids)))
    assert call(url, "/api/experts", {"text": text})[1] == json.loads(json.dumps(explore.expert_choices(model, tok, ids)))
    assert call(url, "/api/token-loss", {"tokens": ids})[1] == json.loads(json.dumps(explore.token_loss(model, tok, ids)))
    got = call(url, "/api/next-token", {"text": text, "temperature": 0.7, "top_k": 5, "k": 8})[1]
    assert got == json.loads(json.dumps(explore.next_token(model, tok, ids, 0.7, 5, None, None, 8)))
    assert call(url, "/api/tokenize", {"text": text})[1]["tokens"] == ids
    for path, body, words in [("/api/attention", {"text": text, "layer": 7}, "layer 7 does not exist"),
                              ("/api/attention", {"text": text, "layer": 0, "head": 9}, "head 9 does not exist"),
                              ("/api/logit-lens", {"text": ""}, "empty"),
                              ("/api/experts", {"text": "a" * (CONTEXT + 1)}, f"at most {CONTEXT}"),
                              ("/api/logit-lens", {"text": "a" * (CONTEXT + 1)}, f"at most {CONTEXT}"),
                              ("/api/token-loss", {"text": "a" * (16 * CONTEXT + 1)}, f"at most {16 * CONTEXT}"),
                              ("/api/token-loss", {"text": text, "tokens": ids}, "exactly one"),
                              ("/api/next-token", {"text": text, "colour": 1}, "unknown field")]:
        status, reply = call(url, path, body)
        assert status == 400 and words in reply["error"]["message"], (path, reply)


def test_attribution_head_score_and_patching_endpoints_return_the_explore_numbers(served):
    url, model, tok, _ = served
    text, corrupted = "To be or not", "To be or ton"
    ids, bad_ids = tok.encode(text), tok.encode(corrupted)
    as_json = lambda value: json.loads(json.dumps(value))  # noqa: E731
    status, got = call(url, "/api/logit-attribution", {"text": text})
    assert status == 200 and got == as_json(explore.logit_attribution(model, tok, ids))
    e = tok.encode("e")[0]
    assert call(url, "/api/logit-attribution", {"tokens": ids, "token": "e", "k": 3})[1] == as_json(
        explore.logit_attribution(model, tok, ids, e, 3))
    assert call(url, "/api/logit-attribution", {"text": text, "token": e})[1]["token"]["id"] == e
    assert call(url, "/api/head-scores", {"text": text, "seed": 3})[1] == as_json(explore.head_scores(model, tok, ids, 3))
    body = {"text": text, "corrupted_text": corrupted, "answer": "e", "wrong_answer": tok.encode("t")[0]}
    status, got = call(url, "/api/patching", body | {"hook": "mlp_out"})
    assert status == 200 and got == as_json(explore.activation_patching(model, tok, ids, bad_ids, e, tok.encode("t")[0],
                                                                         "mlp_out"))
    assert call(url, "/api/patching", body | {"text": None, "tokens": ids})[1]["hook"] == "resid_pre"
    for path, extra, field, words in [
            ("/api/logit-attribution", {"token": "ee"}, "token", "'ee' is 2 tokens"),
            ("/api/logit-attribution", {"token": len(CHARS)}, "token", f"token id {len(CHARS)} is outside"),
            ("/api/logit-attribution", {"token": ""}, "token", "empty"),
            ("/api/logit-attribution", {"token": "0"}, "token", "token"),  # a character the tokenizer lacks
            ("/api/head-scores", {"seed": -1}, "seed", "greater than or equal to 0"),
            ("/api/patching", {"corrupted_text": "To be or no"}, "corrupted_text", "11 tokens and the clean one 12"),
            ("/api/patching", {"corrupted_text": text}, "corrupted_text", "is the clean one"),
            ("/api/patching", {"corrupted_text": None, "corrupted_tokens": [0] * 11 + [999]}, "corrupted_tokens",
             "token id 999 is outside"),
            ("/api/patching", {"corrupted_text": "a" * (CONTEXT + 1)}, "corrupted_text", f"at most {CONTEXT}"),
            ("/api/patching", {"corrupted_text": None}, "corrupted_text", "exactly one"),
            ("/api/patching", {"wrong_answer": "e"}, "wrong_answer", "the answer's token"),
            ("/api/patching", {"answer": "be"}, "answer", "'be' is 2 tokens"),
            ("/api/patching", {"hook": "resid_post"}, "hook", "resid_pre"),
            ("/api/patching", {"text": "a" * (CONTEXT + 1)}, "text", f"at most {CONTEXT}")]:
        base = {"text": text} if path != "/api/patching" else body
        status, reply = call(url, path, base | extra)
        assert status == 400 and words in reply["error"]["message"] and reply["error"]["param"] == field, (extra, reply)


def test_patching_an_attention_only_model_refuses_mlp_out_by_name():
    tok = CharTokenizer(list(CHARS))
    model = TransformerLM(get_preset("induction-attn-only", vocab_size=tok.vocab_size)).eval()
    with serving_in_thread(create_app(model, tok, ServeConfig(name="attn-only"))) as url:
        body = {"text": "ab ab", "corrupted_text": "ab cb", "answer": "a", "wrong_answer": "c"}
        status, reply = call(url, "/api/patching", body | {"hook": "mlp_out"})
        assert status == 400 and reply["error"]["param"] == "hook" and "attention-only" in reply["error"]["message"]
        status, got = call(url, "/api/patching", body | {"hook": "attn_out"})
        ids, bad = tok.encode("ab ab"), tok.encode("ab cb")
        expected = explore.activation_patching(model, tok, ids, bad, tok.encode("a")[0], tok.encode("c")[0], "attn_out")
        assert status == 200 and got == json.loads(json.dumps(expected))
        labels = [c["label"] for c in call(url, "/api/logit-attribution", {"text": "ab ab"})[1]["components"]]
        assert labels == ["embed", "bias"]  # rotary positions, no MLPs: the heads and these are all


def test_a_full_queue_answers_429_at_once():
    model, tok = tiny_model()
    app = create_app(model, tok, ServeConfig(name="tiny", max_batch=1, max_queue=1, max_tokens_limit=100_000))
    with serving_in_thread(app) as url:
        running, events = stream(url, {"prompt": "A", "max_tokens": 100_000})
        next(events)  # the only batch row is taken
        waiting = http.client.HTTPConnection(*url.removeprefix("http://").split(":"), timeout=60)
        waiting.request("POST", "/v1/completions", json.dumps({"prompt": "B", "max_tokens": 100_000}),
                        {"Content-Type": "application/json"})
        deadline = time.monotonic() + 10
        while app.state.engine.queued() == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        start = time.monotonic()
        status, reply = call(url, "/v1/completions", {"prompt": "C", "max_tokens": 5})
        assert status == 429 and "busy" in reply["error"]["message"]
        assert time.monotonic() - start < 5
        running.close()
        waiting.close()  # a client waiting for a whole (non-streamed) completion leaves too
        while app.state.engine.stats["cancelled"] < 2 or app.state.engine.active:
            assert time.monotonic() < deadline + 10, "a job went on after its client left"
            time.sleep(0.02)


@pytest.mark.slow
def test_cli_prints_its_url_and_drains_on_sigterm(tmp_path):
    model, tok = tiny_model()
    checkpoint = save_checkpoint(tmp_path / "run" / "ckpt-000002", model, tok)  # a run's: the page plots the run
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "train_loss": 3.5}\n{"step": 2, "train_loss": 3.25}\n')
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "glasslm.cli", "serve", "--checkpoint", str(checkpoint), "--port", "0",
         "--grace", "1", "--max-tokens-limit", "1000000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:\d+", line)
        assert match, line + proc.stderr.read()
        url = match.group(0)
        assert call(url, "/api/run") == (200, {"run": "run", "signals": [], "records": [{"step": 1, "train_loss": 3.5},
                                                                                  {"step": 2, "train_loss": 3.25}]})
        conn, events = stream(url, {"prompt": "A", "max_tokens": 1_000_000})
        next(events)
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        chunks = list(events)  # the stream ends properly ([DONE]) once the grace period is over
        assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
        # uvicorn ends by re-raising the signal it handled, so the status says "terminated" (128 + 15).
        assert proc.wait(timeout=30) in (0, 128 + signal.SIGTERM, -signal.SIGTERM)
        assert time.monotonic() - start < 20
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stderr.read()
    assert "POST /v1/completions" in log and "finish=abort" in log and "Traceback" not in log
    assert "Application shutdown complete" in log
