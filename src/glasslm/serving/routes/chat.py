"""OpenAI's chat API: POST /v1/chat/completions, whole or streamed as `chat.completion.chunk` events.

The messages are rendered with the model's own chat template (`glasslm.tokenizers.chat`, the
rendering transformers' `apply_chat_template` does) and the prompt is decoded by the app's
`Engine` like any completion, stopping at the model's eos ids. A server without a template
answers 400 saying how to give one (`glasslm serve --chat-template FILE`).

Example:
    >>> from fastapi import FastAPI
    >>> app = FastAPI()
    >>> app.include_router(router)
    >>> sorted(app.openapi()["paths"])
    ['/v1/chat/completions']
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from glasslm.generation.engine import Job, Overloaded, Sampling, ShuttingDown
from glasslm.serving.context import Served, ServedDep
from glasslm.serving.errors import error_response
from glasslm.serving.schemas import BadRequest, StreamOptions, finite_number, stop_strings
from glasslm.tokenizers.chat import ChatTemplateError, chat_prompt

router = APIRouter()

NO_TEMPLATE = ("this model has no chat template, so messages cannot be rendered: start the server with "
               "`glasslm serve --chat-template FILE` (a Jinja template, as in transformers' chat_template), "
               "or use /v1/completions with your own prompt")


class ChatRequest(BaseModel):
    """OpenAI's POST /v1/chat/completions body; `top_k`, `min_p` and `ignore_eos` are extensions (as vLLM's)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # 0: off
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # 0: off
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # go on past the model's end-of-sequence tokens
    # OpenAI fields accepted only at the value that means "not used":
    n: int = Field(1, ge=1, le=1)
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0)
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0)
    user: str | None = None

    _finite = field_validator("temperature")(finite_number)
    _stops = field_validator("stop")(stop_strings)

    @field_validator("top_logprobs")
    @classmethod
    def _logprobs_asked(cls, v: int | None, info: ValidationInfo) -> int | None:
        # A field validator (logprobs is declared first, so it is in info.data): the 400 names the field.
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return v

    def sampling(self, max_tokens: int) -> Sampling:
        return Sampling(max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k or None,
                        top_p=self.top_p if self.top_p < 1.0 else None, min_p=self.min_p or None, seed=self.seed,
                        stop=tuple(self.stop or ()), logprobs=(self.top_logprobs or 0) if self.logprobs else None)


def plain_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with OpenAI's content parts ([{"type": "text", "text": ...}]) joined into text."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts are supported", f"messages.{i}.content")
            message = {**message, "content": "".join(p["text"] for p in content)}
        out.append(message)
    return out


def _prompt_ids(body: ChatRequest, served: Served) -> list[int]:
    if served.chat_template is None:
        raise BadRequest(NO_TEMPLATE, "messages")
    try:
        text = chat_prompt(served.chat_template, plain_messages(body.messages), served.tokenizer)
    except ChatTemplateError as err:
        raise BadRequest(f"messages: {err}", "messages") from None
    except (TypeError, ValueError, KeyError, AttributeError) as err:  # a template meeting content it did not expect
        raise BadRequest(f"messages: the chat template could not render these messages ({err})", "messages") from None
    vocab = served.model.config.vocab_size
    if body.top_logprobs is not None and body.top_logprobs > vocab:
        raise BadRequest(f"top_logprobs: {body.top_logprobs} is more than the vocabulary's {vocab} tokens",
                         "top_logprobs")
    return served.encode(text, what="messages")


def _max_tokens(body: ChatRequest, served: Served, prompt_length: int) -> int:
    """The request's limit, else what is left of the context (as vLLM does), within the server's limit."""
    limit = served.config.max_tokens_limit
    asked = body.max_completion_tokens or body.max_tokens
    if asked is None:
        return max(1, min(limit, served.context_length - prompt_length))
    if asked > limit:
        field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        raise BadRequest(f"{field}: {asked} is more than this server's limit {limit}", field)
    return asked


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request, served: ServedDep) -> Any:
    if body.model is not None and body.model != served.name:
        return error_response(404, f"model {body.model!r} not found; this server serves {served.name!r}",
                              "not_found", "model")
    prompt = _prompt_ids(body, served)
    job = Job(prompt, body.sampling(_max_tokens(body, served, len(prompt))), served.tokenizer,
              asyncio.get_running_loop(), stop_tokens=frozenset() if body.ignore_eos else served.eos,
              id=f"chatcmpl-{uuid.uuid4().hex[:24]}")
    try:
        served.engine.submit(job)
    except Overloaded as err:
        return error_response(429, str(err), "overloaded")
    except ShuttingDown as err:
        return error_response(503, str(err), "unavailable")
    if body.stream:
        return StreamingResponse(_stream(job, body, served), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        events = await _collect(job, request)
    finally:
        job.cancelled.set()
    if events is None or "error" in events[-1]:
        message = "client disconnected" if events is None else events[-1]["error"]
        return error_response(500, message, "server_error")
    return _completion(job, body, served, events)


def _token_logprobs(events: list[dict[str, Any]], tokenizer: Any) -> dict[str, Any]:
    """OpenAI's chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(e["token"], e["logprob"]),
                         "top_logprobs": [entry(t, lp) for t, lp in e.get("top", [])]} for e in events]}


def _usage(job: Job) -> dict[str, int]:
    return {"prompt_tokens": len(job.prompt), "completion_tokens": len(job.generated),
            "total_tokens": len(job.prompt) + len(job.generated)}


def _completion(job: Job, body: ChatRequest, served: Served, events: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = [e for e in events if "token" in e]
    choice = {"index": 0, "message": {"role": "assistant", "content": "".join(e["text"] for e in events)},
              "logprobs": _token_logprobs(tokens, served.tokenizer) if body.logprobs else None,
              "finish_reason": job.finish_reason}
    return {"id": job.id, "object": "chat.completion", "created": int(job.created), "model": served.name,
            "choices": [choice], "usage": _usage(job)}


async def _collect(job: Job, request: Request) -> list[dict[str, Any]] | None:
    """Every event of the job up to its finish (or error); None if the client went away first."""
    events: list[dict[str, Any]] = []
    checked = time.monotonic()
    while True:
        try:
            event = await asyncio.wait_for(job.events.get(), timeout=0.25)
        except asyncio.TimeoutError:
            event = None
        if time.monotonic() - checked > 0.25:  # tokens may flow without pause: look by the clock
            checked = time.monotonic()
            if await request.is_disconnected():
                return None
        if event is not None:
            events.append(event)
            if "finish_reason" in event or "error" in event:
                return events


def _chunk(job: Job, served: Served, delta: dict[str, Any], finish: str | None = None,
           logprobs: dict[str, Any] | None = None) -> str:
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    payload = {"id": job.id, "object": "chat.completion.chunk", "created": int(job.created),
               "model": served.name, "choices": [choice]}
    return f"data: {json.dumps(payload)}\n\n"


async def _stream(job: Job, body: ChatRequest, served: Served) -> AsyncIterator[str]:
    """Server-sent events: the role first, then content deltas, then finish_reason (and usage), then [DONE]."""
    try:
        yield _chunk(job, served, {"role": "assistant", "content": ""})
        while True:
            event = await job.events.get()
            if "error" in event:
                error = {"message": event["error"], "type": "server_error", "param": None, "code": 500}
                yield f"data: {json.dumps({'error': error})}\n\n"
                return
            logprobs = _token_logprobs([event], served.tokenizer) if body.logprobs and "token" in event else None
            if event["text"] or logprobs is not None:
                yield _chunk(job, served, {"content": event["text"]}, logprobs=logprobs)
            if "finish_reason" in event:
                yield _chunk(job, served, {}, event["finish_reason"])
                break
        if body.stream_options is not None and body.stream_options.include_usage:
            usage = {"id": job.id, "object": "chat.completion.chunk", "created": int(job.created),
                     "model": served.name, "choices": [], "usage": _usage(job)}
            yield f"data: {json.dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()  # a no-op once finished; otherwise the client went away
