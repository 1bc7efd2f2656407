"""Chat templates: a conversation rendered to the text a chat model was trained on.

A model's chat template is a Jinja2 program stored with its tokenizer (`chat_template` in
tokenizer_config.json, or a chat_template.jinja file). It is rendered here the way transformers'
`apply_chat_template` renders it — a sandboxed environment that trims blocks, with the same
`raise_exception`, `strftime_now` and non-escaping `tojson` — so a prompt built by glasslm is the
prompt the model saw in training. Fine-tuning data, `glasslm chat` and the chat endpoint all render
through one `ChatFormat`: the template bound to its tokenizer's special-token texts, so
`{{ eos_token }}` is the tokenizer's real end-of-sequence token wherever a conversation is rendered
(as `apply_chat_template` renders it from tokenizer_config.json), and a model fine-tuned on its
conversations learns to write the eos that stops generation. `ChatFormat.assistant_spans` says which
characters are the assistant's, the ones fine-tuning puts in the loss.

Example:
    >>> from glasslm.tokenizers.char import CharTokenizer
    >>> template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    ...             "{% if add_generation_prompt %}<assistant>{% endif %}")
    >>> chat = ChatFormat.for_tokenizer(template, CharTokenizer.from_text("<>abehilnorstu"))
    >>> chat.prompt([{"role": "user", "content": "hi"}])
    '<user>hi<|endoftext|><assistant>'
    >>> text, spans = chat.assistant_spans([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])
    >>> [text[start:end] for start, end in spans]
    ['hello<|endoftext|>']
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
ROLES = ("system", "user", "assistant", "tool", "developer")


class ChatTemplateError(ValueError):
    """A template that does not compile, raises while rendering, or a malformed conversation."""


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _generation_tag() -> type:
    """`{% generation %}…{% endgeneration %}` marks assistant text in some templates; rendered as its body."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return GenerationTag


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> Any:
    """The compiled, sandboxed Jinja2 template for `source` (compiled once per distinct source)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _generation_tag()])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise ChatTemplateError(f"the chat template does not compile: {err} (line {err.lineno})") from None


@functools.lru_cache(maxsize=16)
def template_variables(source: str) -> frozenset[str]:
    """The variables a template reads from outside (`messages`, `tools`, `bos_token`, ...).

    >>> sorted(template_variables("{% for m in messages %}{{ m.content }}{% endfor %}{{ tools | length }}"))
    ['messages', 'tools']
    """
    from jinja2 import meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols", _generation_tag()])
    try:
        return frozenset(meta.find_undeclared_variables(env.parse(source)))
    except Exception as err:  # noqa: BLE001 - jinja2's syntax errors
        raise ChatTemplateError(f"the chat template does not compile: {err}") from None


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """`messages` as plain dicts, or a ChatTemplateError naming the first bad message and field."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ChatTemplateError(f"messages must be a list of {{'role', 'content'}} objects, got {type(messages).__name__}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be an object with 'role' and 'content', got {message!r}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or role not in ROLES:
            raise ChatTemplateError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        if content is not None and not isinstance(content, str):
            raise ChatTemplateError(f"messages[{i}].content must be text, got {type(content).__name__}")
        checked.append(dict(message))
    return checked


def render_chat(template: str, messages: Any, *, add_generation_prompt: bool = False, **variables: Any) -> str:
    """The text of `messages` under `template`; `variables` (bos_token, eos_token, tools, ...) are
    visible to the template, as `apply_chat_template`'s keyword arguments are."""
    import jinja2

    compiled = compile_template(template)
    try:
        return compiled.render(messages=check_messages(messages), add_generation_prompt=add_generation_prompt,
                               **variables)
    except jinja2.exceptions.TemplateError as err:
        raise ChatTemplateError(f"the chat template refused this conversation: {err}") from None


@dataclass(frozen=True)
class ChatFormat:
    """A chat template and the texts its tokenizer gives the special tokens (`bos_token`,
    `eos_token`, ...): how glasslm renders every conversation, for training and for inference alike.
    Build it with `ChatFormat.for_tokenizer`, so the texts are always the tokenizer's own."""

    template: str
    special_tokens: Mapping[str, str]  # {"bos_token": "<s>", "eos_token": "</s>"}: the template's variables

    @classmethod
    def for_tokenizer(cls, template: str, tokenizer: Any) -> "ChatFormat":
        compile_template(template)  # a template that does not compile is refused here, once
        return cls(template, special_token_texts(tokenizer))

    def render(self, messages: Any, add_generation_prompt: bool = False, **variables: Any) -> str:
        """The text of `messages`; `variables` (tools, ...) are visible to the template too."""
        return render_chat(self.template, messages, add_generation_prompt=add_generation_prompt,
                           **{**self.special_tokens, **variables})

    @property
    def renders_tools(self) -> bool:
        """Whether the template shows the model a list of tools (it reads the `tools` variable, as
        transformers' `apply_chat_template(..., tools=...)` passes them)."""
        return "tools" in template_variables(self.template)

    def prompt(self, messages: Any, **variables: Any) -> str:
        """The prompt that asks the model for the next assistant turn of `messages` (the template
        rendered with `add_generation_prompt`, as `apply_chat_template(..., add_generation_prompt=True)`)."""
        return self.render(messages, add_generation_prompt=True, **variables)

    def assistant_spans(self, messages: Any) -> tuple[str, list[tuple[int, int]]]:
        """(the rendered conversation, the [start, end) character spans of each assistant turn).

        A turn's span is what rendering it adds after the prompt that asks for it (the text after
        `add_generation_prompt`), so it holds the answer and the template's end-of-turn marker (its
        eos, where the template writes one) — what a model must learn to write — and none of the prompt.
        """
        messages = check_messages(messages)
        text = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt, through = self.prompt(messages[:i]), self.render(messages[:i + 1])
            if not (text.startswith(prompt) and text.startswith(through) and through.startswith(prompt)):
                raise ChatTemplateError(f"the template renders messages[{i}] differently once later turns follow, "
                                        "so its assistant text cannot be located")
            spans.append((len(prompt), len(through)))
        return text, spans


def chat_prompt(template: str, messages: Any, tokenizer: Any) -> str:
    """`ChatFormat.for_tokenizer(template, tokenizer).prompt(messages)`.

    >>> from glasslm.tokenizers.char import CharTokenizer
    >>> chat_prompt("{% for m in messages %}{{ m['content'] }};{% endfor %}", [{"role": "user", "content": "hi"}],
    ...             CharTokenizer.from_text("hi;"))
    'hi;'
    """
    return ChatFormat.for_tokenizer(template, tokenizer).prompt(messages)


def special_token_texts(tokenizer: Any) -> dict[str, str]:
    """{"bos_token": text, "eos_token": text, ...} for the roles (bos, eos, pad, unk) the tokenizer
    has: the variables transformers' `apply_chat_template` gives a template."""
    from glasslm.tokenizers.hf import special_token_ids

    names = {i: text for text, i in (getattr(tokenizer, "special_tokens", None) or {}).items()}
    return {f"{role}_token": names.get(i) or tokenizer.decode([i])
            for role, i in special_token_ids(tokenizer).items() if i is not None}


def template_text(template: Any) -> str | None:
    """A stored `chat_template` value as one template: the text, or the "default" entry of a named
    list ([{"name": "default", "template": ...}, {"name": "tool_use", ...}]); None if neither."""
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def find_chat_template(directory: str | os.PathLike) -> str | None:
    """The chat template stored with a tokenizer in `directory` (chat_template.jinja, else
    tokenizer_config.json's `chat_template`, the "default" one of a named list), or None."""
    folder = Path(directory)
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        return (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    config_path = folder / TOKENIZER_CONFIG_FILE
    if not config_path.is_file():
        return None
    try:
        return template_text(json.loads(config_path.read_text(encoding="utf-8")).get("chat_template"))
    except (json.JSONDecodeError, AttributeError) as err:
        raise ChatTemplateError(f"{config_path} is not a JSON object: {err}") from None


def read_template_file(path: str | os.PathLike) -> str:
    """The text of a `--chat-template FILE`, checked to compile, or an error naming the file."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--chat-template {file}: no such file")
    text = file.read_text(encoding="utf-8")
    try:
        compile_template(text)
    except ChatTemplateError as err:
        raise ChatTemplateError(f"--chat-template {file}: {err}") from None
    return text
