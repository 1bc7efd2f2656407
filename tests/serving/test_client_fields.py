"""What OpenAI and vLLM clients send, through the real `openai` client where it has the field: each field
glasslm honours changes the answer exactly as its definition says (checked against the model's own
logits, `generate`, or requests without it), each it cannot honour is a 400 naming it, and every
numeric field out of range is a 400 naming it before any work. lm-eval's remote tokenizer reads
/tokenizer_info, /tokenize and /detokenize."""

import json
import urllib.request

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from glasslm.core.model import TransformerLM  # noqa: E402
from glasslm.generation import generate  # noqa: E402
from glasslm.presets import get_preset  # noqa: E402
from glasslm.serving.app import create_app  # noqa: E402
from glasslm.serving.config import ServeConfig  # noqa: E402
from glasslm.serving.server import serving_in_thread  # noqa: E402
from glasslm.tokenizers import CharTokenizer  # noqa: E402

from test_serve import call  # noqa: E402

TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
MESSAGES = [{"role": "user", "content": "to be or not"}]


@pytest.fixture(scope="module")
def served():
    tok = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz ,.\n")  # <|endoftext|> (its eos) last
    torch.manual_seed(0)
    model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=tok.vocab_size, n_layers=2, d_model=32,
                                     n_heads=4, context_length=64)).eval()
    app = create_app(model, tok, ServeConfig(name="tiny", max_batch=8, max_queue=8, max_tokens_limit=64),
                     chat_template=TEMPLATE)
    with serving_in_thread(app) as url:
        yield url, model, tok, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


COMMON = [  # (fields, the field the 400 names) for both routes
    ({"seed": 2**64}, "seed"), ({"seed": -1}, "seed"), ({"seed": 1.5}, "seed"),
    ({"temperature": -0.1}, "temperature"), ({"temperature": "0.5"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.01}, "top_p"), ({"top_k": -1}, "top_k"), ({"min_p": 1.5}, "min_p"),
    ({"n": 0}, "n"), ({"n": 65}, "n"), ({"n": 1.0}, "n"), ({"n": 17}, "n"),  # 17 > --max-batch + --max-queue
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"1": 100.5}}, "logit_bias"),
    ({"logit_bias": {"40": 1}}, "logit_bias"),  # outside the 31-token vocabulary
    ({"frequency_penalty": 0.5}, "frequency_penalty"), ({"presence_penalty": -1}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": 101}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 2, "stop": "a"}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop_token_ids": [31]}, "stop_token_ids"),
    ({"stream": "yes"}, "stream"), ({"ignore_eos": 1}, "ignore_eos"), ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"max_tokens": True}, "max_tokens"), ({"max_tokens": 65}, "max_tokens"), ({"model": "gpt2"}, "model"),
]
COMPLETIONS = [({"max_tokens": -1}, "max_tokens"), ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"),
               ({"echo": 1}, "echo"), ({"best_of": 2}, "best_of"), ({"prompt": [1, True]}, "prompt")]
CHAT = [({"max_tokens": 0}, "max_tokens"), ({"max_completion_tokens": 65}, "max_completion_tokens"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"logprobs": "true"}, "logprobs"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format"), ({"tools": [{"type": "function"}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"), ({"store": True}, "store"), ({"metadata": {"a": 1}}, "metadata")]


@pytest.mark.parametrize("path,fields,field", [("/v1/completions", f, name) for f, name in COMMON + COMPLETIONS]
                         + [("/v1/chat/completions", f, name) for f, name in COMMON + CHAT])
def test_every_field_out_of_range_or_of_the_wrong_type_is_a_4xx_naming_it(served, path, fields, field):
    base = {"prompt": "ab"} if path == "/v1/completions" else {"messages": MESSAGES}
    status, reply = call(served[0], path, {**base, "max_tokens": 8, **fields})
    assert status == (404 if field == "model" else 400), reply
    assert reply["error"]["message"].startswith(f"{field}") and reply["error"]["param"].split(".")[0] == field, reply


@pytest.mark.parametrize("literal", [b"Infinity", b"NaN", b"-Infinity"])
def test_non_finite_numbers_in_the_json_are_refused(served, literal):
    for field in (b"temperature", b"top_p", b"repetition_penalty", b"frequency_penalty"):
        status, reply = call(served[0], "/v1/completions", data=b'{"prompt": "ab", "%s": %s}' % (field, literal))
        assert status == 400 and reply["error"]["param"] == field.decode(), reply


@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 5e-324])
def test_tiny_temperatures_decode_as_greedy_does(served, temperature):
    url, _, _, client = served
    greedy = client.completions.create(model="tiny", prompt="to be", max_tokens=12, temperature=0)
    tiny = client.completions.create(model="tiny", prompt="to be", max_tokens=12, temperature=temperature, seed=1)
    assert tiny.choices[0].text == greedy.choices[0].text
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=temperature)
    again = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == again.choices[0].message.content


def test_models_retrieve_and_chat_with_n_choices(served):
    _, _, _, client = served
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    many = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, n=3, seed=5)
    assert [c.index for c in many.choices] == [0, 1, 2]
    alone = [client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, seed=5 + i)
             for i in range(3)]  # choice i is seeded seed + i, as completions' choices are
    assert [c.message.content for c in many.choices] == [a.choices[0].message.content for a in alone]
    assert len({c.message.content for c in many.choices}) > 1
    assert many.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert many.usage.prompt_tokens == alone[0].usage.prompt_tokens
    streamed = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, n=3, seed=5,
                                                   stream=True))
    for i, choice in enumerate(many.choices):
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices[0].index == i) == \
            choice.message.content


def test_neutral_openai_fields_change_nothing(served):
    _, _, _, client = served
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0)
    dressed = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0,
                                             logit_bias={}, response_format={"type": "text"}, tools=[],
                                             tool_choice="none", metadata={"run": "7"}, store=False, user="me",
                                             frequency_penalty=0, presence_penalty=0)
    assert dressed.choices[0].message.content == plain.choices[0].message.content
    _, reply = call(served[0], "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 10, "temperature": 0,
                                                         "tool_choice": None})
    assert reply["choices"][0]["message"]["content"] == plain.choices[0].message.content


def _next_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0, -1]


def test_logit_bias_moves_the_choice_as_the_logits_plus_the_bias_say(served):
    url, model, tok, client = served
    prompt = tok.encode("to be")
    logits = _next_logits(model, prompt)
    first, second = logits.topk(2).indices.tolist()
    for route in ("completions", "chat"):
        if route == "completions":
            reply = client.completions.create(model="tiny", prompt="to be", max_tokens=1, temperature=0,
                                              logit_bias={str(first): -100}, extra_body={"return_token_ids": True})
            assert reply.choices[0].token_ids == [second]
            always = client.completions.create(model="tiny", prompt="to be", max_tokens=6, temperature=1.0, seed=3,
                                               logit_bias={"3": 100})
            assert always.choices[0].text == tok.decode([3] * 6)
        else:
            chat_prompt = tok.encode(MESSAGES[0]["content"] + "\n")
            top = int(_next_logits(model, chat_prompt).argmax())
            reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, temperature=0,
                                                   logit_bias={str(top): -100}, logprobs=True)
            runner_up = int(_next_logits(model, chat_prompt).topk(2).indices[1])
            assert reply.choices[0].message.content == tok.decode([runner_up])
            # logprobs stay the model's own: the biased choice keeps its unbiased log-probability
            lp = torch.log_softmax(_next_logits(model, chat_prompt), -1)[runner_up]
            assert reply.choices[0].logprobs.content[0].logprob == pytest.approx(float(lp), abs=1e-4)


def test_vllm_repetition_penalty_is_the_one_generate_applies(served):
    _, model, tok, client = served
    plain = generate(model, [tok.encode("to be or")], max_new_tokens=20, temperature=0.0, tokenizer=tok)[0]
    texts = set()
    for penalty in (1.3, 3.0, 0.7):
        reply = client.completions.create(model="tiny", prompt="to be or", max_tokens=20, temperature=0,
                                          extra_body={"repetition_penalty": penalty})
        expected = generate(model, [tok.encode("to be or")], max_new_tokens=20, temperature=0.0,
                            repetition_penalty=penalty, tokenizer=tok)[0]
        assert reply.choices[0].text == expected.text
        texts.add(expected.text)
    assert texts - {plain.text}  # the penalty changed the greedy text


def test_vllm_stop_token_ids_min_tokens_ignore_eos_and_skip_special_tokens(served):
    url, model, tok, client = served
    sampled = client.completions.create(model="tiny", prompt="to be", max_tokens=12, seed=3,
                                        extra_body={"return_token_ids": True}).choices[0].token_ids
    stop_at = next(k for k, t in enumerate(sampled) if k >= 2 and t not in sampled[:k])
    cut = client.completions.create(model="tiny", prompt="to be", max_tokens=12, seed=3,
                                    extra_body={"return_token_ids": True, "stop_token_ids": [sampled[stop_at]]})
    assert cut.choices[0].token_ids == sampled[:stop_at] and cut.choices[0].finish_reason == "stop"
    eos = tok.special_tokens["<|endoftext|>"]
    forced = {str(eos): 100}  # eos first, at every step
    ends = client.completions.create(model="tiny", prompt="to be", max_tokens=8, logit_bias=forced)
    assert (ends.choices[0].finish_reason, ends.usage.completion_tokens) == ("stop", 0)
    held = client.completions.create(model="tiny", prompt="to be", max_tokens=8, logit_bias=forced,
                                     extra_body={"min_tokens": 3})
    assert (held.choices[0].finish_reason, held.usage.completion_tokens) == ("stop", 3)
    assert eos not in tok.encode(held.choices[0].text)
    past = client.completions.create(model="tiny", prompt="to be", max_tokens=4, logit_bias=forced,
                                     extra_body={"ignore_eos": True})
    assert past.choices[0].text == "<|endoftext|>" * 4 and past.choices[0].finish_reason == "length"
    skipped = client.completions.create(model="tiny", prompt="to be", max_tokens=4, logit_bias=forced,
                                        extra_body={"ignore_eos": True, "skip_special_tokens": True,
                                                    "return_token_ids": True})
    assert skipped.choices[0].text == "" and skipped.choices[0].token_ids == [eos] * 4


def test_vllm_include_stop_str_in_output_keeps_the_stop(served):
    _, _, _, client = served
    seeded, going, keeping = (dict(model="tiny", max_tokens=30, seed=11), {"ignore_eos": True},
                              {"ignore_eos": True, "include_stop_str_in_output": True})
    text = client.completions.create(prompt="to be", **seeded, extra_body=going).choices[0].text
    stop = text[7:9]  # a string the seeded continuation is known to contain
    kept = client.completions.create(prompt="to be", stop=[stop], **seeded, extra_body=keeping).choices[0]
    assert kept.text == text[:text.find(stop) + len(stop)] and kept.finish_reason == "stop"
    assert kept.text.endswith(stop) and len(kept.text) < len(text)
    answer = client.chat.completions.create(messages=MESSAGES, **seeded, extra_body=going).choices[0].message.content
    stop = answer[7:9]
    kept = client.chat.completions.create(messages=MESSAGES, stop=[stop], **seeded, extra_body=keeping)
    assert kept.choices[0].message.content == answer[:answer.find(stop) + len(stop)]


def test_lm_evals_remote_tokenizer_reads_the_servers_tokenizer(served):
    pytest.importorskip("lm_eval")
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    url, _, tok, _ = served
    assert check_remote_tokenizer_support(url + "/v1/completions")  # what local-completions' "auto" asks
    remote = RemoteTokenizer(url + "/v1/completions")
    assert remote.encode("to be, or not") == tok.encode("to be, or not")
    assert remote.decode(tok.encode("to be")) == "to be"
    assert remote.eos_token == remote.bos_token == "<|endoftext|>"
    assert remote.eos_token_id == remote.bos_token_id == tok.special_tokens["<|endoftext|>"]
    assert remote.apply_chat_template(MESSAGES) == "to be or not\n"
    with urllib.request.urlopen(url + "/tokenizer_info", timeout=30) as response:
        info = json.loads(response.read())
    assert info["model_max_length"] == 64 and info["vocab_size"] == tok.vocab_size and info["pad_token"] is None
