"""Continuous batching: one worker thread decodes every active request together, rows joining and leaving.

Callers never run the model themselves. They submit `Job`s to an `Engine`, whose worker thread
decodes every active job together as one left-padded batch (a `DecodeWindow`: per-row positions,
a mask hiding each row's padding). Between two decode steps the worker admits waiting jobs (their
prompts are prefilled as a small batch of their own, then their rows join the running window) and
drops finished or cancelled ones, so a job never waits for a whole batch to finish. Each row
decodes as it would alone: same tokens as `generate` for greedy and seeded sampling.

The queue is bounded: past `max_queue` waiting jobs `submit` raises `Overloaded` at once (a server
answers HTTP 429). `begin_shutdown(grace)` refuses new jobs and lets running ones finish for up to
`grace` seconds, then ends them with finish_reason "abort". A job's events (one per token, then one
with `finish_reason`) arrive on the asyncio loop it was created for, in `job.events`.

Example:
    >>> import asyncio
    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.tokenizers import CharTokenizer
    >>> tok = CharTokenizer.from_text("abc\\n")
    >>> model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=4, n_layers=1)).eval()
    >>> async def complete(engine: Engine) -> list:
    ...     job = Job(tok.encode("ab"), Sampling(max_tokens=3, temperature=0.0), tok, asyncio.get_running_loop())
    ...     engine.submit(job)
    ...     events = [await job.events.get()]
    ...     while "finish_reason" not in events[-1]:
    ...         events.append(await job.events.get())
    ...     return events
    >>> engine = Engine(model, tok, max_batch=4, max_queue=4)
    >>> engine.start()
    >>> events = asyncio.run(complete(engine))
    >>> engine.stop()
    >>> len([e for e in events if "token" in e]), events[-1]["finish_reason"]
    (3, 'length')
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from glasslm.core.model import TransformerLM
from glasslm.generation.constrained import GrammarError
from glasslm.generation.decoding import DecodeWindow
from glasslm.generation.prefix import Prefill, PrefixCache
from glasslm.generation.sampling import apply_repetition_penalty, sample_next, vocab_limit
from glasslm.generation.streaming import TextStreamer
from glasslm.runtime import release_openmp_threads

log = logging.getLogger("glasslm.generation.engine")

CHUNK = 256  # prompt tokens prefilled per step while other rows decode (all at once when none do)
ROOM = 256  # cache slots a new window keeps free past its longest row; it doubles when they run out


class Overloaded(Exception):
    """The queue is full: the client should retry later (HTTP 429)."""


class ShuttingDown(Exception):
    """The engine is draining after `begin_shutdown` and takes no new work (HTTP 503)."""


@dataclass
class Sampling:
    """One job's controls, already checked (a server checks them in its request schema)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # how many alternatives per token, as OpenAI's `logprobs`
    prompt_logprobs: int | None = None  # score the prompt too (alternatives per token); None: don't
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and output (as `generate`'s)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (id, value) pairs added to the logits before choosing
    min_tokens: int = 0  # the job's stop tokens cannot be chosen before this many tokens
    include_stop: bool = False  # a stop string that ends the text stays in it
    # a compiled grammar (`constrained.Grammar`) the text must follow: each choice gets its own matcher
    grammar: Any = None


@dataclass
class Job:
    """One completion being generated. The worker thread fills it; the caller's task reads `events`."""

    prompt: list[int]
    sampling: Sampling
    tokenizer: Any
    loop: asyncio.AbstractEventLoop
    stop_tokens: frozenset[int] = frozenset()
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex[:24]}")
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    created: float = field(default_factory=time.time)
    index: int = 0  # which choice of its request this job is; its events carry it (several jobs may share `events`)

    def __post_init__(self) -> None:
        self.held = list(self.prompt)  # the tokens this row's cache window holds (plus the newest)
        self.generated: list[int] = []
        self.streamer = TextStreamer(self.tokenizer, self.sampling.stop, self.sampling.include_stop)
        seed = self.sampling.seed
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.finish_reason: str | None = None
        self.first_token_time: float | None = None
        self.ended: float | None = None  # when the engine was done with it (time.time())
        self.matcher = None if self.sampling.grammar is None else self.sampling.grammar.matcher()

    outbox: list | None = None  # set by the engine: events wait there until the step ends

    def emit(self, event: dict[str, Any]) -> None:
        """Hand an event to the caller's event loop (thread-safe; a closed loop means nobody listens)."""
        event["index"] = self.index
        if self.outbox is not None:
            self.outbox.append((self, event))
            return
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def finish(self, reason: str, text: str = "") -> None:
        self.finish_reason = reason
        self.emit({"finish_reason": reason, "text": text})


class Engine:
    """The batching loop: one worker thread, a bounded queue, and the model lock.

    Hold `model_lock` to use the model from another thread (the worker holds it during each step).
    """

    def __init__(self, model: TransformerLM, tokenizer: Any, max_batch: int = 32, max_queue: int = 64,
                 prefix_cache_bytes: int = 0):
        if max_batch < 1 or max_queue < 0:
            raise ValueError("max_batch must be >= 1 and max_queue >= 0")
        self.model, self.tokenizer = model, tokenizer
        self.vocab_limit = vocab_limit(model, tokenizer)  # rows past the tokenizer are never chosen
        self.max_batch, self.max_queue = max_batch, max_queue
        self.context = model.config.context_length
        self.keep = max(1, self.context // 2)  # tokens kept when a row's window slides, as generate does
        self.model_lock = threading.Lock()
        # Scoring prompts keeps the logits of every prompt position: bound them (2**28 floats = 1 GiB).
        self.scoring_logits_limit = 2**28
        self._cond = threading.Condition()
        self._pending: collections.deque[Job] = collections.deque()
        self.active: list[Job] = []
        self._window: DecodeWindow | None = None  # the active jobs' rows, in the same order
        self._prefilling: list[Prefill] = []  # prompts going in a chunk at a time (generation.prefix)
        # Keys and values of recent prompts and answers, reused by requests that begin alike (0: off).
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self._logits: Float[Tensor, "batch vocab"] | None = None  # next-token logits of each active row
        self.stats: collections.Counter[str] = collections.Counter()
        self.draining = False
        self._deadline: float | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="glasslm-batcher", daemon=True)
        # One wake-up of the event loop per step for all rows, not one per row: each wake-up is a
        # GIL hand-over between this thread and the loop's, which costs milliseconds on a busy CPU.
        self._outbox: list[tuple[Job, dict[str, Any]]] = []
        # Called on the worker thread with each job that ends, however it ends (a server's metrics).
        self.listeners: list[Callable[[Job], None]] = []
        self.recent: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens) of recent steps
        self._tokens_at_last_step = 0
        self._durations: collections.deque[float] = collections.deque(maxlen=32)  # of the last sequences

    # --- the caller's side (event-loop threads) ---

    def start(self) -> None:
        """Start decoding on the worker thread, after letting this thread's idle OpenMP workers go
        (`runtime.release_openmp_threads`: with them alive, the worker's threads sleep between steps)."""
        release_openmp_threads()
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue `job`; raises `Overloaded` when the queue is full, `ShuttingDown` while draining."""
        self.submit_all([job])

    def submit_all(self, jobs: list[Job]) -> None:
        """Queue all of `jobs` at once (the next step admits them together, as far as rows allow) or none."""
        with self._cond:
            if self.draining or self._stop:
                raise ShuttingDown("the server is shutting down and takes no new requests")
            free_rows = max(0, self.max_batch - len(self.active))  # jobs the next step admits
            if len(self._pending) + len(jobs) > self.max_queue + free_rows:
                self.stats["rejected"] += 1
                raise Overloaded(f"the server is busy ({len(self.active)} requests running, "
                                 f"{len(self._pending)} waiting, the queue holds {self.max_queue}); retry later")
            for job in jobs:
                job.outbox = self._outbox
                self._pending.append(job)
            self.stats["submitted"] += len(jobs)
            self._cond.notify()

    def queued(self) -> int:
        """Jobs waiting for their first token: queued, or their prompt still going in."""
        return len(self._pending) + len(self._prefilling)

    def tokens_per_second(self, over: float = 10.0) -> float:
        """Tokens generated per second over the last `over` seconds (all rows together)."""
        now, recent = time.monotonic(), list(self.recent)
        return sum(tokens for at, tokens in recent if now - at <= over) / over

    def kv_usage(self) -> dict[str, float]:
        """The running batch's key/value cache: bytes allocated, tokens held, and held / allocated slots."""
        window, active = self._window, list(self.active)  # the worker may swap them meanwhile: read once
        if window is None:
            return {"bytes": 0, "tokens": 0, "usage": 0.0}
        tokens = sum(min(len(job.held), self.context) for job in active)
        slots = window.rows * window.cache.max_length
        return {"bytes": window.nbytes, "tokens": tokens, "usage": tokens / slots if slots else 0.0}

    def prefix_cache_stats(self) -> dict[str, tuple[str, str, float]] | None:
        """The prefix cache's figures for /metrics, {name: (kind, help, value)}; None without one."""
        cache = self.prefix_cache
        if cache is None:
            return None
        return {"bytes": ("gauge", "Bytes of keys and values the prefix cache holds.", cache.bytes),
                "budget_bytes": ("gauge", "The prefix cache's memory budget.", cache.budget),
                "blocks": ("gauge", f"Blocks of {cache.block} tokens the prefix cache holds.", len(cache.blocks)),
                "hit_tokens_total": ("counter", "Prompt tokens found in the prefix cache (not prefilled).",
                                     cache.stats["hit_tokens"]),
                "looked_up_tokens_total": ("counter", "Prompt tokens looked up in the prefix cache.",
                                           cache.stats["looked_up_tokens"]),
                "evicted_blocks_total": ("counter", "Blocks evicted to stay within the budget.",
                                         cache.stats["evicted_blocks"])}

    def retry_after(self) -> int:
        """Seconds a refused client should wait (HTTP 429's Retry-After): the queue ahead of it, at the
        recent mean time a sequence takes, worked through `max_batch` at a time; 1 to 60."""
        durations = list(self._durations) or [1.0]
        wait = sum(durations) / len(durations) * (len(self._pending) + 1) / self.max_batch
        return max(1, min(60, math.ceil(wait)))

    def _ended(self, job: Job) -> None:
        """A job is done (finished, cancelled, aborted or failed): tell the listeners."""
        job.ended = time.time()
        self._durations.append(job.ended - job.created)
        for listener in self.listeners:
            try:
                listener(job)
            except Exception:  # noqa: BLE001 - a listener's bug must not stop the batch
                log.exception("an engine listener failed")

    def begin_shutdown(self, grace: float) -> None:
        """Take no new jobs; running and queued ones get `grace` seconds to finish, then are aborted."""
        with self._cond:
            if not self.draining:
                self.draining, self._deadline = True, time.monotonic() + grace
            self._cond.notify()

    def stop(self, timeout: float = 5.0) -> None:
        """End the worker; any job still running is aborted."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # --- the worker thread ---

    def _flush(self) -> None:
        """Deliver the events of the last step: one call into each event loop that has any."""
        events, self._outbox[:] = list(self._outbox), []
        by_loop: dict[Any, list[tuple[Job, dict[str, Any]]]] = {}
        for job, event in events:
            by_loop.setdefault(job.loop, []).append((job, event))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
                loop.call_soon_threadsafe(_deliver, items)

    def _run(self) -> None:
        try:
            while self._iterate():
                self._flush()
        finally:
            self._flush()

    def _iterate(self) -> bool:
        """One pass of the worker: admit, step, or abort everything; False once stopped."""
        with self._cond:
            while not (self.active or self._pending or self._prefilling or self._stop):
                self._cond.wait()
            if self._stop or (self._deadline is not None and time.monotonic() > self._deadline):
                self._abort_all()
                return not self._stop
            new = self._take_pending()
        try:
            with self.model_lock, torch.inference_mode():
                self._step(new)
        except Exception as err:  # never leave a client waiting on a dead worker
            log.exception("decode step failed")
            for job in [*self.active, *new, *(p.job for p in self._prefilling)]:
                if job.finish_reason is None:
                    job.emit({"error": f"generation failed: {type(err).__name__}: {err}"})
                    job.finish_reason = "error"
                    self._ended(job)
            self.active, self._window, self._prefilling = [], None, []
        return True

    def _abort_all(self) -> None:
        for job in [*self.active, *(p.job for p in self._prefilling), *self._pending]:
            job.finish("abort", job.streamer.finish())
            self.stats["aborted"] += 1
            self._ended(job)
        self.active, self._window, self._prefilling = [], None, []
        self._pending.clear()

    def _take_pending(self) -> list[Job]:
        """The waiting jobs the next step admits (as many as free rows), skipping cancelled ones."""
        new = []
        while self._pending and len(self.active) + len(new) < self.max_batch:
            job = self._pending.popleft()
            if job.cancelled.is_set():
                job.finish_reason = "cancelled"
                self.stats["cancelled"] += 1
                self._ended(job)
            else:
                new.append(job)
        return new

    def _step(self, new: list[Job]) -> None:
        scoring = [job for job in new if job.sampling.prompt_logprobs is not None]
        for group in self._admission_groups(scoring):
            self._admit(group)
        batched, chunked = self._split([job for job in new if job.sampling.prompt_logprobs is None])
        if batched:
            self._admit(batched)
        capacity = lambda job: self._capacity(len(job.held))  # noqa: E731
        self._prefilling += [Prefill.start(job, self.model, capacity(job), self.prefix_cache) for job in chunked]
        self._advance_prefill()
        if not self.active:
            return
        chosen, keep = self._sample()
        self.stats["steps"] += 1
        self.stats["rows"] += len(self.active)  # rows / steps: the mean batch actually decoded
        self._count_step()
        if len(keep) < len(self.active):
            for i in sorted(set(range(len(self.active))) - set(keep)):
                self._ended(self.active[i])
                self._keep_prefix(i)
            self._remove(keep)
        if self.active:
            self._feed([chosen[i] for i in keep])

    def _capacity(self, longest: int) -> int:
        """Slots for a new window: its longest row and room to grow (`ROOM`), within the context."""
        return min(self.context, longest + ROOM)

    def _split(self, jobs: list[Job]) -> tuple[list[Job], list[Job]]:
        """(short prompts prefilled now as one padded batch, the rest: prefilled a chunk at a time).

        A prompt goes the chunked way when it is longer than `CHUNK`, when the batch already holds
        `CHUNK * 4` prompt tokens, or when the prefix cache has its beginning."""
        batched, chunked, tokens = [], [], 0
        for job in jobs:
            cached = self.prefix_cache is not None and self.prefix_cache.cached(job.held) > 0
            if cached or len(job.held) > CHUNK or tokens + len(job.held) > 4 * CHUNK:
                chunked.append(job)
            else:
                batched.append(job)
                tokens += len(job.held)
        return batched, chunked

    def _advance_prefill(self) -> None:
        """Prefill the first waiting prompt by a chunk (all of it if nothing is decoding); a finished
        one joins the running batch, its prompt blocks kept in the prefix cache."""
        while self._prefilling:
            prefill = self._prefilling[0]
            if prefill.job.cancelled.is_set():
                self._prefilling.pop(0)
                prefill.job.finish_reason = "cancelled"
                self.stats["cancelled"] += 1
                self._ended(prefill.job)
                continue
            before = prefill.done
            finished = prefill.advance(CHUNK if self.active else None)
            self.stats["prompt_tokens"] += prefill.done - before
            if not finished:
                return
            self._prefilling.pop(0)
            if self.prefix_cache is not None:
                self.prefix_cache.insert(prefill.job.held, *prefill.window.row_keys_values(0))
            self._join([prefill.job], prefill.window, prefill.logits)
            return

    def _keep_prefix(self, row: int) -> None:
        """Keep a finished row's tokens (its prompt and answer) in the prefix cache: the next turn of a
        conversation begins with them."""
        job = self.active[row]
        if self.prefix_cache is None or job.finish_reason not in ("stop", "length"):
            return
        keys, values = self._window.row_keys_values(row)
        self.prefix_cache.insert(job.held[:keys[0].shape[1]], keys, values)  # the tokens the row holds

    def _count_step(self) -> None:
        """Keep the last 10 s of (time, tokens generated) for `tokens_per_second`."""
        now = time.monotonic()
        self.recent.append((now, self.stats["tokens"] - self._tokens_at_last_step))
        self._tokens_at_last_step = self.stats["tokens"]
        while self.recent and now - self.recent[0][0] > 10.0:
            self.recent.popleft()

    def _admission_groups(self, jobs: list[Job]) -> list[list[Job]]:
        """`jobs` in prefill groups: one, unless scoring prompts would need more than
        `scoring_logits_limit` logits at once ((rows x longest prompt x vocab) floats, 4 bytes each)."""
        if not any(job.sampling.prompt_logprobs is not None for job in jobs):
            return [jobs] if jobs else []
        tokens_at_once = max(1, self.scoring_logits_limit // self.model.config.vocab_size)
        groups: list[list[Job]] = []
        for job in sorted(jobs, key=lambda j: len(j.held)):  # similar lengths together: less padding
            if groups and (len(groups[-1]) + 1) * len(job.held) <= tokens_at_once:
                groups[-1].append(job)
            else:
                groups.append([job])
        return groups

    def _admit(self, jobs: list[Job]) -> None:
        """Prefill the new rows as their own padded batch, then let them join the running one.

        Jobs that score their prompt get its per-token log-probabilities from the same prefill;
        those that generate nothing (max_tokens 0) finish there and never join.
        """
        window = DecodeWindow(self.model, len(jobs), self._capacity(max(len(job.held) for job in jobs)))
        self.stats["prompt_tokens"] += sum(len(job.held) for job in jobs)
        scoring = any(job.sampling.prompt_logprobs is not None for job in jobs)
        logits = window.prefill([job.held for job in jobs], every_position=scoring)
        if scoring:  # logits: (batch, longest, vocab); row r's token j at slot j + pads[r]
            for row, job in enumerate(jobs):
                if job.sampling.prompt_logprobs is not None:
                    start = int(window.pads[row])
                    job.emit({"prompt": prompt_scores(logits[row, start:], job.prompt, job.sampling.prompt_logprobs),
                              "text": ""})
            logits = logits[:, -1]  # (batch, vocab): each row's next-token logits
            going = [row for row, job in enumerate(jobs) if job.sampling.max_tokens > 0]
            for job in jobs:
                if job.sampling.max_tokens <= 0:
                    job.finish("length")
                    self.stats["completed"] += 1
                    self._ended(job)
            if not going:
                return
            if len(going) < len(jobs):
                window.keep_rows(going)
                jobs, logits = [jobs[row] for row in going], logits[going]
        self._join(jobs, window, logits)

    def _join(self, jobs: list[Job], window: DecodeWindow, logits: Float[Tensor, "rows vocab"]) -> None:
        """Prefilled rows join the running batch (or become it)."""
        if self._window is None:
            self.active, self._window, self._logits = list(jobs), window, logits
        else:
            self._window.extend(window)
            self._logits = torch.cat([self._logits, logits])
            self.active += jobs
        self.stats["largest_batch"] = max(self.stats["largest_batch"], len(self.active))

    def _sample(self) -> tuple[list[int], list[int]]:
        """Pick each row's token, send it to its client; return the tokens and the rows that go on."""
        logits = self._logits
        want_logprobs = any(job.sampling.logprobs is not None for job in self.active)
        # over the tokens sampling draws from: a padded embedding table's extra rows are no alternative
        log_probs = torch.log_softmax(logits[:, :self.vocab_limit], dim=-1) if want_logprobs else None
        chosen, keep = [], []
        now = time.time()
        for i, job in enumerate(self.active):
            if job.cancelled.is_set():
                job.finish_reason = "cancelled"
                self.stats["cancelled"] += 1
                chosen.append(0)
                continue
            try:
                token = self._choose(job, logits[i:i + 1])
            except GrammarError as err:  # this row's grammar failed: it alone ends, the batch goes on
                job.emit({"error": f"constrained decoding failed: {err}"})
                job.finish_reason = "error"
                chosen.append(0)
                continue
            chosen.append(token)
            job.first_token_time = job.first_token_time or now
            if token in job.stop_tokens or (job.matcher is not None and job.matcher.ends(token)):
                job.finish("stop", job.streamer.finish())
                self.stats["completed"] += 1
                continue
            if self._emit_token(job, token, None if log_probs is None else log_probs[i]):
                keep.append(i)
            else:
                self.stats["completed"] += 1
        return chosen, keep

    def _choose(self, job: Job, logits: Float[Tensor, "1 vocab"]) -> int:
        """The job's next token from its row of logits; a grammar's matcher moves past it."""
        s = job.sampling
        scores = self._adjusted(job, logits)  # (1, vocab)
        token = int(sample_next(scores, s.temperature, s.top_k, s.top_p, job.generator, s.min_p, self.vocab_limit)[0])
        if job.matcher is not None and not job.matcher.ends(token) and token not in job.stop_tokens:
            job.matcher.accept(token)
        return token

    def _adjusted(self, job: Job, logits: Float[Tensor, "1 vocab"]) -> Float[Tensor, "1 vocab"]:
        """One row's logits after the job's repetition penalty, logit bias, grammar and min_tokens, in that order."""
        s = job.sampling
        if s.repetition_penalty != 1.0:
            seen = torch.zeros_like(logits, dtype=torch.bool)
            seen[0, torch.tensor(job.prompt + job.generated, device=logits.device)] = True
            logits = apply_repetition_penalty(logits, seen, s.repetition_penalty)
        if s.logit_bias:
            ids, values = zip(*s.logit_bias)
            logits = logits.index_add(1, torch.tensor(ids, device=logits.device),
                                      torch.tensor([values], dtype=logits.dtype, device=logits.device))
        if job.matcher is not None:  # only tokens that keep the text inside the grammar (generation.constrained)
            logits = job.matcher.constrain(logits)
        if len(job.generated) < s.min_tokens and job.stop_tokens:
            stops = torch.tensor(sorted(t for t in job.stop_tokens if t < logits.shape[-1]), device=logits.device)
            held = logits.index_fill(1, stops, float("-inf"))
            if torch.isfinite(held[:, :self.vocab_limit]).any():  # unless every token would stop
                logits = held
        return logits

    def _emit_token(self, job: Job, token: int, log_probs: Float[Tensor, "vocab"] | None) -> bool:
        """Send `token` to the job's client, finishing the job if it is done; True while it goes on."""
        s = job.sampling
        event: dict[str, Any] = {"token": token, "offset": len(job.streamer.text)}
        if log_probs is not None and s.logprobs is not None:
            event["logprob"] = float(log_probs[token])
            top = log_probs.topk(s.logprobs) if s.logprobs > 0 else None
            event["top"] = [] if top is None else list(zip(top.indices.tolist(), top.values.tolist()))
        job.generated.append(token)
        job.held.append(token)
        self.stats["tokens"] += 1
        event["text"] = job.streamer.push(token)
        job.emit(event)
        if job.streamer.stopped:
            job.finish("stop")
        elif job.matcher is not None and job.matcher.done:  # the grammar's text is complete
            job.finish("stop", job.streamer.finish())
        elif len(job.generated) >= s.max_tokens:
            job.finish("length", job.streamer.finish())
        else:
            return True
        return False

    def _remove(self, keep: list[int]) -> None:
        """Drop finished rows from the window (and the left padding no remaining row needs)."""
        self.active = [self.active[i] for i in keep]
        if not keep:
            self._window = self._logits = None
            return
        self._window.keep_rows(keep)

    def _feed(self, tokens: list[int]) -> None:
        """Run the chosen tokens through the model: the next step's logits."""
        window = self._window
        if window.full and window.cache.max_length < self.context:  # room to grow: double, within the context
            window.grow(min(self.context, 2 * window.cache.max_length))
        if not window.full:
            self._logits = window.decode(torch.tensor(tokens, dtype=torch.long, device=window.device))
            return
        # The cache is full: re-prefill every row, sliding those whose own window passed the
        # context to their last `keep` tokens (exactly when generate would slide them alone).
        for job in self.active:
            if len(job.held) > self.context:
                job.held = job.held[-self.keep:]
        self._window = DecodeWindow(self.model, len(self.active), self._capacity(max(len(j.held) for j in self.active)))
        self._logits = self._window.prefill([job.held for job in self.active])


def prompt_scores(logits: Float[Tensor, "seq vocab"], ids: list[int], top: int) -> list[dict[str, Any]]:
    """Per prompt token: its id, log-probability given the tokens before it, and the `top` likeliest.

    `logits[j]` predicts token j + 1; the first token has no context, so its logprob and top are None.
    """
    log_probs = torch.log_softmax(logits[:len(ids) - 1].float(), dim=-1)  # (seq - 1, vocab)
    target = torch.tensor(ids[1:], dtype=torch.long, device=log_probs.device)
    chosen = log_probs.gather(1, target[:, None])[:, 0].tolist()  # (seq - 1,)
    best = log_probs.topk(top, dim=-1) if top > 0 else None
    scores: list[dict[str, Any]] = [{"token": ids[0], "logprob": None, "top": None}]
    for j, token in enumerate(ids[1:]):
        alternatives = [] if best is None else list(zip(best.indices[j].tolist(), best.values[j].tolist()))
        scores.append({"token": token, "logprob": chosen[j], "top": alternatives})
    return scores


def _deliver(items: list[tuple[Job, dict[str, Any]]]) -> None:
    for job, event in items:
        job.events.put_nowait(event)
