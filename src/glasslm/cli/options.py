"""Command-line options generated from dataclass fields (glasslm.core.fields reads their docs and
checks their values), and the settings-file reader.
"""

from __future__ import annotations

import argparse
import collections.abc
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

from glasslm.core.fields import convert, did_you_mean, field_default, field_docs

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
