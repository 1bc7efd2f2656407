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
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field, ValidationInfo, field_validator

from glasslm.generation.engine import Job, Overloaded, ShuttingDown
from glasslm.serving.context import Served, ServedDep
from glasslm.serving.errors import error_response
from glasslm.serving.events import gather, server_sent
from glasslm.serving.schemas import BadRequest, SamplingFields, error_event
from glasslm.tokenizers.chat import ChatTemplateError, chat_prompt

router = APIRouter()

NO_TEMPLATE = ("this model has no chat template, so messages cannot be rendered: start the server with "
               "`glasslm serve --chat-template FILE` (a Jinja template, as in transformers' chat_template), "
               "or use /v1/completions with your own prompt")


class ChatRequest(SamplingFields):
    """OpenAI's POST /v1/chat/completions body, with `SamplingFields`' extensions (as vLLM's).

    Fields OpenAI clients send that change nothing here are accepted at the value that means so:
    `response_format` {"type": "text"}, `tools` [], `tool_choice` null or "none", `store` false,
    and `metadata` (kept nowhere: glasslm stores no conversations).
    """

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None  # {"type": "text"} only
    tools: list[dict[str, Any]] | None = None  # [] only: glasslm calls no tools
    tool_choice: str | dict[str, Any] | None = None  # null or "none" only
    metadata: dict[str, str] | None = None  # accepted; nothing is stored, so it changes nothing
    store: bool | None = None  # false or null only

    @field_validator("top_logprobs")
    @classmethod
    def _logprobs_asked(cls, v: int | None, info: ValidationInfo) -> int | None:
        # A field validator (logprobs is declared first, so it is in info.data): the 400 names the field.
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v != {"type": "text"}:
            raise ValueError('only {"type": "text"} is supported (glasslm serve does not constrain output to JSON)')
        return v

    @field_validator("tools", "tool_choice", "store")
    @classmethod
    def _not_used(cls, v: Any, info: ValidationInfo) -> Any:
        if v not in (None, [], "none", False) or isinstance(v, dict):
            neutral = {"tools": "[]", "tool_choice": 'null or "none"', "store": "false"}[info.field_name]
            raise ValueError(f"not supported by glasslm serve (leave it out, or at {neutral})")
        return v

    def alternatives(self) -> tuple[str, int | None]:
        return "top_logprobs", self.top_logprobs

    def asked_tokens(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


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
    return served.encode(text, what="messages")


def _max_tokens(body: ChatRequest, served: Served, prompt_length: int) -> int:
    """The request's limit (checked by `Served.check`), else what is left of the context (as vLLM does),
    within the server's limit."""
    asked = body.asked_tokens()[1]
    if asked is None:
        return max(1, min(served.config.max_tokens_limit, served.context_length - prompt_length))
    return asked


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request, served: ServedDep) -> Any:
    served.check(body)
    prompt = _prompt_ids(body, served)
    max_tokens = _max_tokens(body, served, len(prompt))
    top = (body.top_logprobs or 0) if body.logprobs else None
    shown, loop, events = served.shown_for(body.skip_special_tokens), asyncio.get_running_loop(), asyncio.Queue()
    chat_id, stops = f"chatcmpl-{uuid.uuid4().hex[:24]}", body.stop_tokens(served.eos)
    jobs = [Job(prompt, body.sampling(max_tokens, choice, top), shown, loop, stop_tokens=stops, id=chat_id,
                events=events, index=choice) for choice in range(body.n)]
    try:
        served.engine.submit_all(jobs)
    except Overloaded as err:
        return error_response(429, str(err), "overloaded")
    except ShuttingDown as err:
        return error_response(503, str(err), "unavailable")

    def cancel() -> None:
        for job in jobs:
            job.cancelled.set()  # a no-op once finished; otherwise the client went away

    chat = _Chat(jobs, body, served.name, shown)
    if body.stream:
        return StreamingResponse(server_sent(chat.chunks(), cancel), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        received = await gather(jobs, request)
    finally:
        cancel()
    if isinstance(received, str):
        return error_response(500, received, "server_error")
    return chat.result(received)


@dataclass
class _Chat:
    """One chat request's jobs (one per choice, sharing an event queue) and OpenAI's shapes of their events."""

    jobs: list[Job]
    body: ChatRequest
    name: str
    tokenizer: Any  # decodes as responses show text (`Served.shown_for`)

    def logprobs(self, events: list[dict[str, Any]]) -> dict[str, Any]:
        """OpenAI's chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = self.tokenizer.decode([token])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**entry(e["token"], e["logprob"]),
                             "top_logprobs": [entry(t, lp) for t, lp in e.get("top", [])]} for e in events]}

    def usage(self) -> dict[str, int]:
        """The prompt counted once; completion tokens summed over the choices."""
        prompt, completion = len(self.jobs[0].prompt), sum(len(job.generated) for job in self.jobs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def payload(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        job = self.jobs[0]
        return {"id": job.id, "object": obj, "created": int(job.created), "model": self.name, "choices": choices,
                **extra}

    def result(self, events: list[dict[str, Any]]) -> dict[str, Any]:
        """The whole answer: one choice per job."""
        choices = []
        for job in self.jobs:
            mine = [e for e in events if e["index"] == job.index]
            tokens = [e for e in mine if "token" in e]
            choices.append({"index": job.index, "finish_reason": job.finish_reason,
                            "message": {"role": "assistant", "content": "".join(e["text"] for e in mine)},
                            "logprobs": self.logprobs(tokens) if self.body.logprobs else None})
        return self.payload("chat.completion", choices, usage=self.usage())

    def chunk(self, index: int, delta: dict[str, Any], finish: str | None = None,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.payload("chat.completion.chunk", [{"index": index, "delta": delta, "logprobs": logprobs,
                                                       "finish_reason": finish}])

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """Each choice's role first, then content deltas as they come, then each one's finish_reason
        (and usage last, if asked)."""
        for job in self.jobs:
            yield self.chunk(job.index, {"role": "assistant", "content": ""})
        events, unfinished = self.jobs[0].events, len(self.jobs)
        while unfinished:
            event = await events.get()
            if "error" in event:
                yield error_event(event["error"])
                return
            logprobs = self.logprobs([event]) if self.body.logprobs and "token" in event else None
            if event["text"] or logprobs is not None:
                yield self.chunk(event["index"], {"content": event["text"]}, logprobs=logprobs)
            if "finish_reason" in event:
                unfinished -= 1
                yield self.chunk(event["index"], {}, event["finish_reason"])
        if self.body.stream_options is not None and self.body.stream_options.include_usage:
            yield self.payload("chat.completion.chunk", [], usage=self.usage())
