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
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field, ValidationInfo, field_validator

from glasslm.generation.constrained import GrammarError
from glasslm.generation.engine import Job, Overloaded, ShuttingDown
from glasslm.serving.context import Served, ServedDep
from glasslm.serving.errors import error_response, refused
from glasslm.serving.events import gather, server_sent
from glasslm.serving.schemas import BadRequest, SamplingFields, error_event
from glasslm.serving.structured import ResponseFormat, response_grammar, schema_grammar
from glasslm.serving.tools import NamedToolChoice, Tool, ToolChoice, ToolFormat, template_messages
from glasslm.tokenizers.chat import ChatFormat, ChatTemplateError

router = APIRouter()

NO_TEMPLATE = ("this model has no chat template, so messages cannot be rendered: start the server with "
               "`glasslm serve --chat-template FILE` (a Jinja template, as in transformers' chat_template), "
               "or use /v1/completions with your own prompt")


class ChatRequest(SamplingFields):
    """OpenAI's POST /v1/chat/completions body, with `SamplingFields`' extensions (as vLLM's).

    `response_format` (text, json_object, json_schema) decodes under a grammar (`serving.structured`);
    `tools` with `tool_choice` are shown through the chat template and answered as `tool_calls`
    (`serving.tools`). `store` is accepted at false, `metadata` kept nowhere (glasslm stores no
    conversations).
    """

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = None  # with "required": one call or several
    metadata: dict[str, str] | None = None  # accepted; nothing is stored, so it changes nothing
    store: bool | None = None  # false or null only

    @field_validator("top_logprobs")
    @classmethod
    def _logprobs_asked(cls, v: int | None, info: ValidationInfo) -> int | None:
        # A field validator (logprobs is declared first, so it is in info.data): the 400 names the field.
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tools_given(cls, v: Any, info: ValidationInfo) -> Any:
        if v not in (None, "none") and not info.data.get("tools"):
            raise ValueError("needs tools: give the tools the model may call")
        if isinstance(v, NamedToolChoice) and v.function.name not in {t.function.name for t in info.data["tools"]}:
            raise ValueError(f"names {v.function.name!r}, which is not among the tools")
        return v

    @field_validator("store")
    @classmethod
    def _not_stored(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("not supported by glasslm serve (leave it out, or at false)")
        return v

    def choice(self) -> ToolChoice:
        """The tool choice in force: "none" without tools, "auto" by default with them."""
        if not self.tools:
            return "none"
        return self.tool_choice or "auto"

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


NO_TOOLS = ("tools: this model's chat template does not show the model any tools (it never reads `tools`), "
            "so it cannot be asked to call them; start the server with `--chat-template FILE` giving a template that "
            "renders tools, or leave tools out")


@dataclass
class ChatPlan:
    """What a chat request decodes: the prompt's ids, the grammar it follows (or None), and the tool-call
    format its answer is read with (None: no tools in play)."""

    prompt: list[int]
    grammar: Any
    tools: ToolFormat | None


@dataclass
class AnswerFormat:
    """A JSON format asked of the answer: the field that asked (for its 400s) and how to compile it."""

    field: str
    grammar: Callable[[], Any]


def plan_chat(served: Served, messages: list[dict[str, Any]], tools: list[Tool] | None = None,
              choice: ToolChoice = "none", parallel: bool = False, answer: AnswerFormat | None = None) -> ChatPlan:
    """Render `messages` (with `tools` unless `choice` is "none") through the model's chat template; the
    grammar of a forced tool call or of `answer`'s JSON format. Shared by OpenAI's and Ollama's chat."""
    if served.chat_template is None:
        raise BadRequest(NO_TEMPLATE, "messages")
    chat = ChatFormat.for_tokenizer(served.chat_template, served.tokenizer)
    variables, tool_format = {}, None
    if choice != "none":
        if not chat.renders_tools:
            raise BadRequest(NO_TOOLS, "tools")
        if answer is not None:
            raise BadRequest(f"{answer.field}: give either tools or a JSON {answer.field}, not both", answer.field)
        variables["tools"] = [tool.model_dump(exclude_none=True) for tool in tools]
        tool_format = ToolFormat.of(served.chat_template)
    messages = template_messages(plain_messages(messages))
    try:
        text = chat.prompt(messages, **variables)
    except ChatTemplateError as err:
        raise BadRequest(f"messages: {err}", "messages") from None
    except (TypeError, ValueError, KeyError, AttributeError) as err:  # a template meeting content it did not expect
        raise BadRequest(f"messages: the chat template could not render these messages ({err})", "messages") from None
    if tool_format is not None:
        grammar = _tool_grammar(served, tools, choice, parallel, tool_format)
    else:
        grammar = None if answer is None else answer.grammar()
    return ChatPlan(served.encode(text, what="messages"), grammar, tool_format)


def _tool_grammar(served: Served, tools: list[Tool], choice: ToolChoice, parallel: bool, tool_format: ToolFormat) -> Any:
    """The grammar of a forced call ("required", or a named function); None for "auto". Each tool's
    `parameters` schema is checked either way, so a malformed one is a 400 naming it."""
    grammars = served.grammars("tools")
    for i, tool in enumerate(tools):
        if tool.function.parameters is not None:
            schema_grammar(tool.function.parameters, grammars, f"tools.{i}.function.parameters")
    if choice == "auto":
        return None
    chosen = tools if choice == "required" else [t for t in tools if t.function.name == choice.function.name]
    try:
        return grammars.lark(tool_format.lark(chosen, several=choice == "required" and parallel))
    except GrammarError as err:
        raise BadRequest(f"tools: {err}", "tools") from None


def _plan(body: ChatRequest, served: Served) -> ChatPlan:
    fmt = body.response_format
    answer = None if fmt is None or fmt.type == "text" else AnswerFormat(
        "response_format", lambda: response_grammar(fmt, served.grammars("response_format")))
    return plan_chat(served, body.messages, body.tools, body.choice(), bool(body.parallel_tool_calls), answer)


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
    plan = _plan(body, served)
    prompt = plan.prompt
    max_tokens = _max_tokens(body, served, len(prompt))
    top = (body.top_logprobs or 0) if body.logprobs else None
    shown, loop, events = served.shown_for(body.skip_special_tokens), asyncio.get_running_loop(), asyncio.Queue()
    chat_id, stops = f"chatcmpl-{uuid.uuid4().hex[:24]}", body.stop_tokens(served.eos)
    jobs = [Job(prompt, body.sampling(max_tokens, choice, top, grammar=plan.grammar), shown, loop, stop_tokens=stops,
                id=chat_id, events=events, index=choice) for choice in range(body.n)]
    try:
        served.engine.submit_all(jobs)
    except (Overloaded, ShuttingDown) as err:
        return refused(err, served.engine)

    def cancel() -> None:
        for job in jobs:
            job.cancelled.set()  # a no-op once finished; otherwise the client went away

    chat = _Chat(jobs, body, served.name, shown, plan.tools)
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
    tools: ToolFormat | None = None  # how tool calls are read from an answer (None: no tools in play)

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

    def message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """(the assistant message, the finish reason) of a choice's whole text: tool calls read out of it
        where tools are in play ("tool_calls" then ends it)."""
        if self.tools is not None:
            content, calls = self.tools.parse(text)
            if calls:
                return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
        return {"role": "assistant", "content": text}, finish

    def result(self, events: list[dict[str, Any]]) -> dict[str, Any]:
        """The whole answer: one choice per job."""
        choices = []
        for job in self.jobs:
            mine = [e for e in events if e["index"] == job.index]
            tokens = [e for e in mine if "token" in e]
            message, finish = self.message("".join(e["text"] for e in mine), job.finish_reason)
            choices.append({"index": job.index, "finish_reason": finish, "message": message,
                            "logprobs": self.logprobs(tokens) if self.body.logprobs else None})
        return self.payload("chat.completion", choices, usage=self.usage())

    def chunk(self, index: int, delta: dict[str, Any], finish: str | None = None,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.payload("chat.completion.chunk", [{"index": index, "delta": delta, "logprobs": logprobs,
                                                       "finish_reason": finish}])

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """Each choice's role first, then content deltas as they come, then each one's finish_reason
        (and usage last, if asked). Where tools are in play, text that may be a call is held back until
        the choice ends, then sent as `tool_calls` (or as content, if it was none)."""
        for job in self.jobs:
            yield self.chunk(job.index, {"role": "assistant", "content": ""})
        events, unfinished = self.jobs[0].events, len(self.jobs)
        held: dict[int, str | None] = {job.index: "" if self.tools is not None else None for job in self.jobs}
        while unfinished:
            event = await events.get()
            if "error" in event:
                yield error_event(event["error"])
                return
            index, text, finish = event["index"], event["text"], event.get("finish_reason")
            logprobs = self.logprobs([event]) if self.body.logprobs and "token" in event else None
            if held[index] is not None:
                held[index] += text
                if finish is None and self.tools.could_start(held[index]):
                    continue
                text, held[index] = held[index], None
                if finish is not None:
                    message, finish = self.message(text, finish)
                    if "tool_calls" in message:
                        yield self.chunk(index, _call_deltas(message))
                        text = ""
            if text or logprobs is not None:
                yield self.chunk(index, {"content": text}, logprobs=logprobs)
            if finish is not None:
                unfinished -= 1
                yield self.chunk(index, {}, finish)
        if self.body.stream_options is not None and self.body.stream_options.include_usage:
            yield self.payload("chat.completion.chunk", [], usage=self.usage())


def _call_deltas(message: dict[str, Any]) -> dict[str, Any]:
    """A streamed delta carrying a message's whole tool calls (OpenAI's shape, each with its `index`)."""
    return {"content": message["content"], "tool_calls": [{"index": k, **call}
                                                          for k, call in enumerate(message["tool_calls"])]}
