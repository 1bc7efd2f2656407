"""Supervised fine-tuning data: conversations rendered with the model's chat template, the loss on
the assistant's tokens only.

Two JSONL record shapes are read, one record a line:

    {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    {"instruction": "Add the numbers.", "input": "2 and 2", "output": "4"}   (Alpaca style)

Each conversation is rendered by `glasslm.tokenizers.chat.ChatFormat` with the tokenizer's own
special-token texts (the same rendering `glasslm chat` and the chat endpoint use, so a template's
`{{ eos_token }}` is the real eos, which the model then learns to write) and tokenized piece by piece at the assistant turns' boundaries, so the prompt's tokens are
exactly those the model sees when it is asked at inference, and each assistant turn (with the
template's end-of-turn marker) is exactly what it must write. Labels are the next token where it
is the assistant's, else `IGNORE_INDEX`, which the loss skips.

Example:
    >>> from glasslm.tokenizers import CharTokenizer
    >>> template = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
    >>> tok = CharTokenizer.from_text("ua:;24+?")
    >>> example = encode_conversation(tok, template, [{"role": "user", "content": "2+2?"},
    ...                                             {"role": "assistant", "content": "4"}])
    >>> tok.decode(example.ids)
    'u:2+2?;a:4;'
    >>> "".join(tok.decode([t]) if t != IGNORE_INDEX else "." for t in example.labels)
    '......a:4;.'
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from jaxtyping import Int
from torch import Tensor

from glasslm.tokenizers.chat import ChatFormat, ChatTemplateError, check_messages

IGNORE_INDEX = -100  # cross_entropy's ignore_index: positions the loss leaves out
T = TypeVar("T")


@dataclass(frozen=True)
class SFTExample:
    """One conversation as token ids and next-token labels (IGNORE_INDEX outside assistant turns)."""

    ids: list[int]
    labels: list[int]

    @property
    def n_trained(self) -> int:
        return sum(label != IGNORE_INDEX for label in self.labels)


def record_messages(record: Any, where: str) -> list[dict[str, Any]]:
    """The conversation in one JSONL record (either shape), or a ValueError naming `where` and the field."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    if "messages" in record:
        try:
            messages = check_messages(record["messages"])
        except ChatTemplateError as err:
            raise ValueError(f"{where}: {err}") from None
    elif "instruction" in record and "output" in record:
        fields = {k: record.get(k, "") for k in ("instruction", "input", "output")}
        bad = [k for k, v in fields.items() if not isinstance(v, str)]
        if bad:
            raise ValueError(f"{where}: {bad[0]} must be text")
        prompt = fields["instruction"] + (f"\n\n{fields['input']}" if fields["input"] else "")
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": fields["output"]}]
    else:
        raise ValueError(f"{where}: expected 'messages' or 'instruction' + 'output', got keys {sorted(record)}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: the conversation has no assistant turn to learn from")
    return messages


def read_records(path: str | os.PathLike, parse: Callable[[Any, str], T], what: str) -> list[T]:
    """`parse(record, "path:line")` of every record of a JSONL file (blank lines skipped); a line that
    is not JSON is named, and a file with no records is refused as holding no `what`."""
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not JSON ({err.msg})") from None
            records.append(parse(record, f"{path}:{number}"))
    if not records:
        raise ValueError(f"{path} holds no {what}")
    return records


def read_conversations(path: str | os.PathLike) -> list[list[dict[str, Any]]]:
    """Every conversation in a JSONL file (blank lines skipped); errors name the line."""
    return read_records(path, record_messages, "conversations")


def encode_conversation(tokenizer: Any, template: str | ChatFormat, messages: Sequence[dict[str, Any]],
                        first_trained: int = 0) -> SFTExample:
    """Token ids of the conversation rendered with `template` and `tokenizer`'s special tokens, and
    labels that train only its assistant turns (those from message `first_trained` on: a preference
    pair trains its completion, not the assistant turns of its prompt)."""
    chat = template if isinstance(template, ChatFormat) else ChatFormat.for_tokenizer(template, tokenizer)
    text, spans = chat.assistant_spans(messages)
    turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    ids: list[int] = []
    trained: list[bool] = []
    cursor = 0
    for (start, end), turn in zip([*spans, (len(text), len(text))], [*turns, len(messages)]):
        for piece, is_assistant in ((text[cursor:start], False), (text[start:end], turn >= first_trained)):
            piece_ids = tokenizer.encode(piece) if piece else []
            ids += piece_ids
            trained += [is_assistant] * len(piece_ids)
        cursor = end
    # The label at position t is token t + 1, trained when that token is the assistant's.
    labels = [ids[t + 1] if trained[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]
    return SFTExample(ids, labels)


def split_examples(examples: Sequence[SFTExample], val_fraction: float,
                   seed: int = 0) -> tuple[list[SFTExample], list[SFTExample]]:
    """A seeded shuffle into (train, validation); validation gets at least one example if it gets any."""
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = 0 if val_fraction <= 0 else max(1, round(len(examples) * val_fraction))
    if n_val >= len(examples):
        raise ValueError(f"{len(examples)} conversation(s) leave none to train on after a {val_fraction} validation split")
    return [examples[i] for i in order[n_val:]], [examples[i] for i in order[:n_val]]


def padded_batch(examples: Sequence[SFTExample], context_length: int, pad_id: int = 0,
                 width: int | None = None) -> tuple[Int[Tensor, "batch seq"], Int[Tensor, "batch seq"]]:
    """(ids, labels) right-padded to the longest example (cut to `context_length`), or to `width`
    (`padded_width` of a whole batch this is some rows of); padding is never trained, and under the
    causal mask it cannot change the real positions' outputs."""
    width = width if width is not None else padded_width(examples, context_length)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)         # (batch, seq)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)  # (batch, seq)
    for row, example in enumerate(examples):
        n = min(width, len(example.ids))
        ids[row, :n] = torch.tensor(example.ids[:n])
        labels[row, :n] = torch.tensor(example.labels[:n])
        labels[row, n - 1] = IGNORE_INDEX  # a cut example's last label names a token the model never sees
    return ids, labels


def padded_width(examples: Sequence[SFTExample], context_length: int) -> int:
    """The width `padded_batch` pads `examples` to: the longest, cut to `context_length`."""
    return min(context_length, max(len(e.ids) for e in examples))


def sft_batches(examples: Sequence[SFTExample], batch_size: int, context_length: int, generator: torch.Generator,
                pad_id: int = 0) -> Iterator[tuple[Tensor, Tensor]]:
    """Endless shuffled padded batches (a new order each pass), drawn from `generator`."""
    if not examples:
        raise ValueError("no fine-tuning examples")
    while True:
        order = torch.randperm(len(examples), generator=generator).tolist()
        for start in range(0, len(order) - batch_size + 1 if len(order) >= batch_size else 1, batch_size):
            yield padded_batch([examples[i] for i in order[start:start + batch_size]], context_length, pad_id)


def load_sft_examples(path: str | os.PathLike, tokenizer: Any, template: str) -> list[SFTExample]:
    """Read and encode every conversation of a JSONL file (rendered with the tokenizer's special tokens)."""
    chat = ChatFormat.for_tokenizer(template, tokenizer)
    return [encode_conversation(tokenizer, chat, m) for m in read_conversations(Path(path))]
