"""The `glasslm` command line: one module per command, each a function of dataclass configs
whose options are generated from those dataclasses (glasslm.cli.command). Adding a command is
one new module and one line in COMMANDS.

    glasslm train --preset shakespeare-char-cpu --data tinyshakespeare --out runs/shakespeare-char-cpu
    glasslm train --resume runs/shakespeare-char-cpu --max-steps 4000
    torchrun --nproc_per_node=2 -m glasslm.cli train --batch-size 6 --out runs/ddp
    glasslm plot runs/shakespeare-char-cpu
    glasslm finetune --checkpoint runs/shakespeare-char-cpu --data examples/chat/shakespeare.jsonl --chat-template examples/chat/template.jinja --out runs/ft
    glasslm merge --checkpoint runs/ft --out runs/ft-merged --to-hf
    glasslm generate --checkpoint runs/shakespeare-char-cpu --prompt "ROMEO:" --max-new-tokens 300
    glasslm eval --checkpoint runs/shakespeare-char-cpu --data tinyshakespeare
    glasslm info --preset gpt2-small --context-length 1024
    glasslm download HuggingFaceTB/SmolLM2-135M-Instruct
    glasslm convert --from-hf path/to/hf-gpt2 --out runs/gpt2
    glasslm convert --to-hf --checkpoint runs/gpt2 --out runs/exported-gpt2
    glasslm convert --from nanogpt --checkpoint out/ckpt.pt --out runs/nano
    glasslm inspect attention --checkpoint runs/shakespeare-char-cpu --prompt "ROMEO:" --layer 0 --head 1 --out runs/attn.png
    glasslm inspect logit-lens --checkpoint runs/shakespeare-char-cpu --prompt "ROMEO:" --out runs/lens.png
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

from glasslm.cli import (chat, convert, download, evaluate, fetch, finetune, generate, info, inspection, merge, plot,
                         prepare, quantize, serve, train, train_tokenizer)
from glasslm.cli.command import Command
from glasslm.cli.command import build_parser as build_command_parser
from glasslm.cli.common import Terminated

COMMANDS: tuple[Command, ...] = (
    train.COMMAND,
    finetune.COMMAND,
    merge.COMMAND,
    plot.COMMAND,
    generate.COMMAND,
    chat.COMMAND,
    evaluate.COMMAND,
    info.COMMAND,
    convert.COMMAND,
    inspection.COMMAND,
    serve.COMMAND,
    quantize.COMMAND,
    train_tokenizer.COMMAND,
    fetch.COMMAND,
    download.COMMAND,
    prepare.COMMAND,
)


# The top of `glasslm --help`: what a user types, not how the options are made.
DESCRIPTION = """glasslm: train, run, inspect and serve small transformer language models.

first steps:
  glasslm train                                  # a 0.8M-parameter model on tiny Shakespeare (~1 min on 2 CPU cores)
  glasslm generate --checkpoint runs/shakespeare-char-cpu --prompt "ROMEO:"
  glasslm serve --checkpoint runs/shakespeare-char-cpu   # the explorer at http://127.0.0.1:8000
  glasslm train --data my.txt --out runs/mine    # your own text

`glasslm COMMAND --help` shows a command's examples and options."""


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command in COMMANDS."""
    return build_command_parser(COMMANDS, description=DESCRIPTION)


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated()


def _describe(err: BaseException) -> str:
    """One line for the user: OS errors as "what: path", everything else as its message."""
    if isinstance(err, OSError) and err.strerror:
        where = f": {err.filename}" if err.filename else ""
        return f"{err.strerror}{where}"
    return " ".join(str(err).split("\n"))


def main(argv: list[str] | None = None) -> int:
    """Run one command. Every user-facing error goes through here once: a single line
    `glasslm COMMAND: error: ...` on stderr and exit status 1, never a traceback."""
    import signal
    import threading

    args = build_parser().parse_args(argv)
    if args.command not in ("train", "finetune") and threading.current_thread() is threading.main_thread():
        # train saves a checkpoint on SIGTERM itself; other commands unwind like Ctrl-C, removing
        # half-written output (prepare's .tmp files) on the way out.
        signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        code = args.command_spec.invoke(args)
        sys.stdout.flush()  # a reader that went away shows here, while the handler below can see it
    except BrokenPipeError:
        return _reader_gone()
    except (ValueError, FileNotFoundError, RuntimeError, FloatingPointError, OSError, ImportError) as err:
        # ImportError: an optional package is missing (prepare's pyarrow, eval's lm-eval); its message
        # names what to install, which is all the user needs
        print(f"glasslm {args.command}: error: {_describe(err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:
        print(f"glasslm {args.command}: interrupted", file=sys.stderr)
        return 128 + getattr(err, "signum", 2)
    return code or 0


def _reader_gone() -> int:
    """stdout's reader closed the pipe (`glasslm info | head`): stop quietly, as Unix tools do, with
    the status of a process SIGPIPE ended. stdout then points at /dev/null, so the interpreter's
    last flush of what is still buffered cannot fail again."""
    import os
    import signal

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout replaced by an object without a descriptor
        pass
    return 128 + signal.SIGPIPE


def run() -> NoReturn:
    """The `glasslm` executable: `main` on the command line's arguments, its status the exit code."""
    from glasslm.training.distributed import exit_process

    exit_process(main())


__all__ = ["COMMANDS", "build_parser", "main", "run"]
