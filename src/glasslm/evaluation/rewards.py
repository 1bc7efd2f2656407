"""Verifiable rewards for GRPO (glasslm.training.grpo) and for scoring answers (glasslm.evaluation.problems): plain Python functions that score a completion.

A reward is `reward(prompt: str, completion: str) -> float`; one that also takes an `answer`
argument receives the problem's expected answer (glasslm.data.problems; None where the record has
none). `--reward` names one:

- `exact_match`: 1.0 where the completion's final answer (its last word, without surrounding
  punctuation, case ignored) is the record's answer, else 0.0.
- `regex:PATTERN`: 1.0 where the whole completion (whitespace stripped) matches PATTERN (Python's
  `re.fullmatch`, `.` matching newlines too), else 0.0: a format reward.
- `MODULE:FUNCTION` (an importable module) or `path/to/file.py:FUNCTION`: your own.

Example:
    >>> reward = load_reward("exact_match")
    >>> score(reward, "What is 2+2?", "The answer is 4.", "4"), score(reward, "What is 2+2?", "5", "4")
    (1.0, 0.0)
    >>> score(load_reward(r"regex:\\d+"), "", " 42\\n", None)
    1.0
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import re
import sys
from pathlib import Path
from typing import Callable

Reward = Callable[..., float]
PUNCTUATION = ".,;:!?\"'()[]{}*"


def exact_match(prompt: str, completion: str, answer: str | None) -> float:
    """1.0 where the completion's last word, stripped of punctuation, is `answer` (case ignored)."""
    if answer is None:
        raise ValueError("exact_match needs an 'answer' field in every problem record")
    words = completion.split()
    return float(bool(words) and words[-1].strip(PUNCTUATION).casefold() == answer.strip().casefold())


def regex_reward(pattern: str) -> Reward:
    """A format reward: 1.0 where the stripped completion matches `pattern` as a whole."""
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as err:
        raise ValueError(f"--reward regex:{pattern}: not a regular expression ({err})") from None

    def matches(prompt: str, completion: str) -> float:
        return float(compiled.fullmatch(completion.strip()) is not None)

    return matches


def load_reward(spec: str) -> Reward:
    """The reward `--reward` names: a built-in, `MODULE:FUNCTION` or `file.py:FUNCTION`."""
    if spec == "exact_match":
        return exact_match
    if spec.startswith("regex:"):
        return regex_reward(spec[len("regex:"):])
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"--reward {spec!r}: give exact_match, regex:PATTERN, MODULE:FUNCTION or file.py:FUNCTION")
    module = _module_from_file(where, spec) if where.endswith(".py") else _import(where, spec)
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"--reward {spec!r}: {where} has no function {name!r}")
    try:
        inspect.signature(function).bind("prompt", "completion", **({"answer": None} if takes_answer(function) else {}))
    except TypeError:
        raise ValueError(f"--reward {spec!r}: {name} must take (prompt, completion) and optionally answer") from None
    return function


def _import(module: str, spec: str):
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ValueError(f"--reward {spec!r}: cannot import {module!r} ({err})") from None
    except Exception as err:  # the module itself fails: a syntax error, a name it lacks
        raise ValueError(f"--reward {spec!r}: importing {module!r} failed: {type(err).__name__}: {err}") from None


def _module_from_file(path: str, spec: str):
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--reward {spec!r}: no file {path}")
    loaded = importlib.util.spec_from_file_location(f"glasslm_reward_{file.stem}", file)
    assert loaded is not None and loaded.loader is not None
    module = importlib.util.module_from_spec(loaded)
    sys.modules[loaded.name] = module
    try:
        loaded.loader.exec_module(module)
    except Exception as err:  # a syntax error, an import inside it that fails, ...
        del sys.modules[loaded.name]
        raise ValueError(f"--reward {spec!r}: running {path} failed: {type(err).__name__}: {err}") from None
    return module


def takes_answer(reward: Reward) -> bool:
    parameters = inspect.signature(reward).parameters
    return "answer" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def score(reward: Reward, prompt: str, completion: str, answer: str | None) -> float:
    """reward(prompt, completion[, answer]) as a float, or a ValueError saying what it returned."""
    value = reward(prompt, completion, answer=answer) if takes_answer(reward) else reward(prompt, completion)
    if not isinstance(value, (int, float)) or not math.isfinite(value):  # a bool is 0 or 1
        raise ValueError(f"the reward {getattr(reward, '__name__', reward)} returned {value!r}; "
                         "it must return a finite number")
    return float(value)
