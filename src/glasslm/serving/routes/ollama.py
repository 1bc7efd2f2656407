"""Ollama's API beside OpenAI's: POST /api/chat and /api/generate (streamed as NDJSON by default, one JSON
object a line), GET /api/tags, /api/ps and /api/version, POST /api/show: so tools that speak Ollama
(its Python and JavaScript clients, Open WebUI, editors' plugins) work against glasslm unchanged.

Requests become the same engine jobs as OpenAI's: /api/chat renders the messages with the model's
chat template (tools too, read back as Ollama's `tool_calls` with object arguments), /api/generate
renders `prompt` (and `system`) the same way unless `raw`, and continues from `context` (the ids an
earlier answer returned). `format` ("json" or a JSON schema) decodes under a grammar, as
`response_format` does. `options` map onto glasslm's sampling: `temperature` (default 0.8, as
Ollama's), `top_k` (40), `top_p` (0.9), `min_p`, `seed`, `num_predict` (-1: until the context or
`--max-tokens-limit`), `stop`, `repeat_penalty` (off unless given; applied over prompt and output).
Options that only tune Ollama's own runtime (`num_ctx`, `num_thread`, `num_gpu`, `use_mmap`, ...)
are accepted and change nothing; those that would change results and glasslm does not implement
(`mirostat`, `tfs_z`, `typical_p`, the penalties) are a 400 naming them, unless at their neutral value.

Example:
    >>> from fastapi import FastAPI
    >>> app = FastAPI()
    >>> app.include_router(router)
    >>> sorted(app.openapi()["paths"])
    ['/api/chat', '/api/generate', '/api/ps', '/api/show', '/api/tags', '/api/version']
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from glasslm.generation.engine import Job, Overloaded, Sampling, ShuttingDown
from glasslm.serving.context import Served, ServedDep
from glasslm.serving.errors import error_response, refused
from glasslm.serving.events import gather
from glasslm.serving.routes.chat import AnswerFormat, plan_chat
from glasslm.serving.schemas import SEED_LIMIT, BadRequest, UnknownModel, finite_number, stop_strings
from glasslm.serving.structured import schema_grammar
from glasslm.serving.tools import Tool, ToolFormat
from glasslm.tokenizers.chat import ChatFormat, ChatTemplateError

router = APIRouter()

NDJSON = "application/x-ndjson"
RUNTIME_ONLY = ("numa", "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
                "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep", "repeat_last_n",
                "penalize_newline", "mirostat_tau", "mirostat_eta")  # accepted, change nothing here
NEUTRAL = {"mirostat": 0, "tfs_z": 1.0, "typical_p": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


JSON_PATHS = frozenset({"/api/chat", "/api/generate", "/api/show"})


class JsonBodies:
    """ASGI middleware: Ollama's routes read their body as JSON whatever its Content-Type, as Ollama's own
    server does (its documented `curl -d '{...}'` sends a form type). Only for requests without an Origin
    header: a browser sends one on every cross-site POST, so a web page still cannot reach the model
    through a form (the cross-site request FastAPI's strict Content-Type check guards against)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if (scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in JSON_PATHS
                and not any(k == b"origin" for k, _ in scope["headers"])):
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": headers + [(b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


class Options(BaseModel):
    """Ollama's `options` that glasslm honours (the rest: `RUNTIME_ONLY`, or `NEUTRAL` only)."""

    model_config = ConfigDict(extra="allow", strict=True)
    temperature: float = Field(0.8, ge=0.0)
    top_k: int = Field(40, ge=0)
    top_p: float = Field(0.9, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=SEED_LIMIT)
    num_predict: int | None = Field(None, ge=-2)
    stop: list[str] | None = None
    repeat_penalty: float = Field(1.0, gt=0.0, le=100.0)

    _finite = field_validator("temperature")(finite_number)
    _stops = field_validator("stop")(stop_strings)

    def check(self) -> None:
        """A 400 naming any other option that is neither runtime-only nor at its neutral value."""
        for name, value in (self.model_extra or {}).items():
            field = f"options.{name}"
            if name in RUNTIME_ONLY:
                continue
            if name not in NEUTRAL:
                raise BadRequest(f"{field}: unknown option", field)
            if value not in (None, NEUTRAL[name]):
                raise BadRequest(f"{field}: not supported by glasslm serve (leave it out, or at {NEUTRAL[name]})",
                                 field)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str = Field(min_length=1)
    stream: bool = True
    format: str | dict[str, Any] | None = None  # "json", a JSON schema, or ""/null for text
    options: Options | None = None
    keep_alive: float | str | None = None  # accepted: the model stays loaded for the server's life
    think: bool | str | None = None  # only false/null: glasslm has no thinking mode

    @field_validator("format")
    @classmethod
    def _json_or_schema(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if isinstance(v, str) and v not in ("", "json"):
            raise ValueError('"json", a JSON schema object, or "" for plain text')
        return v

    @field_validator("think")
    @classmethod
    def _no_thinking(cls, v: bool | str | None) -> bool | str | None:
        if v not in (None, False):
            raise ValueError("not supported by glasslm serve (leave it out, or at false)")
        return v


class ChatRequest(_Request):
    messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[Tool] | None = None


class GenerateRequest(_Request):
    prompt: str = ""
    system: str | None = None
    context: list[int] | None = None
    raw: bool = False
    suffix: str | None = None  # only empty: glasslm does not fill in the middle
    template: str | None = None  # only empty: the model's own template renders the prompt
    images: list[str] | None = None  # only empty: glasslm serves text models

    @field_validator("suffix", "template")
    @classmethod
    def _empty(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("not supported by glasslm serve (leave it out)")
        return v

    @field_validator("images")
    @classmethod
    def _no_images(cls, v: list[str] | None) -> list[str] | None:
        if v:
            raise ValueError("not supported: glasslm serves text models")
        return v


def _model(served: Served, name: str, body: _Request | None = None) -> None:
    """A 404 unless `name` is the served model (Ollama's `:latest` tag allowed); the options checked."""
    if body is not None and body.options is not None:
        body.options.check()
    if name.removesuffix(":latest") != served.name:
        raise UnknownModel(f"model {name!r} not found; this server serves {served.name!r}", "model")


def _answer_format(body: _Request, served: Served) -> AnswerFormat | None:
    if not body.format:
        return None
    schema = {"type": "object"} if body.format == "json" else body.format
    return AnswerFormat("format", lambda: schema_grammar(schema, served.grammars("format"), "format"))


def _sampling(body: _Request, served: Served, prompt_length: int, grammar: Any) -> Sampling:
    o = body.options or Options()
    room = max(1, min(served.config.max_tokens_limit, served.context_length - prompt_length))
    max_tokens = room if o.num_predict is None or o.num_predict < 0 else min(o.num_predict, room)
    return Sampling(max_tokens=max_tokens, temperature=o.temperature, top_k=o.top_k or None,
                    top_p=o.top_p if o.top_p < 1.0 else None, min_p=o.min_p or None, seed=o.seed,
                    stop=tuple(o.stop or ()), repetition_penalty=o.repeat_penalty, grammar=grammar)


@router.post("/api/chat")
async def chat(body: ChatRequest, request: Request, served: ServedDep) -> Any:
    _model(served, body.model, body)
    if not body.messages:  # Ollama's way to load a model: nothing to say
        return _final(body.model, {"message": {"role": "assistant", "content": ""}}, "load")
    _no_images(body.messages)
    tools = body.tools or None
    plan = plan_chat(served, body.messages, tools, "auto" if tools else "none", answer=_answer_format(body, served))
    return await _run(served, request, body, plan.prompt, _sampling(body, served, len(plan.prompt), plan.grammar),
                      _ChatShape(plan.tools))


def _no_images(messages: list[dict[str, Any]]) -> None:
    for i, message in enumerate(messages):
        if isinstance(message, dict) and message.get("images"):
            raise BadRequest(f"messages.{i}.images: not supported: glasslm serves text models", f"messages.{i}.images")


@router.post("/api/generate")
async def generate(body: GenerateRequest, request: Request, served: ServedDep) -> Any:
    _model(served, body.model, body)
    if not body.prompt and not body.context:
        return _final(body.model, {"response": ""}, "load")
    text = body.prompt
    if not body.raw and served.chat_template is not None:
        turns = ([{"role": "system", "content": body.system}] if body.system else []) + [
            {"role": "user", "content": body.prompt}]
        try:
            text = ChatFormat.for_tokenizer(served.chat_template, served.tokenizer).prompt(turns)
        except ChatTemplateError as err:
            raise BadRequest(f"prompt: {err}", "prompt") from None
    ids = (served.encode(list(body.context), what="context") if body.context else []) + (
        served.encode(text, limit=10**9) if text else [])
    if len(ids) > served.context_length:
        raise BadRequest(f"prompt: context and prompt are {len(ids)} tokens; at most {served.context_length} "
                         "are allowed (the model's context length)", "prompt")
    fmt = _answer_format(body, served)
    grammar = None if fmt is None else fmt.grammar()
    return await _run(served, request, body, ids, _sampling(body, served, len(ids), grammar), _GenerateShape())


async def _run(served: Served, request: Request, body: _Request, prompt: list[int], sampling: Sampling,
               shape: Any) -> Any:
    """Queue the job; stream NDJSON lines, or answer once with the whole text."""
    job = Job(prompt, sampling, served.shown, asyncio.get_running_loop(), stop_tokens=served.eos)
    try:
        served.engine.submit(job)
    except (Overloaded, ShuttingDown) as err:
        return refused(err, served.engine)
    if body.stream:
        return StreamingResponse(_lines(job, body.model, shape), media_type=NDJSON)
    try:
        events = await gather([job], request)
    finally:
        job.cancelled.set()  # a no-op once finished; otherwise the client went away
    if isinstance(events, str):
        return error_response(500, events, "server_error")
    return _final(body.model, shape.last("".join(e["text"] for e in events), job), job.finish_reason, job)


async def _lines(job: Job, model: str, shape: Any) -> AsyncIterator[str]:
    """NDJSON: a line per piece of text, then the final line with `done: true` and the counts."""
    held = ""
    try:
        while True:
            event = await job.events.get()
            if "error" in event:
                yield json.dumps({"error": event["error"]}) + "\n"
                return
            held += event["text"]
            if "finish_reason" in event:
                yield json.dumps(_final(model, shape.last(held, job), job.finish_reason, job)) + "\n"
                return
            if held and not shape.holding(held):
                yield json.dumps({"model": model, "created_at": _now(), **shape.piece(held), "done": False}) + "\n"
                held = ""
    finally:
        job.cancelled.set()


class _ChatShape:
    """/api/chat's message pieces. Where tools are in play, an answer that may be a call is held back
    until it ends (then sent as `tool_calls`), as OpenAI's route does."""

    def __init__(self, tools: ToolFormat | None):
        self.tools, self.flowing = tools, tools is None

    def holding(self, text: str) -> bool:
        if not self.flowing and not self.tools.could_start(text):
            self.flowing = True  # not a call: from here on the text streams as it comes
        return not self.flowing

    def piece(self, text: str) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": text}}

    def last(self, text: str, job: Job) -> dict[str, Any]:
        """The final object's message: the rest of the text, or the calls read from a held answer."""
        if not self.flowing:
            content, calls = self.tools.parse(text)
            if calls:
                return {"message": {"role": "assistant", "content": content or "", "tool_calls": [
                    {"function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
                    for c in calls]}}
        return self.piece(text)


class _GenerateShape:
    """/api/generate's response pieces; the final line carries `context` (prompt and answer ids)."""

    def holding(self, text: str) -> bool:
        return False

    def piece(self, text: str) -> dict[str, Any]:
        return {"response": text}

    def last(self, text: str, job: Job) -> dict[str, Any]:
        return {"response": text, "context": list(job.prompt) + list(job.generated)}


def _final(model: str, payload: dict[str, Any], reason: str | None, job: Job | None = None) -> dict[str, Any]:
    """The last object of an answer: done, why (Ollama says "stop" or "length"), counts and durations (ns)."""
    out = {"model": model, "created_at": _now(), **payload, "done": True,
           "done_reason": {"abort": "stop", "cancelled": "stop"}.get(reason or "", reason or "stop")}
    if job is not None:
        ended = job.ended or time.time()
        first = job.first_token_time or ended
        out.update(total_duration=int((ended - job.created) * 1e9), load_duration=0,
                   prompt_eval_count=len(job.prompt), prompt_eval_duration=int((first - job.created) * 1e9),
                   eval_count=len(job.generated), eval_duration=int((ended - first) * 1e9))
    return out


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _details(served: Served) -> dict[str, Any]:
    c = served.model.config
    parameters = sum(p.numel() for p in served.model.parameters())
    size = (f"{parameters / 1e9:.1f}B" if parameters >= 1e9 else f"{parameters / 1e6:.0f}M" if parameters >= 1e6
            else f"{parameters / 1e3:.0f}K")
    family = getattr(c, "family", None) or getattr(c, "architecture", None) or "glasslm"
    return {"parent_model": "", "format": "glasslm", "family": family, "families": [family], "parameter_size": size, "quantization_level": ""}


def _card(served: Served, request: Request) -> dict[str, Any]:
    size = sum(p.numel() * p.element_size() for p in served.model.parameters())
    started = datetime.datetime.fromtimestamp(request.app.state.started, datetime.timezone.utc)
    return {"name": f"{served.name}:latest", "model": f"{served.name}:latest", "modified_at": started.isoformat(),
            "size": size, "digest": hashlib.sha256(served.name.encode()).hexdigest(), "details": _details(served)}


@router.get("/api/tags")
async def tags(served: ServedDep, request: Request) -> dict[str, Any]:
    """The models this server has: the one it serves."""
    return {"models": [_card(served, request)]}


@router.get("/api/ps")
async def running(served: ServedDep, request: Request) -> dict[str, Any]:
    """The models loaded: the one it serves, for the server's life."""
    return {"models": [{**_card(served, request), "expires_at": "9999-12-31T23:59:59Z", "size_vram": 0,
                        "context_length": served.context_length}]}


@router.get("/api/version")
async def version() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return {"version": package_version("glasslm")}
    except PackageNotFoundError:
        return {"version": "0.0.0"}


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str = Field(min_length=1)
    verbose: bool | None = None


@router.post("/api/show")
async def show(body: ShowRequest, served: ServedDep, request: Request) -> dict[str, Any]:
    """The model's template, details, shape and capabilities ("tools" where its template renders them)."""
    _model(served, body.model)
    c = served.model.config
    template = served.chat_template or ""
    tools = bool(template) and ChatFormat(template, {}).renders_tools
    return {"modelfile": "", "parameters": "", "template": template, "details": _details(served),
            "modified_at": _card(served, request)["modified_at"],
            "model_info": {"general.architecture": _details(served)["family"], "general.parameter_count":
                           sum(p.numel() for p in served.model.parameters()), "context_length": c.context_length,
                           "embedding_length": c.d_model, "block_count": c.n_layers},
            "capabilities": ["completion"] + (["tools"] if tools else [])}
