"""GET /metrics: the server's counters, gauges and histograms in Prometheus' text format (0.0.4).

`ServerMetrics` listens to the engine (`Engine.listeners`: each sequence that ends, however it ends)
and counts HTTP answers (a small ASGI middleware); `render()` writes every family, reading the
engine's live numbers (queue, running rows, tokens per second, KV-cache use) at scrape time.

Example:
    >>> hist = Histogram("glasslm_ttft_seconds", "Time to first token.", (0.1, 1.0))
    >>> hist.observe(0.05); hist.observe(0.5)
    >>> print("\\n".join(hist.lines()))
    # HELP glasslm_ttft_seconds Time to first token.
    # TYPE glasslm_ttft_seconds histogram
    glasslm_ttft_seconds_bucket{le="0.1"} 1
    glasslm_ttft_seconds_bucket{le="1"} 2
    glasslm_ttft_seconds_bucket{le="+Inf"} 2
    glasslm_ttft_seconds_sum 0.55
    glasslm_ttft_seconds_count 2
"""

from __future__ import annotations

import collections
import threading
from typing import Any

from glasslm.generation.engine import Engine, Job

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


def _number(value: float) -> str:
    return repr(float(value)).removesuffix(".0") if float(value).is_integer() else repr(float(value))


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    escaped = (f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
               for k, v in sorted(labels.items()))
    return "{" + ",".join(escaped) + "}"


class Histogram:
    """Cumulative buckets, sum and count, as Prometheus histograms are (thread-safe)."""

    def __init__(self, name: str, help: str, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum, self.count, self._lock = 0.0, 0, threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[next((i for i, le in enumerate(self.buckets) if value <= le), len(self.buckets))] += 1
            self.sum += value
            self.count += 1

    def lines(self) -> list[str]:
        with self._lock:
            counts, total, count = list(self.counts), self.sum, self.count
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for le, n in zip([*map(_number, self.buckets), "+Inf"], counts):
            running += n
            out.append(f'{self.name}_bucket{{le="{le}"}} {running}')
        return out + [f"{self.name}_sum {_number(round(total, 9))}", f"{self.name}_count {count}"]


def family(name: str, kind: str, help: str, samples: list[tuple[dict[str, str], float]]) -> list[str]:
    """One counter or gauge family: its HELP, TYPE and a line per labelled sample."""
    return [f"# HELP {name} {help}", f"# TYPE {name} {kind}",
            *(f"{name}{_labels(labels)} {_number(value)}" for labels, value in samples)]


class ServerMetrics:
    """Everything /metrics reports about one app: fed by the engine's listener and the HTTP middleware."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.ttft = Histogram("glasslm_time_to_first_token_seconds", "From a sequence's arrival to its first token.")
        self.latency = Histogram("glasslm_request_latency_seconds", "From a sequence's arrival to its end.")
        self.gap = Histogram("glasslm_time_per_output_token_seconds",
                             "Mean time between a sequence's tokens after the first.", TOKEN_GAP_BUCKETS)
        self.finished: collections.Counter[str] = collections.Counter()  # finish reason -> sequences
        self.http: collections.Counter[tuple[str, str]] = collections.Counter()  # (path, status) -> answers
        self._lock = threading.Lock()
        engine.listeners.append(self.sequence_ended)

    def sequence_ended(self, job: Job) -> None:
        """Engine listener (worker thread): one sequence is done."""
        with self._lock:
            self.finished[job.finish_reason or "unknown"] += 1
        if job.first_token_time is not None:
            self.ttft.observe(max(0.0, job.first_token_time - job.created))
            if len(job.generated) > 1 and job.ended is not None:
                self.gap.observe(max(0.0, job.ended - job.first_token_time) / (len(job.generated) - 1))
        if job.ended is not None:
            self.latency.observe(max(0.0, job.ended - job.created))

    def answered(self, path: str, status: int) -> None:
        with self._lock:
            self.http[(path, str(status))] += 1

    def render(self) -> str:
        engine, stats = self.engine, self.engine.stats
        with self._lock:
            finished, http = dict(self.finished), dict(self.http)
        kv = engine.kv_usage()
        lines = [
            *family("glasslm_http_requests_total", "counter", "HTTP answers by path and status.",
                    [({"path": p, "status": s}, n) for (p, s), n in sorted(http.items())]),
            *family("glasslm_sequences_submitted_total", "counter", "Sequences queued (a request's n choices count n).",
                    [({}, stats["submitted"])]),
            *family("glasslm_sequences_finished_total", "counter", "Sequences ended, by finish reason.",
                    [({"reason": r}, n) for r, n in sorted(finished.items())]),
            *family("glasslm_requests_rejected_total", "counter", "Requests answered 429 (the queue was full).",
                    [({}, stats["rejected"])]),
            *family("glasslm_queue_depth", "gauge", "Sequences waiting for a batch row.", [({}, engine.queued())]),
            *family("glasslm_running_sequences", "gauge", "Sequences being decoded.", [({}, len(engine.active))]),
            *family("glasslm_max_batch", "gauge", "Rows decoded together at most.", [({}, engine.max_batch)]),
            *family("glasslm_prompt_tokens_total", "counter", "Prompt tokens prefilled.", [({}, stats["prompt_tokens"])]),
            *family("glasslm_generation_tokens_total", "counter", "Tokens generated.", [({}, stats["tokens"])]),
            *family("glasslm_generation_tokens_per_second", "gauge", "Tokens generated per second, last 10 s.",
                    [({}, round(engine.tokens_per_second(), 3))]),
            *family("glasslm_decode_steps_total", "counter", "Batched decode steps.", [({}, stats["steps"])]),
            *family("glasslm_kv_cache_bytes", "gauge", "Bytes of key/value cache held by the running batch.",
                    [({}, kv["bytes"])]),
            *family("glasslm_kv_cache_tokens", "gauge", "Tokens whose keys and values the running batch holds.",
                    [({}, kv["tokens"])]),
            *family("glasslm_kv_cache_usage_ratio", "gauge", "Held tokens / allocated cache slots of the running batch.",
                    [({}, round(kv["usage"], 6))]),
            *self.ttft.lines(), *self.latency.lines(), *self.gap.lines(),
        ]
        for name, what in (engine.prefix_cache_stats() or {}).items():
            lines += family(f"glasslm_prefix_cache_{name}", what[0], what[1], [({}, what[2])])
        return "\n".join(lines) + "\n"


class CountAnswers:
    """ASGI middleware: counts every HTTP answer by its route's path and status (`ServerMetrics.answered`)."""

    def __init__(self, app: Any, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                route = scope.get("route")
                self.metrics.answered(getattr(route, "path", None) or "other", message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)
