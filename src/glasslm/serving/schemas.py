"""The request and response shapes of `glasslm serve`: OpenAI's completions API and the explorer's.

Requests are pydantic models that refuse unknown fields, so a typo ("max_token") is an error
rather than a silently ignored setting. OpenAI fields glasslm does not implement are accepted only
at their neutral values (n=1, echo=false, penalties 0, ...), so clients that send the defaults
explicitly still work. The functions at the end turn a `Job`'s events into OpenAI's response
shapes. Needs the `serve` extra (fastapi, uvicorn).

Example:
    >>> CompletionRequest(prompt="ROMEO:", max_tokens=8, top_k=5).sampling()
    Sampling(max_tokens=8, temperature=1.0, top_k=5, top_p=None, min_p=None, seed=None, stop=(), logprobs=None)
    >>> CompletionRequest(max_token=8)
    Traceback (most recent call last):
    ...
    pydantic_core._pydantic_core.ValidationError: 1 validation error for CompletionRequest
    ...
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from glasslm.generation.engine import Job, Sampling


class BadRequest(ValueError):
    """A request the server understood but cannot serve (HTTP 400 with this message)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class CompletionRequest(_Strict):
    """OpenAI's POST /v1/completions body; `top_k`, `min_p` and `return_token_ids` are extensions."""

    model: str | None = None
    prompt: str | list[int] | list[str] = ""
    max_tokens: int = Field(16, ge=0)  # OpenAI's default
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # 0: off
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # 0: off
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # each choice also carries the generated token ids
    # OpenAI fields accepted only at the value that means "not used":
    n: int = Field(1, ge=1, le=1)
    best_of: int | None = Field(None, ge=1, le=1)
    echo: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None
    user: str | None = None

    @field_validator("temperature")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 8 or any(not s for s in stops):
            raise ValueError("give at most 8 stop strings, none empty")
        return stops

    @model_validator(mode="after")
    def _unsupported(self) -> "CompletionRequest":
        for name, neutral in (("echo", False), ("frequency_penalty", 0.0), ("presence_penalty", 0.0),
                              ("suffix", None)):
            if getattr(self, name) != neutral:
                raise ValueError(f"{name} is not supported by glasslm serve (leave it at {neutral!r})")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by glasslm serve")
        return self

    def sampling(self) -> Sampling:
        return Sampling(
            max_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k or None,
            top_p=self.top_p if self.top_p < 1.0 else None, min_p=self.min_p or None, seed=self.seed,
            stop=tuple(self.stop or ()), logprobs=self.logprobs,
        )


class TextRequest(_Strict):
    """An explorer request about one text: `text`, or `tokens` (ids) to skip encoding."""

    text: str | None = None
    tokens: list[int] | None = None

    def ids(self, encode: Callable[[Any], list[int]]) -> list[int]:
        if (self.text is None) == (self.tokens is None):
            raise BadRequest("give exactly one of text and tokens")
        if self.text == "":
            raise BadRequest("text: the text is empty", "text")
        return encode(self.text if self.text is not None else self.tokens)


class NextTokenRequest(TextRequest):
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_k: int = Field(0, ge=0)  # 0: off
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    k: int = Field(10, ge=1, le=100)  # how many tokens to list


class AttentionRequest(TextRequest):
    layer: int = Field(0, ge=0)
    head: int | None = Field(None, ge=0)  # None: every head of the layer


def describe_validation_error(problem: dict[str, Any]) -> str:
    """One readable line for a pydantic/FastAPI validation problem."""
    kind, message = problem.get("type", ""), str(problem.get("msg", "invalid request"))
    if kind == "extra_forbidden":
        return "unknown field (see docs/serving.md for the fields glasslm serve accepts)"
    if kind == "json_invalid":
        return f"the request body is not valid JSON ({problem.get('ctx', {}).get('error', message)})"
    if kind == "missing" and tuple(problem.get("loc", ())) == ("body",):
        return "the request needs a JSON body"
    return message.removeprefix("Value error, ")


# --- turning a job's events into OpenAI responses ------------------------------------------------

def _logprobs(events: list[dict[str, Any]], tokenizer: Any) -> dict[str, Any]:
    return {
        "tokens": [tokenizer.decode([e["token"]]) for e in events],
        "token_logprobs": [e["logprob"] for e in events],
        "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in e["top"]} for e in events],
        "text_offset": [e["offset"] for e in events],
    }


def _usage(job: Job) -> dict[str, int]:
    return {"prompt_tokens": len(job.prompt), "completion_tokens": len(job.generated),
            "total_tokens": len(job.prompt) + len(job.generated)}


def _chunk(job: Job, name: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"id": job.id, "object": "text_completion", "created": int(job.created), "model": name,
            "choices": choices, **extra}


async def stream_chunks(job: Job, body: CompletionRequest, name: str, tokenizer: Any) -> AsyncIterator[dict]:
    """Server-sent event payloads: one chunk per token, a last one with finish_reason, maybe usage."""
    while True:
        event = await job.events.get()
        if "error" in event:
            yield {"error": {"message": event["error"], "type": "server_error", "param": None, "code": 500}}
            return
        choice: dict[str, Any] = {"index": 0, "text": event["text"], "logprobs": None,
                                  "finish_reason": event.get("finish_reason")}
        if "token" in event:
            if body.logprobs is not None:
                choice["logprobs"] = _logprobs([event], tokenizer)
            if body.return_token_ids:
                choice["token_ids"] = [event["token"]]
        yield _chunk(job, name, [choice])
        if "finish_reason" in event:
            break
    if body.stream_options is not None and body.stream_options.include_usage:
        yield _chunk(job, name, [], usage=_usage(job))


async def collect(job: Job, body: CompletionRequest, name: str, tokenizer: Any, request: Any) -> dict[str, Any]:
    """The whole completion as one response; gives up (cancelling the job) if the client leaves."""
    text, tokens = [], []
    checked = time.monotonic()
    while True:
        try:
            event = await asyncio.wait_for(job.events.get(), timeout=0.25)
        except asyncio.TimeoutError:
            event = None
        if time.monotonic() - checked > 0.25:  # tokens may flow without pause: look by the clock
            checked = time.monotonic()
            if await request.is_disconnected():
                job.cancelled.set()
                return {"error": {"message": "client disconnected"}}
        if event is None:
            continue
        if "error" in event:
            return {"error": {"message": event["error"]}}
        text.append(event["text"])
        if "token" in event:
            tokens.append(event)
        if "finish_reason" in event:
            break
    choice: dict[str, Any] = {"index": 0, "text": "".join(text), "finish_reason": job.finish_reason,
                              "logprobs": _logprobs(tokens, tokenizer) if body.logprobs is not None else None}
    if body.return_token_ids:
        choice["token_ids"] = [e["token"] for e in tokens]
    return _chunk(job, name, [choice], usage=_usage(job))
