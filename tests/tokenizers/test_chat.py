"""Chat templates rendered by glasslm equal transformers' `apply_chat_template` on the same
templates and conversations; assistant spans cover exactly the assistant's turns."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from glasslm.tokenizers.chat import ChatFormat, ChatTemplateError, find_chat_template, render_chat

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{{ content }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
ZEPHYR = ("{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + "
          "eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n"
          "{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
          "{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}")
NO_SYSTEM = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
             "{% endif %}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' "
             "else message['role'] %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + "
             "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
TOJSON = "{% for m in messages %}{{ m | tojson }}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "zephyr": ZEPHYR, "no_system": NO_SYSTEM, "tojson": TOJSON}


@pytest.fixture(scope="module")
def hf_tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                   bos_token="<s>", eos_token="</s>")


def _theirs(tok, template, messages, add_generation_prompt):
    return tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                   add_generation_prompt=add_generation_prompt)


text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)
conversations = st.lists(st.tuples(st.sampled_from(["user", "assistant"]), text), min_size=1, max_size=4)


@settings(max_examples=25, deadline=None)
@given(conversation=conversations, system=st.one_of(st.none(), text), add_generation_prompt=st.booleans())
def test_rendering_equals_transformers(hf_tokenizer, conversation, system, add_generation_prompt):
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": role, "content": content} for role, content in conversation]
    for name, template in TEMPLATES.items():
        try:
            expected = _theirs(hf_tokenizer, template, messages, add_generation_prompt)
        except Exception as err:  # the template itself refuses (no system role): so must we
            with pytest.raises(ChatTemplateError, match="System role not supported"):
                render_chat(template, messages, add_generation_prompt=add_generation_prompt, bos_token="<s>",
                            eos_token="</s>")
            assert "System role" in str(err)
            continue
        ours = render_chat(template, messages, add_generation_prompt=add_generation_prompt, bos_token="<s>",
                           eos_token="</s>")
        assert ours == expected, name


def test_assistant_spans_are_the_answers_and_their_end_markers():
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "6"}]
    text, spans = ChatFormat(CHATML, {}).assistant_spans(messages)
    assert [text[a:b] for a, b in spans] == ["4<|im_end|>\n", "6<|im_end|>\n"]
    outside = "".join(text[b:a] for (_, b), (a, _) in zip([(0, 0)] + spans, spans + [(len(text), len(text))]))
    assert "2+2?" in outside and "3+3?" in outside and "4" not in outside.replace("<|im_start|>", "")


def test_bad_conversations_name_the_field():
    with pytest.raises(ChatTemplateError, match=r"messages\[1\]\.role"):
        render_chat(CHATML, [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]\.content must be text"):
        render_chat(CHATML, [{"role": "user", "content": 3}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat("{% for m in messages %}", [{"role": "user", "content": "a"}])


def test_the_sandbox_refuses_python_internals():
    with pytest.raises(Exception, match="unsafe|not safely|access"):
        render_chat("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}",
                    [{"role": "user", "content": "a"}])


def test_templates_are_found_where_transformers_saves_them(tmp_path, hf_tokenizer):
    hf_tokenizer.chat_template = CHATML
    hf_tokenizer.save_pretrained(tmp_path / "saved")
    assert find_chat_template(tmp_path / "saved") == CHATML
    (tmp_path / "listed").mkdir()
    (tmp_path / "listed" / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": ZEPHYR}]}))
    assert find_chat_template(tmp_path / "listed") == ZEPHYR
    assert find_chat_template(tmp_path) is None
