"""Running the server as an operator does: /metrics read by Prometheus' own parser (prometheus_client), the
numbers it reports against what the clients received, 429 with Retry-After from a full queue, and a
client that leaves freeing its place at once (its queued job is never prefilled, its running row goes)."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")
parser = pytest.importorskip("prometheus_client.parser")

from glasslm.serving.app import create_app  # noqa: E402
from glasslm.serving.config import ServeConfig  # noqa: E402
from glasslm.serving.server import serving_in_thread  # noqa: E402

from test_serve import stream, tiny_model  # noqa: E402


def post(url: str, path: str, body: dict) -> tuple[int, dict, dict]:
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def scrape(url: str) -> dict[str, dict]:
    """{family: {(sample name, labels): value}} as Prometheus' parser reads /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    return {f.name: {(s.name, tuple(sorted(s.labels.items()))): s.value for s in f.samples}
            for f in parser.text_string_to_metric_families(text)}


def wait_until(condition, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_metrics_count_what_the_clients_received():
    model, tok = tiny_model()
    app = create_app(model, tok, ServeConfig(name="tiny", max_batch=4, max_queue=4))
    engine = app.state.engine
    with serving_in_thread(app) as url:
        before = scrape(url)
        assert before["glasslm_queue_depth"][("glasslm_queue_depth", ())] == 0
        answers = [post(url, "/v1/completions", {"prompt": p, "max_tokens": n, "temperature": 0})[2]
                   for p, n in (("To be", 7), ("Hear", 3), ("O", 11))]
        answers.append(post(url, "/v1/completions", {"prompt": "A", "max_tokens": 5, "n": 2, "seed": 1})[2])
        status, _, _ = post(url, "/v1/completions", {"prompt": "A", "max_tokens": -1})
        assert status == 400
        wait_until(lambda: not engine.active)
        after = scrape(url)
    generated = sum(a["usage"]["completion_tokens"] for a in answers)
    prompts = sum(len(tok.encode(p)) for p in ("To be", "Hear", "O", "A", "A"))  # n=2: the prompt is prefilled twice
    assert after["glasslm_generation_tokens"][("glasslm_generation_tokens_total", ())] == generated
    assert after["glasslm_prompt_tokens"][("glasslm_prompt_tokens_total", ())] == prompts
    assert after["glasslm_sequences_submitted"][("glasslm_sequences_submitted_total", ())] == 5
    assert after["glasslm_sequences_finished"][("glasslm_sequences_finished_total", (("reason", "length"),))] == 5
    http_answers = after["glasslm_http_requests"]
    assert http_answers[("glasslm_http_requests_total", (("path", "/v1/completions"), ("status", "200")))] == 4
    assert http_answers[("glasslm_http_requests_total", (("path", "/v1/completions"), ("status", "400")))] == 1
    assert http_answers[("glasslm_http_requests_total", (("path", "/metrics"), ("status", "200")))] == 1
    for name in ("glasslm_time_to_first_token_seconds", "glasslm_request_latency_seconds"):
        samples = after[name]
        assert samples[(f"{name}_count", ())] == 5 and samples[(f"{name}_bucket", (("le", "+Inf"),))] == 5
        buckets = [v for (sample, labels), v in samples.items() if sample.endswith("_bucket")]
        assert buckets == sorted(buckets)  # cumulative
    gaps = after["glasslm_time_per_output_token_seconds"]
    assert gaps[("glasslm_time_per_output_token_seconds_count", ())] == 5  # every sequence made > 1 token
    assert after["glasslm_running_sequences"][("glasslm_running_sequences", ())] == 0
    assert after["glasslm_kv_cache_bytes"][("glasslm_kv_cache_bytes", ())] == 0  # nothing running, nothing held


def test_a_full_queue_answers_429_with_retry_after_and_a_leaving_client_frees_its_place():
    model, tok = tiny_model()
    app = create_app(model, tok, ServeConfig(name="tiny", max_batch=1, max_queue=1, max_tokens_limit=100_000))
    engine = app.state.engine
    with serving_in_thread(app) as url:
        running, events = stream(url, {"prompt": "A", "max_tokens": 100_000})
        next(events)  # the only batch row is taken
        held = scrape(url)
        assert held["glasslm_running_sequences"][("glasslm_running_sequences", ())] == 1
        assert held["glasslm_kv_cache_bytes"][("glasslm_kv_cache_bytes", ())] > 0
        waiting = http.client.HTTPConnection(*url.removeprefix("http://").split(":"), timeout=60)
        waiting.request("POST", "/v1/completions", json.dumps({"prompt": "BBBBBBBB", "max_tokens": 5}),
                        {"Content-Type": "application/json"})
        wait_until(lambda: engine.queued() == 1)
        status, headers, reply = post(url, "/v1/completions", {"prompt": "C", "max_tokens": 5})
        assert status == 429 and reply["error"]["type"] == "overloaded"
        assert 1 <= int(headers["retry-after"]) <= 60
        assert scrape(url)["glasslm_queue_depth"][("glasslm_queue_depth", ())] == 1
        prefilled = engine.stats["prompt_tokens"]
        waiting.sock.shutdown(2)  # the queued (non-streamed) client leaves
        waiting.close()
        wait_until(lambda: any(job.cancelled.is_set() for job in list(engine._pending)))
        running.sock.shutdown(2)  # then the running one
        running.close()
        wait_until(lambda: not engine.active and not engine.queued())
        assert engine.stats["prompt_tokens"] == prefilled  # the queued job's 8 prompt tokens never ran
        assert engine.stats["cancelled"] == 2
        status, _, reply = post(url, "/v1/completions", {"prompt": "C", "max_tokens": 5})
        assert status == 200 and reply["usage"]["completion_tokens"] == 5  # both places are free again
        finished = scrape(url)["glasslm_sequences_finished"]
        assert finished[("glasslm_sequences_finished_total", (("reason", "cancelled"),))] == 2
        assert scrape(url)["glasslm_requests_rejected"][("glasslm_requests_rejected_total", ())] == 1
