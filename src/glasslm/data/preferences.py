"""Preference data: pairs of a preferred ("chosen") and a dispreferred ("rejected") completion of the
same prompt, for preference tuning (glasslm.training.dpo).

One JSON record a line, in the shapes TRL's preference datasets take:

    {"prompt": "2+2?", "chosen": "4", "rejected": "5"}
    {"prompt": [{"role": "user", "content": "2+2?"}],
     "chosen": [{"role": "assistant", "content": "4"}], "rejected": [{"role": "assistant", "content": "5"}]}

`messages` may stand for `prompt` (a conversation so far); a text prompt is one user message and a
text completion one assistant message. Each side is rendered as prompt + completion with the chat
template and encoded by `glasslm.data.sft.encode_conversation` (the one rendering path fine-tuning,
`glasslm chat` and the chat endpoint share), its labels on the completion's assistant turns only.

Example:
    >>> from glasslm.tokenizers import CharTokenizer
    >>> template = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
    >>> tok = CharTokenizer.from_text("ua:;2+?45")
    >>> pair = encode_preference(tok, template, record_pair({"prompt": "2+2?", "chosen": "4", "rejected": "5"}, "x"))
    >>> tok.decode(pair.chosen.ids), tok.decode(pair.rejected.ids)
    ('u:2+2?;a:4;', 'u:2+2?;a:5;')
    >>> "".join(tok.decode([t]) if t != IGNORE_INDEX else "." for t in pair.rejected.labels)
    '......a:5;.'
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glasslm.data.sft import IGNORE_INDEX, SFTExample, encode_conversation, read_records
from glasslm.tokenizers.chat import ChatFormat, ChatTemplateError, check_messages

__all__ = ["IGNORE_INDEX", "PreferencePair", "PreferenceRecord", "encode_preference", "load_preference_pairs",
           "read_preferences", "record_pair"]


@dataclass(frozen=True)
class PreferenceRecord:
    """One record's conversation so far and its two completions, as message lists."""

    prompt: list[dict[str, Any]]
    chosen: list[dict[str, Any]]
    rejected: list[dict[str, Any]]


@dataclass(frozen=True)
class PreferencePair:
    """Both sides encoded: prompt + completion ids, labels on the completion only."""

    chosen: SFTExample
    rejected: SFTExample


def _messages(value: Any, role: str, where: str, name: str) -> list[dict[str, Any]]:
    """A text as one message of `role`, or a message list checked; errors name the field."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    try:
        messages = check_messages(value)
    except ChatTemplateError as err:
        raise ValueError(f"{where}: {name}: {err}") from None
    if not messages:
        raise ValueError(f"{where}: {name} is empty")
    return messages


def record_pair(record: Any, where: str) -> PreferenceRecord:
    """The prompt and completions of one JSONL record, or a ValueError naming `where` and the field."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    prompt_key = "prompt" if "prompt" in record else "messages"
    missing = [k for k in (prompt_key, "chosen", "rejected") if k not in record]
    if missing:
        raise ValueError(f"{where}: missing field {missing[0]!r} (a record holds 'prompt' or 'messages', 'chosen' "
                         f"and 'rejected'; it has {sorted(record)})")
    prompt = _messages(record[prompt_key], "user", where, prompt_key)
    if prompt[-1]["role"] == "assistant":
        raise ValueError(f"{where}: {prompt_key} ends with an assistant turn; the completions answer it")
    sides = [_messages(record[k], "assistant", where, k) for k in ("chosen", "rejected")]
    for name, side in zip(("chosen", "rejected"), sides):
        if side[0]["role"] != "assistant":
            raise ValueError(f"{where}: {name} must start with an assistant message, got role {side[0]['role']!r}")
    return PreferenceRecord(prompt, *sides)


def read_preferences(path: str | os.PathLike) -> list[PreferenceRecord]:
    """Every preference record of a JSONL file (blank lines skipped); errors name the line."""
    return read_records(path, record_pair, "preference pairs")


def encode_preference(tokenizer: Any, template: str | ChatFormat, record: PreferenceRecord) -> PreferencePair:
    """Both sides of `record` as token ids, labels on each completion's assistant turns."""
    first = len(record.prompt)
    return PreferencePair(encode_conversation(tokenizer, template, record.prompt + record.chosen, first),
                          encode_conversation(tokenizer, template, record.prompt + record.rejected, first))


def load_preference_pairs(path: str | os.PathLike, tokenizer: Any, template: str) -> list[PreferencePair]:
    """Read and encode every preference pair of a JSONL file; a record the template cannot render is
    named by its line."""
    chat = ChatFormat.for_tokenizer(template, tokenizer)
    pairs = []
    for number, record in enumerate(read_preferences(Path(path)), start=1):
        try:
            pairs.append(encode_preference(tokenizer, chat, record))
        except ChatTemplateError as err:
            raise ValueError(f"{path}: pair {number}: {err}") from None
    return pairs
