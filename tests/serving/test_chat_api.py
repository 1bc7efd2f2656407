"""/v1/chat/completions through the real `openai` client: the text is the chat template rendered
by glasslm.tokenizers.chat, then glasslm's own generation; streaming deltas, logprobs, stop, seed,
eos stopping where transformers stops, and the 400 for a model without a template."""

import json
import urllib.error
import urllib.request

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from glasslm.core.model import TransformerLM  # noqa: E402
from glasslm.generation import GenerationConfig, generate  # noqa: E402
from glasslm.presets import get_preset  # noqa: E402
from glasslm.serving.app import create_app  # noqa: E402
from glasslm.serving.config import ServeConfig  # noqa: E402
from glasslm.serving.server import serving_in_thread  # noqa: E402
from glasslm.tokenizers import CharTokenizer  # noqa: E402
from glasslm.tokenizers.chat import render_chat  # noqa: E402

TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def served():
    tok = CharTokenizer(list("\n :abcdefghijklmnopqrstuvwxyz"))
    torch.manual_seed(0)
    model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=tok.vocab_size, n_layers=2, d_model=32,
                                     n_heads=4, context_length=64)).eval()
    app = create_app(model, tok, ServeConfig(name="tiny", max_batch=4), chat_template=TEMPLATE)
    with serving_in_thread(app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), model, tok


def reference(model, tok, messages, **controls):
    prompt = tok.encode(render_chat(TEMPLATE, messages, add_generation_prompt=True))
    return prompt, generate(model, [prompt], GenerationConfig(**controls), tokenizer=tok)[0]


def test_chat_completion_is_the_template_then_the_models_own_generation(served):
    client, model, tok = served
    prompt, expected = reference(model, tok, MESSAGES, max_new_tokens=10, temperature=0.0)
    done = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0)
    assert done.object == "chat.completion" and done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content == expected.text and done.choices[0].finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(prompt), 10)
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=10,
                                                 temperature=0, stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"  # the role first, then content, then the reason
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices[0].finish_reason == "length" and len(chunks) > 3


def test_seed_stop_and_logprobs(served):
    client, model, tok = served
    _, sampled = reference(model, tok, MESSAGES, max_new_tokens=12, temperature=1.0, seed=7)
    seeded = client.chat.completions.create(messages=MESSAGES, model="tiny", max_tokens=12, seed=7)
    assert seeded.choices[0].message.content == sampled.text
    stop = sampled.text[4:6]
    _, cut = reference(model, tok, MESSAGES, max_new_tokens=12, temperature=1.0, seed=7, stop_strings=[stop])
    stopped = client.chat.completions.create(messages=MESSAGES, model="tiny", max_tokens=12, seed=7, stop=[stop])
    assert stopped.choices[0].message.content == cut.text and stopped.choices[0].finish_reason == "stop"
    _, greedy = reference(model, tok, MESSAGES, max_new_tokens=6, temperature=0.0, logprobs=True)
    scored = client.chat.completions.create(messages=MESSAGES, model="tiny", max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=3)
    content = scored.choices[0].logprobs.content
    assert [c.token for c in content] == [tok.decode([t]) for t in greedy.tokens]
    assert [c.logprob for c in content] == pytest.approx(greedy.logprobs, abs=1e-5)
    for entry in content:  # greedy: the chosen token is the most likely one
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token


def _post(url, body):
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_no_template_and_bad_messages_are_refused_with_the_field():
    tok = CharTokenizer(list("ab"))
    model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=2, n_layers=1)).eval()
    with serving_in_thread(create_app(model, tok)) as url:
        status, body = _post(url, {"messages": [{"role": "user", "content": "a"}]})
        assert status == 400 and "--chat-template FILE" in body["error"]["message"]
    with serving_in_thread(create_app(model, tok, chat_template=TEMPLATE)) as url:
        for bad, field in (({"messages": []}, "messages"), ({"messages": [{"role": "robot", "content": "a"}]},
                                                             "messages[0].role"),
                           ({"messages": [{"role": "user", "content": "a"}], "max_tokens": 0}, "max_tokens"),
                           ({"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "logprobs"),
                           ({"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 3},
                            "top_logprobs"),
                           ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
                           ({"messages": [{"role": "user", "content": "a"}], "seed": -1}, "seed")):
            status, body = _post(url, bad)
            assert status == 400 and field in body["error"]["message"], body


@pytest.mark.slow
def test_an_imported_llama_chats_and_stops_at_its_eos_like_transformers(llama_chat):
    from glasslm.hf import load_chat_template, load_model

    directory, hf_model, hf_tok = llama_chat
    messages = [{"role": "user", "content": "hi"}]
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    out = hf_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    assert out[-1] in (2, 3) and len(out) < 16  # transformers stopped at an eos
    model, tokenizer = load_model(directory)
    app = create_app(model, tokenizer, ServeConfig(name="llama"), load_chat_template(directory, tokenizer))
    with serving_in_thread(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        done = client.chat.completions.create(model="llama", messages=messages, max_tokens=16, temperature=0)
        assert done.usage.prompt_tokens == len(ids)
        assert done.choices[0].message.content == hf_tok.decode(out[:-1])
        assert done.choices[0].finish_reason == "stop" and done.usage.completion_tokens == len(out) - 1
        more = client.chat.completions.create(model="llama", messages=messages, max_tokens=16, temperature=0,
                                              extra_body={"ignore_eos": True})
        assert more.choices[0].finish_reason == "length"
        completion = client.completions.create(model="llama", prompt="hello there", max_tokens=16, temperature=0)
        hello = tokenizer.encode("hello there")
        theirs = hf_model.generate(torch.tensor([hello]), max_new_tokens=16, do_sample=False)[0, len(hello):].tolist()
        assert completion.choices[0].text == hf_tok.decode(theirs[:-1]) and completion.choices[0].finish_reason == "stop"
