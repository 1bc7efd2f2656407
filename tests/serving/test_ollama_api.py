"""Ollama's API through Ollama's own Python client (`ollama`, offline, against glasslm serve): /api/chat and
/api/generate whole and streamed (NDJSON) equal to the library's generation from the rendered template,
`context` continuing an answer, `format` decoding under a schema, /api/tags, /api/show, /api/ps,
/api/version, tool calls read back as Ollama's object arguments, and the 4xx naming each bad field."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
ollama = pytest.importorskip("ollama")

from glasslm.generation import GenerationConfig, generate  # noqa: E402
from glasslm.generation.engine import Job, Sampling  # noqa: E402
from glasslm.serving.app import create_app  # noqa: E402
from glasslm.serving.config import ServeConfig  # noqa: E402
from glasslm.serving.routes.ollama import _ChatShape  # noqa: E402
from glasslm.serving.server import serving_in_thread  # noqa: E402
from glasslm.serving.tools import ToolFormat  # noqa: E402
from glasslm.tokenizers.chat import render_chat  # noqa: E402

from test_structured import HERMES, WEATHER, char_model  # noqa: E402

HI = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture(scope="module")
def served():
    model, tok = char_model(HERMES)
    app = create_app(model, tok, ServeConfig(name="tiny", max_batch=8), chat_template=HERMES)
    with serving_in_thread(app) as url:
        yield url, ollama.Client(host=url), model, tok


def library(model, tok, ids: list[int], n: int = 12) -> list[int]:
    return generate(model, [ids], GenerationConfig(max_new_tokens=n, temperature=0.0), tokenizer=tok)[0].tokens


def test_chat_whole_and_streamed_is_the_template_then_the_models_own_generation(served):
    _, client, model, tok = served
    prompt = tok.encode(render_chat(HERMES, HI, add_generation_prompt=True))
    expected = tok.decode(library(model, tok, prompt))
    whole = client.chat(model="tiny", messages=HI, options=GREEDY, stream=False)
    assert whole.message.role == "assistant" and whole.message.content == expected
    assert whole.done and whole.done_reason == "length"
    assert (whole.prompt_eval_count, whole.eval_count) == (len(prompt), 12) and whole.total_duration > 0
    parts = list(client.chat(model="tiny:latest", messages=HI, options=GREEDY, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and len(parts) > 3
    assert "".join(p.message.content for p in parts) == expected
    assert parts[-1].done_reason == "length" and parts[-1].eval_count == 12


def test_generate_renders_the_prompt_and_context_continues_it(served):
    _, client, model, tok = served
    prompt = tok.encode(render_chat(HERMES, [{"role": "user", "content": "hi"}], add_generation_prompt=True))
    first = client.generate(model="tiny", prompt="hi", options=GREEDY)
    answer = library(model, tok, prompt)
    assert first.response == tok.decode(answer) and list(first.context) == prompt + answer
    more = client.generate(model="tiny", prompt=" and", context=first.context, raw=True, options=GREEDY)
    continued = prompt + answer + tok.encode(" and")
    assert more.response == tok.decode(library(model, tok, continued))
    raw = "".join(p.response for p in client.generate(model="tiny", prompt="abc", raw=True, options=GREEDY,
                                                      stream=True))
    assert raw == tok.decode(library(model, tok, tok.encode("abc")))


def test_format_decodes_under_the_schema(served):
    _, client, _, _ = served
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    for seed in range(5):
        reply = client.chat(model="tiny", messages=HI, format=schema, options={"seed": seed, "num_predict": 60})
        value = json.loads(reply.message.content)
        assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 99 and isinstance(value["ok"], bool)
    assert isinstance(json.loads(client.generate(model="tiny", prompt="x", format="json",
                                                 options={"num_predict": 60, "seed": 1}).response), dict)


def test_tags_show_ps_and_version(served):
    _, client, model, _ = served
    [card] = client.list().models
    assert card.model == "tiny:latest" and card.size == sum(p.numel() * p.element_size() for p in model.parameters())
    shown = client.show("tiny")
    assert shown.template == HERMES and "tools" in shown.capabilities
    assert shown.modelinfo["context_length"] == model.config.context_length
    assert client.ps().models[0].context_length == model.config.context_length
    url = served[0]
    with urllib.request.urlopen(url + "/api/version", timeout=30) as response:
        assert json.loads(response.read())["version"]


def test_a_held_tool_call_comes_back_with_object_arguments(served):
    _, _, _, tok = served
    shape = _ChatShape(ToolFormat.of(HERMES))
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris", "unit": "c"}}\n</tool_call>'
    assert all(shape.holding(text[:k]) for k in range(1, len(text)))  # held back while streaming
    job = Job([1], Sampling(), tok, None)
    message = shape.last(text, job)["message"]
    reply = ollama.ChatResponse(model="tiny", message=message)  # Ollama's own model of the answer
    assert reply.message.tool_calls[0].function.name == "get_weather"
    assert reply.message.tool_calls[0].function.arguments == {"city": "paris", "unit": "c"}
    plain = _ChatShape(ToolFormat.of(HERMES))
    assert not plain.holding("Sure") and plain.last("Sure, it is", job)["message"]["content"] == "Sure, it is"


def test_tools_reach_the_template(served):
    _, client, _, tok = served
    reply = client.chat(model="tiny", messages=HI, tools=[WEATHER], options=GREEDY)
    rendered = render_chat(HERMES, HI, add_generation_prompt=True, tools=[
        ollama.Tool.model_validate(WEATHER).model_dump(exclude_none=True)])
    assert reply.prompt_eval_count == len(tok.encode(rendered))  # the tools are in the prompt


def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.parametrize("path,fields,status,param", [
    ("/api/chat", {"model": "other"}, 404, "model"),
    ("/api/chat", {"options": {"mirostat": 2}}, 400, "options.mirostat"),
    ("/api/chat", {"options": {"no_such_option": 1}}, 400, "options.no_such_option"),
    ("/api/chat", {"options": {"temperature": -1}}, 400, "options.temperature"),
    ("/api/chat", {"format": "xml"}, 400, "format"),
    ("/api/chat", {"format": {"type": "no-such-type"}}, 400, "format"),
    ("/api/chat", {"messages": [{"role": "user", "content": "a", "images": ["aGk="]}]}, 400, "messages.0.images"),
    ("/api/chat", {"think": True}, 400, "think"),
    ("/api/generate", {"suffix": "b"}, 400, "suffix"),
    ("/api/generate", {"context": [10**6]}, 400, "context"),
    ("/api/generate", {"prompt": "a" * 2000}, 400, "prompt"),
])
def test_bad_requests_name_the_field(served, path, fields, status, param):
    base = {"model": "tiny", "stream": False, "messages": HI} if path == "/api/chat" else {
        "model": "tiny", "stream": False, "prompt": "a"}
    got, reply = post(served[0], path, {**base, **fields})
    assert got == status and reply["error"]["param"] == param, reply


def test_streams_are_ndjson(served):
    request = urllib.request.Request(served[0] + "/api/generate", json.dumps(
        {"model": "tiny", "prompt": "hi", "options": GREEDY}).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in response.read().decode().splitlines()]
    assert lines[-1]["done"] and not any(line["done"] for line in lines[:-1])


def test_bodies_are_json_whatever_their_content_type_unless_a_browser_sent_them(served):
    body = json.dumps({"model": "tiny", "prompt": "hi", "stream": False, "options": GREEDY}).encode()
    form = {"Content-Type": "application/x-www-form-urlencoded"}  # what `curl -d` sends
    with urllib.request.urlopen(urllib.request.Request(served[0] + "/api/generate", body, form), timeout=60) as reply:
        assert json.loads(reply.read())["done"]
    cross_site = urllib.request.Request(served[0] + "/api/generate", body, {**form, "Origin": "https://example.com"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(cross_site, timeout=60)
    assert refused.value.code == 400
