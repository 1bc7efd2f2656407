"""`glasslm serve`: an OpenAI-compatible completions server and the explorer page, in one process.

Requests never run the model themselves. They queue `Job`s for one worker thread (`Engine`)
that decodes every active job together as one left-padded batch, the ragged batching of
`glasslm.generation` (per-row positions, a mask hiding each row's padding). Between two decode
steps the worker admits waiting jobs (their prompts are prefilled as a small batch of their own,
then their key/value rows are spliced into the running cache) and drops finished or cancelled
ones, so a request never waits for a whole batch to finish. Each row decodes as it would alone.

The queue is bounded: past `max_queue` waiting jobs a request gets HTTP 429 at once. A client
that disconnects cancels its job at the next step. SIGTERM (or Ctrl-C) stops accepting requests,
lets running ones finish for up to `grace` seconds, then ends them with finish_reason "abort".

The explorer's JSON endpoints (/api/next-token, /api/token-loss, /api/attention,
/api/logit-lens) are thin wrappers around `glasslm.interp.explore`; they take the same model lock the
worker holds during a step, so hooks never see a decode step's activations.

Example (the app without a network socket; `uvicorn.run(app)` would serve it):
    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.tokenizers import CharTokenizer
    >>> tok = CharTokenizer.from_text("abc\\n")
    >>> app = create_app(TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=4, n_layers=1)).eval(), tok)
    >>> sorted(r.path for r in app.routes if r.path.startswith("/v1"))
    ['/v1/completions', '/v1/models']
"""


import asyncio
import collections
import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from glasslm.interp.explore import attention, logit_lens, next_token, token_loss, token_texts
from glasslm.generation.decoding import _Window
from glasslm.generation.sampling import sample_next
from glasslm.generation.streaming import TextStreamer
from glasslm.core.model import TransformerLM
from glasslm.serving.config import ServeConfig

log = logging.getLogger("glasslm.serving.server")
STATIC_DIR = Path(__file__).parent / "static"
ENDOFTEXT = "<|endoftext|>"
LOSS_LIMIT_CONTEXTS = 16  # /api/token-loss scores texts up to this many context lengths


class Overloaded(Exception):
    """The queue is full: the client should retry later (HTTP 429)."""


class ShuttingDown(Exception):
    """The server is draining after SIGTERM and takes no new work (HTTP 503)."""


@dataclass
class Sampling:
    """One request's controls, already checked (see `CompletionRequest`)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # how many alternatives per token, as OpenAI's `logprobs`


@dataclass
class Job:
    """One completion being generated. The worker thread fills it; the request's task reads `events`."""

    prompt: list[int]
    sampling: Sampling
    tokenizer: Any
    loop: asyncio.AbstractEventLoop
    stop_tokens: frozenset[int] = frozenset()
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex[:24]}")
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    created: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        self.held = list(self.prompt)  # the tokens this row's cache window holds (plus the newest)
        self.generated: list[int] = []
        self.streamer = TextStreamer(self.tokenizer, self.sampling.stop)
        seed = self.sampling.seed
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.finish_reason: str | None = None
        self.first_token_time: float | None = None

    outbox: list | None = None  # set by the engine: events wait there until the step ends

    def emit(self, event: dict[str, Any]) -> None:
        """Hand an event to the request's event loop (thread-safe; a closed loop means nobody listens)."""
        if self.outbox is not None:
            self.outbox.append((self, event))
            return
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def finish(self, reason: str, text: str = "") -> None:
        self.finish_reason = reason
        self.emit({"finish_reason": reason, "text": text})


class Engine:
    """The batching loop: one worker thread, a bounded queue, and the model lock."""

    def __init__(self, model: TransformerLM, tokenizer: Any, max_batch: int = 32, max_queue: int = 64):
        if max_batch < 1 or max_queue < 0:
            raise ValueError("max_batch must be >= 1 and max_queue >= 0")
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.max_queue = max_batch, max_queue
        self.context = model.config.context_length
        self.keep = max(1, self.context // 2)  # tokens kept when a row's window slides, as generate does
        self.model_lock = threading.Lock()
        self._cond = threading.Condition()
        self._pending: collections.deque[Job] = collections.deque()
        self.active: list[Job] = []
        self._window: _Window | None = None
        self._pads: torch.Tensor | None = None  # (batch,) left padding of each row in the cache
        self._logits: torch.Tensor | None = None  # (batch, vocab) next-token logits of each active row
        self.stats: collections.Counter[str] = collections.Counter()
        self.draining = False
        self._deadline: float | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="glasslm-batcher", daemon=True)
        # One wake-up of the event loop per step for all rows, not one per row: each wake-up is a
        # GIL hand-over between this thread and the loop's, which costs milliseconds on a busy CPU.
        self._outbox: list[tuple[Job, dict[str, Any]]] = []

    # --- the request side (event-loop threads) ---

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cond:
            if self.draining or self._stop:
                raise ShuttingDown("the server is shutting down and takes no new requests")
            free_rows = max(0, self.max_batch - len(self.active))  # jobs the next step admits
            if len(self._pending) >= self.max_queue + free_rows:
                self.stats["rejected"] += 1
                raise Overloaded(f"the server is busy ({len(self.active)} requests running, "
                                 f"{len(self._pending)} waiting, the queue holds {self.max_queue}); retry later")
            job.outbox = self._outbox
            self._pending.append(job)
            self.stats["submitted"] += 1
            self._cond.notify()

    def queued(self) -> int:
        return len(self._pending)

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
            while not (self.active or self._pending or self._stop):
                self._cond.wait()
            if self._stop or (self._deadline is not None and time.monotonic() > self._deadline):
                for job in [*self.active, *self._pending]:
                    job.finish("abort", job.streamer.finish())
                    self.stats["aborted"] += 1
                self.active, self._window = [], None
                self._pending.clear()
                return not self._stop
            new = []
            while self._pending and len(self.active) + len(new) < self.max_batch:
                job = self._pending.popleft()
                if job.cancelled.is_set():
                    self.stats["cancelled"] += 1
                else:
                    new.append(job)
        try:
            with self.model_lock, torch.inference_mode():
                self._step(new)
        except Exception as err:  # never leave a client waiting on a dead worker
            log.exception("decode step failed")
            for job in [*self.active, *new]:
                if job.finish_reason is None:
                    job.emit({"error": f"generation failed: {type(err).__name__}: {err}"})
                    job.finish_reason = "error"
            self.active, self._window = [], None
        return True

    def _step(self, new: list[Job]) -> None:
        if new:
            self._admit(new)
        if not self.active:
            return
        chosen, keep = self._sample()
        self.stats["steps"] += 1
        self.stats["rows"] += len(self.active)  # rows / steps: the mean batch actually decoded
        if len(keep) < len(self.active):
            self._remove(keep)
        if self.active:
            self._feed([chosen[i] for i in keep])

    def _admit(self, jobs: list[Job]) -> None:
        """Prefill the new rows as their own padded batch, then splice them into the running one."""
        window = _Window(self.model, len(jobs), self.context, pad_token=0)
        logits = window.prefill([job.held for job in jobs])
        pads = self._pads_of(window)
        if self._window is None:
            self.active, self._window, self._pads, self._logits = list(jobs), window, pads, logits
            self.stats["largest_batch"] = max(self.stats["largest_batch"], len(jobs))
            return
        main = self._window
        length = max(main.cache.length, window.cache.length)
        # Both caches are right-aligned at `length`: a row's real tokens always end at the cursor.
        shift_main, shift_new = length - main.cache.length, length - window.cache.length
        for ours, theirs in ((main.cache.keys, window.cache.keys), (main.cache.values, window.cache.values)):
            for layer in range(len(ours)):
                ours[layer] = torch.cat([_shift(ours[layer], shift_main, main.cache.length),
                                         _shift(theirs[layer], shift_new, window.cache.length)])
        main.cache.length = length
        main.next_position = torch.cat([main.next_position, window.next_position])
        self._set_pads(torch.cat([self._pads + shift_main, pads + shift_new]))
        self._logits = torch.cat([self._logits, logits])
        self.active += jobs
        self.stats["largest_batch"] = max(self.stats["largest_batch"], len(self.active))

    def _sample(self) -> tuple[list[int], list[int]]:
        """Pick each row's token, send it to its client; return the tokens and the rows that go on."""
        logits = self._logits
        want_logprobs = any(job.sampling.logprobs is not None for job in self.active)
        log_probs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        chosen, keep = [], []
        now = time.time()
        for i, job in enumerate(self.active):
            s = job.sampling
            if job.cancelled.is_set():
                job.finish_reason = "cancelled"
                self.stats["cancelled"] += 1
                chosen.append(0)
                continue
            token = int(sample_next(logits[i:i + 1], s.temperature, s.top_k, s.top_p, job.generator, s.min_p)[0])
            chosen.append(token)
            job.first_token_time = job.first_token_time or now
            if token in job.stop_tokens:
                job.finish("stop", job.streamer.finish())
                self.stats["completed"] += 1
                continue
            event: dict[str, Any] = {"token": token, "offset": len(job.streamer.text)}
            if log_probs is not None and s.logprobs is not None:
                event["logprob"] = float(log_probs[i, token])
                top = log_probs[i].topk(s.logprobs) if s.logprobs > 0 else None
                event["top"] = [] if top is None else list(zip(top.indices.tolist(), top.values.tolist()))
            job.generated.append(token)
            job.held.append(token)
            event["text"] = job.streamer.push(token)
            job.emit(event)
            if job.streamer.stopped:
                job.finish("stop")
            elif len(job.generated) >= s.max_tokens:
                job.finish("length", job.streamer.finish())
            else:
                keep.append(i)
                continue
            self.stats["completed"] += 1
        return chosen, keep

    def _remove(self, keep: list[int]) -> None:
        """Drop finished rows from the cache, and the left padding no remaining row needs."""
        self.active = [self.active[i] for i in keep]
        if not keep:
            self._window = self._pads = self._logits = None
            return
        main = self._window
        index = torch.tensor(keep, device=main.device)
        pads = self._pads[index]
        trim = int(pads.min())
        for store in (main.cache.keys, main.cache.values):
            for layer in range(len(store)):
                store[layer] = _shift(store[layer][index], -trim, main.cache.length)
        main.cache.length -= trim
        main.next_position = main.next_position[index]
        self._set_pads(pads - trim)

    def _feed(self, tokens: list[int]) -> None:
        """Run the chosen tokens through the model: the next step's logits."""
        main = self._window
        if not main.full:
            self._logits = main.decode(torch.tensor(tokens, dtype=torch.long, device=main.device))
            return
        # The cache is full: re-prefill every row, sliding those whose own window passed the
        # context to their last `keep` tokens (exactly when generate would slide them alone).
        for job in self.active:
            if len(job.held) > self.context:
                job.held = job.held[-self.keep:]
        window = _Window(self.model, len(self.active), self.context, pad_token=0)
        self._logits = window.prefill([job.held for job in self.active])
        self._window = window
        self._set_pads(self._pads_of(window))

    def _pads_of(self, window: _Window) -> torch.Tensor:
        if window.key_is_real is None:
            return torch.zeros(window.next_position.shape[0], dtype=torch.long, device=window.device)
        return (~window.key_is_real).sum(dim=1)

    def _set_pads(self, pads: torch.Tensor) -> None:
        """Keep the window's mask and the kernel choice in step with the rows' padding."""
        main = self._window
        self._pads = pads
        slots = torch.arange(main.cache.max_length, device=main.device)
        main.key_is_real = None if int(pads.max()) == 0 else slots[None, :] >= pads[:, None]
        weight = self.model.embed.weight
        main.use_native_gemv = (weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16)
                                and len(pads) == 1)


def _deliver(items: list[tuple[Job, dict[str, Any]]]) -> None:
    for job, event in items:
        job.events.put_nowait(event)


def _shift(t: torch.Tensor, by: int, length: int) -> torch.Tensor:
    """Move cache slots [0, length) of (batch, heads, slots, d) right by `by` (left if negative)."""
    if by == 0:
        return t
    out = torch.zeros_like(t)
    if by > 0:
        out[:, :, by:by + length] = t[:, :, :length]
    else:
        out[:, :, :length + by] = t[:, :, -by:length]
    return out


# --- HTTP ----------------------------------------------------------------------------------------

def create_app(model: TransformerLM, tokenizer: Any, config: ServeConfig | None = None) -> Any:
    """The FastAPI app: /v1/completions, /v1/models, /health, the explorer page and its /api endpoints.

    `config.max_batch` rows decode together; up to `config.max_queue` more wait; beyond that requests
    get 429. The host, port and grace of `config` are the server's (`serve`), not the app's.
    """
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
    from fastapi.staticfiles import StaticFiles
    from starlette.exceptions import HTTPException

    from glasslm.serving import api

    if tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer, so text cannot be encoded")
    config = config or ServeConfig()
    name, max_tokens_limit = config.name or "glasslm", config.max_tokens_limit
    engine = Engine(model, tokenizer, config.max_batch, config.max_queue)
    context = model.config.context_length
    eos = frozenset(tokenizer.special_tokens[s] for s in (ENDOFTEXT,) if s in getattr(tokenizer, "special_tokens", {}))

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="glasslm", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.engine = engine

    def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                            status_code=status)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError):
        problem = exc.errors()[0] if exc.errors() else {}
        where = "" if problem.get("type") == "json_invalid" else ".".join(
            str(p) for p in problem.get("loc", ()) if p != "body")
        message = api.describe_validation_error(problem)
        return error(400, f"{where}: {message}" if where else message, param=where or None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        message = str(exc.detail)
        if exc.status_code == 400 and "parsing the body" in message:  # FastAPI's words for bad bytes
            message = "the request body could not be read: it must be JSON encoded as UTF-8"
        return error(exc.status_code, message, kind)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error(500, f"internal error: {type(exc).__name__}", "server_error")

    def encode(prompt: str | list[int] | list[str], limit: int = context, what: str = "prompt") -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise api.BadRequest("prompt: only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            try:
                ids = tokenizer.encode(prompt) if prompt else (list(eos)[:1] or tokenizer.encode("\n"))
            except ValueError as err:
                raise api.BadRequest(f"{what}: {err}", what) from None
        else:
            ids = list(prompt)
            bad = [i for i in ids if not 0 <= i < model.config.vocab_size]
            if bad:
                raise api.BadRequest(f"{what}: token id {bad[0]} is outside [0, {model.config.vocab_size})", what)
        if not ids:
            raise api.BadRequest(f"{what}: the {what} encodes to no tokens", what)
        if len(ids) > limit:
            raise api.BadRequest(f"{what}: the {what} is {len(ids)} tokens; at most {limit} are allowed"
                                 + (" (the model's context length)" if limit == context else ""), what)
        return ids

    @app.exception_handler(api.BadRequest)
    async def bad_input(request: Request, exc: api.BadRequest):
        return error(400, str(exc), param=exc.param)

    @app.get("/health")
    async def health():
        status = "draining" if engine.draining else "ok"
        body = {"status": status, "model": name, "active": len(engine.active), "queued": engine.queued(),
                **{k: engine.stats[k] for k in ("submitted", "completed", "cancelled", "rejected", "aborted",
                                                     "largest_batch", "steps", "rows")}}
        return JSONResponse(body, status_code=503 if engine.draining else 200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(app.state.started),
                                            "owned_by": "glasslm", "max_model_len": context}]}

    app.state.started = time.time()

    @app.post("/v1/completions")
    async def completions(body: api.CompletionRequest, request: Request):
        if body.model is not None and body.model != name:
            return error(404, f"model {body.model!r} not found; this server serves {name!r}", "not_found", "model")
        if body.max_tokens > max_tokens_limit:
            raise api.BadRequest(f"max_tokens: {body.max_tokens} is more than this server's limit "
                                 f"{max_tokens_limit}", "max_tokens")
        job = Job(encode(body.prompt), body.sampling(), tokenizer, asyncio.get_running_loop(), stop_tokens=eos)
        started = time.perf_counter()
        if job.sampling.max_tokens > 0:
            try:
                engine.submit(job)
            except Overloaded as err:
                return error(429, str(err), "overloaded")
            except ShuttingDown as err:
                return error(503, str(err), "unavailable")
        else:
            job.finish("length")

        def done() -> None:
            elapsed = time.perf_counter() - started
            first = (job.first_token_time - job.created) if job.first_token_time else float("nan")
            log.info("%s prompt=%d completion=%d finish=%s first_token=%.3fs total=%.3fs", job.id,
                     len(job.prompt), len(job.generated), job.finish_reason, first, elapsed)

        if body.stream:
            async def sse() -> AsyncIterator[str]:
                try:
                    async for chunk in api.stream_chunks(job, body, name, tokenizer):
                        yield f"data: {json.dumps(chunk)}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    job.cancelled.set()  # a no-op once finished; otherwise the client went away
                    done()
            return StreamingResponse(sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            result = await api.collect(job, body, name, tokenizer, request)
        finally:
            job.cancelled.set()
            done()
        if "error" in result:
            return error(500, result["error"]["message"], "server_error")
        return result

    # --- the explorer ---

    def run_locked(fn, *args, **kwargs):
        with engine.model_lock:
            try:
                return fn(model, tokenizer, *args, **kwargs)
            except (ValueError, KeyError) as err:
                raise api.BadRequest(str(err).strip("'\"")) from None

    @app.get("/api/info")
    def info():
        c = model.config
        return {"model": name, "context_length": context, "vocab_size": c.vocab_size, "n_layers": c.n_layers,
                "n_heads": c.n_heads, "d_model": c.d_model, "parameters": model.num_parameters(),
                "tokenizer": getattr(tokenizer, "kind", type(tokenizer).__name__), "max_tokens_limit": max_tokens_limit}

    def encode_text(text: str | list[int]) -> list[int]:
        return encode(text, what="text")

    def encode_long(text: str | list[int]) -> list[int]:
        return encode(text, limit=LOSS_LIMIT_CONTEXTS * context, what="text")

    @app.post("/api/tokenize")
    def api_tokenize(body: api.TextRequest):
        ids = body.ids(encode_text)
        return {"tokens": ids, "texts": token_texts(tokenizer, ids)}

    @app.post("/api/next-token")
    def api_next_token(body: api.NextTokenRequest):
        top_k = body.top_k or None
        return run_locked(next_token, body.ids(encode_text), body.temperature, top_k, body.top_p, body.min_p, body.k)

    @app.post("/api/token-loss")
    def api_token_loss(body: api.TextRequest):
        return run_locked(token_loss, body.ids(encode_long))

    @app.post("/api/attention")
    def api_attention(body: api.AttentionRequest):
        return run_locked(attention, body.ids(encode_text), body.layer, body.head)

    @app.post("/api/logit-lens")
    def api_logit_lens(body: api.TextRequest):
        return run_locked(logit_lens, body.ids(encode_text))

    @app.get("/")
    async def index():
        return FileResponse(STATIC_DIR / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app


def serve(model: TransformerLM, tokenizer: Any, config: ServeConfig) -> None:
    """Run the server until SIGTERM or Ctrl-C; prints the URL once it is listening."""
    import uvicorn

    app = create_app(model, tokenizer, config)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                   access_log=True, timeout_graceful_shutdown=config.grace + 5, log_config=None)
    Server(server_config, app.state.engine, config.grace).run()


@contextlib.contextmanager
def serving_in_thread(app: Any, host: str = "127.0.0.1", port: int = 0) -> Any:
    """Serve `app` from a background thread for the length of a `with` block; yields its URL.

    For tests and benchmarks: port 0 takes a free port, and leaving the block shuts the server down.
    """
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", log_config=None))
    thread = threading.Thread(target=server.run, name="glasslm-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    try:
        yield server_url(server)
    finally:
        server.should_exit = True
        thread.join(30)


def server_url(server: Any) -> str:
    """http://host:port of a started uvicorn server (the real port when 0 was asked for)."""
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def _server_class() -> type:
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn's server, which also prints its URL once listening and drains the engine on SIGTERM."""

        def __init__(self, config: Any, engine: Engine, grace: float):
            super().__init__(config)
            self.engine, self.grace = engine, grace

        async def startup(self, sockets: Sequence[Any] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                print(f"glasslm serve: listening on {server_url(self)}  (explorer page at /, "
                      f"OpenAI API at /v1; Ctrl-C or SIGTERM to stop)", flush=True)

        def handle_exit(self, sig: int, frame: Any) -> None:
            self.engine.begin_shutdown(self.grace)
            super().handle_exit(sig, frame)

    return _Server


def Server(config: Any, engine: Engine, grace: float = 10.0) -> Any:
    """A uvicorn.Server that prints its URL when listening and drains `engine` on SIGTERM."""
    return _server_class()(config, engine, grace)
