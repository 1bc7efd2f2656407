"""Settings from the outside world, checked against the dataclasses that define them.

`ModelConfig`, `TrainConfig`, `GenerationConfig` and the command line's `RunConfig` are the one
schema of glasslm's settings. This module turns their fields into command-line options (the help
text is each field's comment, plus its default) and checks values read from TOML/YAML files and
checkpoint JSON against the same fields. A mistyped or ill-typed key anywhere gets the same
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

import argparse
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
from pathlib import Path
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


# ---------------------------------------------------------------- command-line options

class Flag(argparse.BooleanOptionalAction):
    """--name / --no-name. `--name false` (the form earlier versions needed) still works."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any):
        super().__init__(option_strings, dest, **kwargs)
        self.nargs = "?"

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if values is None:
            return super().__call__(parser, namespace, values, option_string)
        if option_string is not None and option_string.startswith("--no-"):
            raise argparse.ArgumentError(self, "takes no value")
        try:
            setattr(namespace, self.dest, convert(bool, values, from_text=True))
        except ValueError as err:
            raise argparse.ArgumentError(self, str(err)) from None


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows a Flag as "--fsdp, --no-fsdp" in help and "[--fsdp | --no-fsdp]" in usage."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, Flag):
            return ", ".join(action.option_strings)
        return super()._format_action_invocation(action)

    def _format_args(self, action: argparse.Action, default_metavar: str) -> str:
        if isinstance(action, Flag):  # usage prints "--fsdp " + this
            return "| " + " | ".join(action.option_strings[1:])
        return super()._format_args(action, default_metavar)


class ArgumentParser(argparse.ArgumentParser):
    """argparse, plus a did-you-mean for a mistyped option (`--max-stesp` -> `--max-steps`)."""

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self
            for action in self._actions:  # the subcommand's parser knows the valid options
                if isinstance(action, argparse._SubParsersAction):
                    parser = action.choices.get(getattr(namespace, action.dest, None), self)
            options = [s for a in parser._actions for s in a.option_strings]
            first = next((e.split("=")[0] for e in extras if e.startswith("-")), "")
            parser.error(f"unrecognized arguments: {' '.join(extras)}{did_you_mean(first, options)}")
        return namespace


def _option_text(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (tuple, list)):
        return " ".join(map(str, value)) or "none"
    return str(value)


def add_options(parser: argparse.ArgumentParser, cls: type, title: str, skip: collections.abc.Container[str] = (),
                aliases: dict[str, list[str]] | None = None) -> None:
    """One --option per field of dataclass `cls`, with the field's comment and default as help.

    Options that are not given stay out of the parsed namespace (see `given_options`), so only
    what the user typed overrides a preset, a recipe or a file.
    """
    group = parser.add_argument_group(title)
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        hint = hints[f.name]
        base = next((a for a in typing.get_args(hint) if a is not type(None)), hint) \
            if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint
        doc = docs.get(f.name, "").replace("%", "%%")
        if typing.get_origin(base) in (collections.abc.Sequence, list, tuple):
            doc += "; repeat the option for more"
        help_text = f"{doc} (default: {_option_text(field_default(f))})".strip()
        names = ["--" + f.name.replace("_", "-"), *(aliases or {}).get(f.name, [])]
        kwargs: dict[str, Any] = dict(dest=f"{cls.__name__}.{f.name}", default=argparse.SUPPRESS, help=help_text)
        if base is bool:
            group.add_argument(*names, action=Flag, **kwargs)
            continue
        if typing.get_origin(base) in (collections.abc.Sequence, list, tuple):  # repeat the option
            hint = typing.get_args(base)[0]
            kwargs.update(action="append", metavar=hint.__name__.upper())
        elif typing.get_origin(base) is typing.Literal:
            kwargs.update(metavar="{" + ",".join(map(str, typing.get_args(base))) + "}")
        else:
            kwargs.update(metavar=base.__name__.upper())
        group.add_argument(*names, type=_text_parser(hint), **kwargs)


def _text_parser(hint: Any) -> Any:
    def parse(text: str) -> Any:
        try:
            return convert(hint, text, from_text=True)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return parse


def given_options(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of `cls` given on the command line (by `add_options`'s options)."""
    prefix = cls.__name__ + "."
    values = {k[len(prefix):]: v for k, v in vars(args).items() if k.startswith(prefix)}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}


# ---------------------------------------------------------------- files

def read_settings_file(path: str | Path) -> dict[str, Any]:
    """The table of settings in a TOML file (or a YAML one, if PyYAML is installed)."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"config file {file} does not exist")
    if file.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ValueError(f"{file}: reading YAML needs PyYAML (pip install pyyaml); TOML works without") from None
        try:
            data = yaml.safe_load(file.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            raise ValueError(f"{file} is not valid YAML: {' '.join(str(err).split())}") from None
    else:
        import tomllib

        try:
            data = tomllib.loads(file.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"{file} is not valid TOML: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a table of settings")
    return data
