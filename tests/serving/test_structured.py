"""Structured outputs and tool calls through the real `openai` client: `chat.completions.parse` with a
pydantic model (every sampled answer at temperature 1 valid), a tool-call round trip through a
Hermes-style chat template (whole and streamed), and the 400s naming the field for malformed schemas,
unsupported grammar features and tools on a template that cannot show them."""

from __future__ import annotations

import concurrent.futures
import json
from typing import Literal

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")

from pydantic import BaseModel, ConfigDict, Field  # noqa: E402

from glasslm.core.model import TransformerLM  # noqa: E402
from glasslm.presets import get_preset  # noqa: E402
from glasslm.serving.app import create_app  # noqa: E402
from glasslm.serving.config import ServeConfig  # noqa: E402
from glasslm.serving.server import serving_in_thread  # noqa: E402
from glasslm.tokenizers import CharTokenizer  # noqa: E402
from glasslm.tokenizers.chat import render_chat  # noqa: E402
from tests.serving.test_chat_api import _post as post  # noqa: E402  (status and JSON of a chat request)

# Qwen2.5's tool calling, in small: the tools as JSON in a system turn, calls as <tool_call> JSON lines.
HERMES = ("{% if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n"
          "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
          "<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>"
          "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: "
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
ASK = [{"role": "user", "content": "weather in paris?"}]


class City(BaseModel):  # each value bounded, so that even a random model's answer ends within max_tokens
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=12)
    population: int = Field(ge=0, le=10**7)
    climate: Literal["hot", "cold", "mild"]
    rivers: list[Literal["seine", "loire", "rhone"]] = Field(max_length=2)
    capital: bool


def char_model(template: str):
    chars = sorted(set("".join(chr(c) for c in range(32, 127)) + "\n"))
    tok = CharTokenizer(chars, special_tokens=["<|im_start|>", "<|im_end|>"])  # <|im_end|>: eos (the last special)
    torch.manual_seed(0)
    model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=tok.vocab_size, n_layers=2, d_model=32,
                                     n_heads=4, context_length=1024)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model, tok


@pytest.fixture(scope="module")
def served():
    model, tok = char_model(HERMES)
    app = create_app(model, tok, ServeConfig(name="tiny", max_batch=16, max_queue=128), chat_template=HERMES)
    with serving_in_thread(app) as url:
        yield url, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), tok


def test_parse_returns_a_valid_object_for_every_sampled_answer(served):
    _, client, _ = served

    def one(seed: int) -> City:
        reply = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "paris"}],
                                              response_format=City, temperature=1.0, seed=seed, max_tokens=300)
        assert reply.choices[0].finish_reason == "stop"
        return reply.choices[0].message.parsed

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        cities = list(pool.map(one, range(100)))
    assert all(isinstance(city, City) for city in cities)  # parse validated each answer against the model
    assert len({city.model_dump_json() for city in cities}) > 50  # sampled answers, not one repeated


def test_json_object_and_json_schema_without_strict(served):
    _, client, _ = served
    reply = client.chat.completions.create(model="tiny", messages=ASK, response_format={"type": "json_object"},
                                           max_tokens=300, temperature=0.7, seed=3)
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4}
    reply = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=100, seed=4, response_format={
        "type": "json_schema", "json_schema": {"name": "digits", "schema": schema}})
    digits = json.loads(reply.choices[0].message.content)
    assert 2 <= len(digits) <= 4 and all(isinstance(d, int) and 0 <= d <= 9 for d in digits)


def test_a_tool_call_round_trip(served):
    _, client, tok = served
    first = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, CLOCK], max_tokens=200,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(arguments) == {"city", "unit"} and arguments["unit"] in "cf"
    assert len(arguments["city"]) <= 12
    answered = ASK + [choice.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 c"}]
    second = client.chat.completions.create(model="tiny", messages=answered, tools=[WEATHER, CLOCK], max_tokens=5,
                                            temperature=0)
    # The second prompt is the template rendering the call the model made (arguments as an object) and the result.
    rendered = render_chat(HERMES, [ASK[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        answered[-1]], add_generation_prompt=True, tools=[WEATHER, CLOCK])
    assert second.usage.prompt_tokens == len(tok.encode(rendered))
    assert second.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_required_tool_calls_stream_as_tool_call_deltas(served):
    _, client, _ = served
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required",
                                                 max_tokens=200, seed=1, stream=True))
    calls = [c for chunk in chunks for c in (chunk.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert set(json.loads(calls[0].function.arguments)) == {"city", "unit"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)  # the call was never shown as text
    whole = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required",
                                           max_tokens=200, seed=1)
    assert whole.choices[0].message.tool_calls[0].function.arguments == calls[0].function.arguments


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.mark.parametrize("fields,param", [
    ({"response_format": schema_format({"type": "no-such-type"})}, "response_format.json_schema.schema"),
    ({"response_format": schema_format({"type": "string", "pattern": "(?<=a)b"})}, "response_format.json_schema.schema"),
    ({"response_format": schema_format({"$ref": "#/$defs/missing"})}, "response_format.json_schema.schema"),
    ({"response_format": schema_format({"type": "string", "format": "no-such-format"})},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": schema_format([1])}, "response_format.json_schema.schema"),
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}]}, "messages.1.tool_calls.0.function.arguments"),
])
def test_malformed_schemas_and_tools_are_a_400_naming_the_field(served, fields, param):
    status, reply = post(served[0], {"messages": ASK, "max_tokens": 8, **fields})
    assert status == 400 and reply["error"]["param"] == param, reply
    assert reply["error"]["message"].startswith(param), reply


def test_a_template_that_cannot_show_tools_refuses_them_by_name():
    model, tok = char_model(PLAIN)
    with serving_in_thread(create_app(model, tok, chat_template=PLAIN)) as url:
        status, reply = post(url, {"messages": ASK, "tools": [WEATHER], "max_tokens": 4})
        assert status == 400 and reply["error"]["param"] == "tools" and "does not show" in reply["error"]["message"]
        status, reply = post(url, {"messages": ASK, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 4})
        assert status == 200 and reply["choices"][0]["message"]["content"] is not None  # "none": no tools needed
