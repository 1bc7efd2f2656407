"""Settings from the outside world (TOML, JSON, the command line), checked against the dataclass
fields that define them.

`ModelConfig`, `TrainConfig`, `GenerationConfig` and the command line's `RunConfig` are the one
schema of glasslm's settings. This module reads each field's doc, type and default, and checks values read from TOML/YAML files,
checkpoint JSON and the command line against the same fields. A mistyped or ill-typed key anywhere gets the same
one-line error, naming the closest valid key.

A field's doc is the comment after it (continued on comment lines aligned below it), or the
comment lines just above it:

    max_steps: int = 2000  # optimizer steps to run
    lr: float = 1e-3  # peak learning rate, reached after warmup;
                      # the cosine then decays it to min_lr

Example:
    >>> from glasslm.core.config import ModelConfig
    >>> checked(ModelConfig, {"n_layers": 2, "rope_theta": 500000}, "run.toml [model]")
    {'n_layers': 2, 'rope_theta': 500000.0}
    >>> checked(ModelConfig, {"n_layer": 2}, "run.toml [model]")
    Traceback (most recent call last):
    ...
    ValueError: run.toml [model]: unknown setting 'n_layer'; did you mean 'n_layers'?
    >>> checked(ModelConfig, {"norm": "rms"}, "run.toml [model]")
    Traceback (most recent call last):
    ...
    ValueError: run.toml [model]: norm must be one of layernorm, rmsnorm, got 'rms'; did you mean 'rmsnorm'?
"""

from __future__ import annotations

import ast
import collections.abc
import dataclasses
import difflib
import functools
import inspect
import io
import textwrap
import tokenize
import types
import typing
from typing import Any


def did_you_mean(name: str, choices: collections.abc.Iterable[str]) -> str:
    """"; did you mean 'x'?" for the closest of `choices` to a mistyped `name`, else ""."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


# ---------------------------------------------------------------- field docs, types and defaults

@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each dataclass field's doc, read from the comments in the class's source."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):  # a subclass's comments win over its bases'
        if dataclasses.is_dataclass(base):
            docs.update(_comments_of(base))
    return docs


def _comments_of(cls: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # defined where there is no source file (e.g. a REPL)
        return {}
    lines = source.splitlines()
    comments = {tok.start[0]: (tok.start[1], tok.string.lstrip("#").strip())
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    only_comment = {n for n in comments if lines[n - 1].lstrip().startswith("#")}
    class_def = next(node for node in ast.parse(source).body if isinstance(node, ast.ClassDef))
    docs = {}
    for node in class_def.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        parts = []
        if node.end_lineno in comments and node.end_lineno not in only_comment:  # a trailing comment
            column, text = comments[node.end_lineno]
            parts.append(text)
            line = node.end_lineno + 1
            while line in only_comment and comments[line][0] == column:  # aligned continuation lines
                parts.append(comments[line][1])
                line += 1
        else:  # the comment block just above the field
            line = node.lineno - 1
            while line in only_comment:
                parts.insert(0, comments[line][1])
                line -= 1
        docs[node.target.id] = " ".join(parts)
    return docs


def field_default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args if a is not type(None)) + " or none"
    if origin is typing.Literal:
        return "one of " + ", ".join(map(str, args))
    if origin in (collections.abc.Sequence, list, tuple):
        return "a list of " + {int: "integers", float: "numbers", str: "strings"}.get(args[0], str(args[0]))
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(hint, str(hint))


def convert(hint: Any, value: Any, from_text: bool = False) -> Any:
    """`value` as the type `hint` describes, or ValueError("must be ..., got ...").

    `from_text` parses command-line text ("3", "1e-3", "true", "none"); otherwise the value must
    already have the type (as TOML, YAML and JSON give it), except that integers pass as floats.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None or (from_text and value.lower() == "none"):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            try:
                return convert(inner[0], value, from_text)
            except ValueError:
                pass  # report the whole union below
    elif origin is typing.Literal:
        if value in args:
            return value
        raise ValueError(f"must be {_describe(hint)}, got {value!r}{did_you_mean(str(value), map(str, args))}")
    elif origin in (collections.abc.Sequence, list, tuple):
        if isinstance(value, (list, tuple)):
            return tuple(convert(args[0], v, from_text) for v in value)
    elif hint is bool:
        if isinstance(value, bool):
            return value
        if from_text and value.lower() in ("true", "false", "1", "0", "yes", "no", "on", "off"):
            return value.lower() in ("true", "1", "yes", "on")
    elif hint in (int, float):
        if from_text:
            try:
                return hint(value)
            except ValueError:
                pass
        elif isinstance(value, int if hint is int else (int, float)) and not isinstance(value, bool):
            return hint(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    raise ValueError(f"must be {_describe(hint)}, got {value!r}")


def checked(cls: type, data: Any, where: str) -> dict[str, Any]:
    """The settings in `data` (a mapping of field names of dataclass `cls`), type-checked.

    `where` names the source in errors ("run.toml [train]", "ckpt/config.json", "--lr").
    """
    if not isinstance(data, dict):
        raise ValueError(f"{where}: must be a table of {cls.__name__} settings, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    result = {}
    for key, value in data.items():
        if key not in names:
            raise ValueError(f"{where}: unknown setting {key!r}{did_you_mean(str(key), names) or _valid(names)}")
        try:
            result[key] = convert(hints[key], value)
        except ValueError as err:
            raise ValueError(f"{where}: {key} {err}") from None
    return result


def _valid(names: list[str]) -> str:
    return f" (valid: {', '.join(names)})"


