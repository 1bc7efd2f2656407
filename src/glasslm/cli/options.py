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
    """--name / --no-name, and nothing else: a boolean option takes no value."""


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


@dataclasses.dataclass(frozen=True)
class Group:
    """How a command shows one dataclass's options: `Annotated[SomeConfig, Group(...)]` on a
    parameter of a command's function (see glasslm.cli.command)."""

    title: str | None = None  # the help section's heading; none: the class docstring's first line
    skip: frozenset[str] = frozenset()  # fields the command does not offer
    aliases: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # field -> extra spellings
    # the defaults help shows, where they are not the dataclass's own (train: the default preset's)
    shown_defaults: collections.abc.Callable[[], dict[str, Any]] | None = None


def add_options(parser: argparse.ArgumentParser, cls: type, title: str, skip: collections.abc.Container[str] = (),
                aliases: dict[str, list[str]] | None = None, shown_defaults: dict[str, Any] | None = None) -> None:
    """One --option per field of dataclass `cls`, with the field's comment and default as help.

    Options that are not given stay out of the parsed namespace (see `given_options`), so only
    what the user typed overrides a preset, a recipe or a file. A field without a default is a
    required option. Field metadata may add `help` (a function giving the description when the parser
    is built, where it names what a registry holds), `positional=True`, `minimum=N` (checked while
    parsing), `exclusive="NAME"` (at most one of the fields sharing NAME may be given), `one_of="NAME"`
    (exactly one of them must be given),
    `option="--spelling"` (instead of the field's name), `metavar` and, for a list, `nargs="*"` (values
    after one option instead of the option repeated). `shown_defaults` replaces the defaults help
    shows (not the values: an option not given stays out of the namespace either way).
    """
    group = parser.add_argument_group(title)
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    exclusive: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        target, key = group, f.metadata.get("exclusive", f.metadata.get("one_of"))
        if key is not None:
            if key not in exclusive:
                exclusive[key] = group.add_mutually_exclusive_group(required="one_of" in f.metadata)
            target = exclusive[key]
        names, kwargs = _argument(cls.__name__, f, hints[f.name], docs.get(f.name, ""), (aliases or {}).get(f.name, []),
                                  (shown_defaults or {}).get(f.name, field_default(f)))
        target.add_argument(*names, **kwargs)


def _argument(prefix: str, f: dataclasses.Field, hint: Any, doc: str, aliases: list[str],
              default: Any) -> tuple[list, dict]:
    """add_argument's names and keywords for one field."""
    if "choices" in f.metadata:  # choices known only when the parser is built (registered transforms)
        hint = typing.Literal[tuple(f.metadata["choices"]())]
    base = next((a for a in typing.get_args(hint) if a is not type(None)), hint) \
        if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint
    required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    listed = typing.get_origin(base) in (collections.abc.Sequence, list, tuple)
    doc = (f.metadata["help"]() if "help" in f.metadata else doc).replace("%", "%%")
    if listed and not f.metadata.get("positional") and "nargs" not in f.metadata:
        doc += "; repeat the option for more"
    help_text = doc if required else f"{doc} (default: {_option_text(default)})".strip()
    kwargs: dict[str, Any] = dict(default=argparse.SUPPRESS, help=help_text)
    if f.metadata.get("positional"):
        names, kwargs["metavar"] = [f"{prefix}.{f.name}"], f.name.upper()
        if listed:
            kwargs["nargs"] = "+" if required else "*"
    else:
        names = [f.metadata.get("option", "--" + f.name.replace("_", "-")), *aliases]
        kwargs.update(dest=f"{prefix}.{f.name}", required=required)
    if base is bool:
        # In a group of alternatives only the positive flag means anything (--no-to-hf is no choice),
        # and so for a consent like --yes (metadata flag_only: --no-yes would be noise).
        positive_only = "exclusive" in f.metadata or "one_of" in f.metadata or f.metadata.get("flag_only", False)
        return names, kwargs | dict(action="store_true" if positive_only else Flag)
    if listed and (f.metadata.get("positional") or "nargs" in f.metadata):
        hint = typing.get_args(base)[0]
        kwargs.setdefault("nargs", f.metadata.get("nargs"))
        kwargs.setdefault("metavar", hint.__name__.upper())
    elif listed:  # repeat the option
        hint = typing.get_args(base)[0]
        kwargs.update(action="append", metavar=hint.__name__.upper())
    elif typing.get_origin(base) is typing.Literal:
        kwargs.update(metavar="{" + ",".join(map(str, typing.get_args(base))) + "}")
    else:
        kwargs.setdefault("metavar", base.__name__.upper())
    if "metavar" in f.metadata:
        kwargs["metavar"] = f.metadata["metavar"]
    return names, kwargs | dict(type=_text_parser(hint, f.metadata.get("minimum")))


def _text_parser(hint: Any, minimum: float | None = None) -> Any:
    def parse(text: str) -> Any:
        try:
            value = convert(hint, text, from_text=True)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        if minimum is not None and value is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    return parse


def given_options(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of `cls` given on the command line (by `add_options`'s options)."""
    prefix = cls.__name__ + "."
    values = {k[len(prefix):]: v for k, v in vars(args).items() if k.startswith(prefix)}
    return {k: tuple(v) if isinstance(v, list) and _is_tuple(cls, k) else v for k, v in values.items()}


def _is_tuple(cls: type, name: str) -> bool:
    """Repeated options arrive as lists; a field typed as a tuple or Sequence stores a tuple."""
    hint = typing.get_type_hints(cls)[name]
    hint = next((a for a in typing.get_args(hint) if a is not type(None)), hint) \
        if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint
    return typing.get_origin(hint) is not list


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
