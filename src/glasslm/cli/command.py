"""A command is a function of dataclass configs; its options are generated from its signature.

Each parameter of a command's function is annotated with a dataclass (or `Annotated[dataclass,
Group(...)]`); `build_parser` adds one option per field, and `Command.invoke` builds each
parameter's dataclass from what was typed (its defaults fill the rest). A parameter annotated
`Annotated[dict[str, Any], SomeConfig]` gets only the fields typed, as a dict: train and info
lay them over a preset, a recipe or a file.

    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Greeting:
    ...     name: str = "world"  # who to greet
    ...     loud: bool = False  # shout it
    >>> def greet(greeting: Greeting) -> int:
    ...     text = f"hello {greeting.name}"
    ...     print(text.upper() if greeting.loud else text)
    ...     return 0
    >>> parser = build_parser([Command("greet", greet, "say hello")])
    >>> args = parser.parse_args(["greet", "--name", "glasslm", "--loud"])
    >>> args.command_spec.invoke(args)
    HELLO GLASSLM
    0
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from glasslm import __version__
from glasslm.cli.options import ArgumentParser, Group, HelpFormatter, add_options, given_options


@dataclass(frozen=True)
class Command:
    """One `glasslm NAME` (or, with `subcommands`, a group such as `glasslm inspect`)."""

    name: str
    run: Callable[..., int | None] | None  # called with one argument per parameter, built from the options
    help: str  # the line in `glasslm --help`
    description: str | None = None  # the top of `glasslm NAME --help`; none: `help`
    aliases: tuple[str, ...] = ()
    subcommands: tuple["Command", ...] = ()
    examples: tuple[str, ...] = ()  # command lines shown at the top of --help, after the description

    def parameters(self) -> list[tuple[str, type, Group, bool]]:
        """(parameter name, dataclass, Group, given only) for each parameter of `run`."""
        hints = typing.get_type_hints(self.run, include_extras=True)
        found = []
        for name, hint in hints.items():
            if name == "return":
                continue
            cls, base, group = hint, hint, Group()
            if typing.get_origin(hint) is typing.Annotated:
                base, *extras = typing.get_args(hint)
                group = next((m for m in extras if isinstance(m, Group)), group)
                cls = next((m for m in extras if isinstance(m, type) and dataclasses.is_dataclass(m)), base)
            found.append((name, cls, group, typing.get_origin(base) is dict))
        return found

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        for _, cls, group, _ in self.parameters():
            title = group.title or (cls.__doc__ or cls.__name__).strip().split("\n")[0]
            add_options(parser, cls, title, skip=group.skip, aliases=group.aliases,
                        shown_defaults=group.shown_defaults() if group.shown_defaults else None)
        parser.set_defaults(command_spec=self)

    def invoke(self, args: argparse.Namespace) -> int | None:
        values: dict[str, Any] = {}
        for name, cls, _, given_only in self.parameters():
            given = given_options(args, cls)
            values[name] = given if given_only else cls(**given)
        return self.run(**values)


def build_parser(commands: Sequence[Command], description: str = "") -> argparse.ArgumentParser:
    """The `glasslm` parser: one subparser per command (and per subcommand of a group)."""
    parser = ArgumentParser(prog="glasslm", description=description, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"glasslm {__version__}")
    _add_commands(parser, commands, "command")
    return parser


def _add_commands(parser: argparse.ArgumentParser, commands: Sequence[Command], dest: str) -> None:
    sub = parser.add_subparsers(dest=dest, required=True)
    for command in commands:
        # An alias gets a parser of its own, so its --help and errors name what was typed.
        for name in (command.name, *command.aliases):
            p = sub.add_parser(name, help=command.help if name == command.name else f"the same as {command.name}",
                               description=_description(command), formatter_class=HelpFormatter)
            if command.subcommands:
                _add_commands(p, command.subcommands, f"{command.name}_subcommand")
            else:
                command.add_to(p)
                p.usage = _short_usage(p)


def _description(command: Command) -> str:
    """The top of `glasslm NAME --help`: what the command does, then examples to copy."""
    text = command.description or command.help
    if command.examples:
        text += "\n\nexamples:\n" + "\n".join(f"  {line}" for line in command.examples)
    return text


def _short_usage(parser: argparse.ArgumentParser) -> str:
    """`glasslm NAME ARGS --required X [options]`: one line, so that --help opens with the
    description and examples and an error is not buried under every option."""
    parts = ["%(prog)s"]
    for action in parser._actions:
        if not action.option_strings:
            parts.append(str(action.metavar or action.dest) + (" ..." if action.nargs in ("*", "+") else ""))
        elif action.required:
            parts.append(f"{action.option_strings[0]} {action.metavar or 'VALUE'}")
    return " ".join(parts) + " [options]"
