"""Tool calls: OpenAI's `tools` shown to the model through its chat template, and its answer read back
as `tool_calls`.

The template renders the tools (transformers' `apply_chat_template(..., tools=...)` passes the same
list), so the model sees them in the words it was trained on. A template that never reads `tools`
cannot show them: such a request is a 400 naming `tools`. How a model writes a call depends on its
training; `ToolFormat.of(template)` reads it off the template's own text:

- `hermes` (Qwen2.5/3, Hermes, SmolLM3 and most open models): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- `llama3` (Llama 3.1-3.3's JSON tool calling): a bare `{"name": ..., "parameters": {...}}`;
- `json`: any other template that reads `tools`: a bare `{"name": ..., "arguments": {...}}`.

With `tool_choice: "auto"` the model writes freely and calls are parsed out of its answer. With
`"required"` or a named function the answer is decoded under a grammar (`glasslm.generation.constrained`)
that admits exactly that format, with each tool's `parameters` schema for its arguments, so the call
always parses and its arguments always fit the schema.

Example:
    >>> fmt = ToolFormat.of("{% for t in tools %}{{ t | tojson }}{% endfor %}<tool_call>")
    >>> fmt.name
    'hermes'
    >>> content, calls = fmt.parse('Sure.<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>')
    >>> content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    ('Sure.', [('f', '{"x": 1}')])
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from glasslm.generation.constrained import JSON_OPTIONS
from glasslm.serving.schemas import BadRequest


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionSpec(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object; None: no arguments
    strict: bool | None = None


class Tool(_Strict):
    """OpenAI's `{"type": "function", "function": {...}}`."""

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: call this one."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes a call: the text around its JSON, and the key its arguments go under."""

    name: str
    open: str  # before the call's JSON object
    close: str  # after it
    arguments_key: str  # "arguments" or "parameters"

    @classmethod
    def of(cls, template: str) -> ToolFormat:
        """The format the template teaches (see the module docstring)."""
        if "<tool_call>" in template:
            return cls("hermes", "<tool_call>\n", "\n</tool_call>", "arguments")
        if "<|python_tag|>" in template or '"parameters"' in template:
            return cls("llama3", "", "", "parameters")
        return cls("json", "", "", "arguments")

    def lark(self, tools: list[Tool], several: bool) -> str:
        """A Lark grammar (llguidance's, with `%json`) admitting one call of one of `tools` (or several,
        one per line), each the call object with that tool's `parameters` schema for its arguments."""
        options = [{"type": "object", "additionalProperties": False, "required": ["name", self.arguments_key],
                    "properties": {"name": {"const": tool.function.name},
                                   self.arguments_key: tool.function.parameters or {"type": "object"}}}
                   for tool in tools]
        schema = {"anyOf": options, "x-guidance": JSON_OPTIONS}  # compact JSON, as response_format's
        call = f"{json.dumps(self.open)} %json {json.dumps(schema)} {json.dumps(self.close)}"
        more = ' ("\\n" call)*' if several else ""  # further calls, one per line
        return f"start: call{more}\ncall: {call}\n"

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(the text around the calls, or None if nothing else; OpenAI's `tool_calls`) of an answer."""
        if self.open:
            pattern = re.escape(self.open.strip()) + r"\s*(\{.*?\})\s*" + re.escape(self.close.strip())
            found = [(m.span(), m.group(1)) for m in re.finditer(pattern, text, re.DOTALL)]
        else:
            found = _json_objects(text)
        calls, rest, at = [], [], 0
        for (start, end), body in found:
            call = self._call(body)
            if call is None:
                continue
            calls.append(call)
            rest.append(text[at:start])
            at = end
        content = ("".join(rest) + text[at:]).strip()
        return (content or None) if calls else text, calls

    def _call(self, body: str) -> dict[str, Any] | None:
        """OpenAI's tool call for one JSON object, or None if it is no call in this format."""
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get(self.arguments_key, value.get("arguments", {}))
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": value["name"], "arguments": json.dumps(arguments)}}

    def could_start(self, text: str) -> bool:
        """Whether an answer beginning with `text` may still turn out to be a call (streaming holds it back)."""
        head = text.lstrip()
        opening = self.open.strip() or "{"
        return head.startswith(opening) or opening.startswith(head)


def _json_objects(text: str) -> list[tuple[tuple[int, int], str]]:
    """The top-level JSON objects in `text`, with their spans (a call format without tags)."""
    decoder, found, at = json.JSONDecoder(), [], 0
    while (start := text.find("{", at)) >= 0:
        try:
            _, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            at = start + 1
            continue
        found.append(((start, end), text[start:end]))
        at = end
    return found


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: an assistant's earlier `tool_calls` with their `arguments`
    as objects (OpenAI sends them as JSON text; templates write them with `tojson`)."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls is not None:
            message = {**message, "tool_calls": [_template_call(call, f"messages.{i}.tool_calls.{k}")
                                                 for k, call in enumerate(_list(calls, f"messages.{i}.tool_calls"))]}
        out.append(message)
    return out


def _list(value: Any, field: str) -> list[Any]:
    if not isinstance(value, list):
        raise BadRequest(f"{field}: must be a list", field)
    return value


def _template_call(call: Any, field: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise BadRequest(f"{field}: a tool call is {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}",
                         field)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise BadRequest(f"{field}.function.arguments: not JSON text", f"{field}.function.arguments") from None
    return {**call, "function": {**function, "arguments": arguments}}
