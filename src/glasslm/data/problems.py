"""Problems for reinforcement learning from a verifiable reward (glasslm.training.grpo): a prompt the
model answers, and the answer a reward checks it against (glasslm.evaluation.rewards).

One JSON record a line, in the shapes TRL's prompt-only datasets take:

    {"prompt": "What is 2+2?", "answer": "4"}
    {"messages": [{"role": "system", "content": "Answer with a number."},
                  {"role": "user", "content": "What is 2+2?"}], "answer": "4"}

A text prompt is one user message. The prompt is rendered with the chat template's generation
prompt (`ChatFormat.prompt`, what `glasslm chat` and the chat endpoint send the model), so the model
answers as it would in use. `answer` is text (a number is taken as its text); a reward that needs no
answer (a format check) takes records without one.

Example:
    >>> from glasslm.tokenizers import CharTokenizer
    >>> from glasslm.tokenizers.chat import ChatFormat
    >>> template = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}a:"
    >>> tok = CharTokenizer.from_text("ua:;2+?4")
    >>> problem = record_problem({"prompt": "2+2?", "answer": 4}, "x")
    >>> tok.decode(encode_problem(tok, ChatFormat.for_tokenizer(template, tok), problem).prompt_ids), problem.answer
    ('u:2+2?;a:', '4')
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from glasslm.data.preferences import field_messages, load_encoded
from glasslm.data.sft import read_records
from glasslm.tokenizers.chat import ChatFormat

__all__ = ["EncodedProblem", "Problem", "encode_problem", "load_problems", "read_problems", "record_problem"]


@dataclass(frozen=True)
class Problem:
    """One record: the conversation so far (ending with the user's turn) and the expected answer."""

    prompt: list[dict[str, Any]]
    answer: str | None


@dataclass(frozen=True)
class EncodedProblem:
    """A problem with its rendered prompt, as text (what rewards see) and as token ids."""

    problem: Problem
    prompt_text: str
    prompt_ids: list[int]


def record_problem(record: Any, where: str) -> Problem:
    """The prompt and answer of one JSONL record, or a ValueError naming `where` and the field."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    prompt_key = "prompt" if "prompt" in record else "messages"
    if prompt_key not in record:
        raise ValueError(f"{where}: missing field 'prompt' (a record holds 'prompt' or 'messages', and 'answer'; "
                         f"it has {sorted(record)})")
    prompt = field_messages(record[prompt_key], "user", where, prompt_key)
    if prompt[-1]["role"] == "assistant":
        raise ValueError(f"{where}: {prompt_key} ends with an assistant turn; the model's completion answers it")
    answer = record.get("answer")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if answer is not None and not isinstance(answer, str):
        raise ValueError(f"{where}: answer must be text or a number, got {type(answer).__name__}")
    return Problem(prompt, answer)


def read_problems(path: str | os.PathLike) -> list[Problem]:
    """Every problem of a JSONL file (blank lines skipped); errors name the line."""
    return read_records(path, record_problem, "problems")


def encode_problem(tokenizer: Any, chat: ChatFormat, problem: Problem) -> EncodedProblem:
    """The problem's prompt rendered with the generation prompt, and its token ids."""
    text = chat.prompt(problem.prompt)
    return EncodedProblem(problem, text, tokenizer.encode(text))


def load_problems(path: str | os.PathLike, tokenizer: Any, template: str) -> list[EncodedProblem]:
    """Read and encode every problem of a JSONL file; a record the template cannot render is named."""
    return load_encoded(path, read_problems, encode_problem, tokenizer, template, "problem")
