"""`glasslm chat --checkpoint DIR`: a conversation in the terminal with a chat model.

Each line you type is a user turn; the whole conversation so far is rendered with the model's
chat template (`glasslm.tokenizers.chat`, as transformers' `apply_chat_template` renders it) and
the answer streams until the model's eos (`--ignore-eos` to go on) or --max-new-tokens. `/reset`
forgets the conversation (the --system message stays). Ctrl-C stops the answer being written
(what was written stays in the history); Ctrl-C or Ctrl-D at the prompt ends the session.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Annotated, Any

from glasslm.cli.command import Command
from glasslm.cli.common import CheckpointOption, RuntimeOptions, Terminated, load_for_inference
from glasslm.cli.generate import SAMPLING, _Writer
from glasslm.generation import GenerationConfig
from glasslm.tokenizers.chat import ChatFormat

RESET = "/reset"


@dataclass
class ChatOptions:
    """the conversation"""

    system: str | None = None  # a system message that opens the conversation (kept across /reset)
    # a Jinja chat template file; none: the checkpoint's own (chat_template.jinja or tokenizer_config.json's)
    chat_template: str | None = None


def chat(source: CheckpointOption, options: ChatOptions, sampling: Annotated[GenerationConfig, SAMPLING],
         runtime: RuntimeOptions) -> int:
    from glasslm.hf import load_chat_template
    from glasslm.tokenizers.chat import read_template_file

    if options.chat_template:
        read_template_file(options.chat_template)  # a bad file is refused before the model is loaded
    model, tokenizer = load_for_inference(source.checkpoint, runtime, decoding=True, base=source.base)
    template = load_chat_template(source.checkpoint, tokenizer, options.chat_template)
    if template is None:
        raise ValueError(f"{source.checkpoint} has no chat template (chat_template.jinja or tokenizer_config.json's "
                         "chat_template): give one with --chat-template FILE")
    writer = _Writer(model, None, tokenizer, sampling, 0)
    Conversation(writer, ChatFormat.for_tokenizer(template, tokenizer), options.system).run()
    return 0


class Conversation:
    """The history of one terminal chat, and the loop that reads turns and writes answers."""

    def __init__(self, writer: _Writer, chat: ChatFormat, system: str | None):
        self.writer, self.chat = writer, chat
        self.opening = [{"role": "system", "content": system}] if system else []
        self.messages: list[dict[str, Any]] = list(self.opening)

    def run(self) -> None:
        tty = sys.stdin.isatty()
        print(f"glasslm chat: one message per line; {RESET} forgets the conversation; Ctrl-C stops an answer; "
              "Ctrl-D (or Ctrl-C here) quits", file=sys.stderr)
        while True:
            line = _read_line("you> " if tty else "")
            if line is None:
                if tty:
                    sys.stderr.write("\n")
                return
            text = line.rstrip("\n")
            if text.strip() == RESET:
                self.messages = list(self.opening)
                print("[conversation reset]", file=sys.stderr)
            elif text.strip():
                self.answer(text)

    def answer(self, text: str) -> None:
        """Render the conversation with `text` as the next user turn and stream the answer."""
        self.messages.append({"role": "user", "content": text})
        prompt = self.chat.prompt(self.messages)
        try:
            answer = self.writer.respond(prompt, echo=False)
        except Terminated:
            raise
        except KeyboardInterrupt:
            answer = self.writer.streamer.text if self.writer.streamer is not None else ""
            sys.stdout.write("\n")
            sys.stdout.flush()
            print("[stopped]", file=sys.stderr)
        self.messages.append({"role": "assistant", "content": answer})


def _read_line(marker: str) -> str | None:
    """A line of stdin; None at EOF or Ctrl-C (at the prompt, Ctrl-C ends the session)."""
    try:
        if marker:
            sys.stderr.write(marker)
            sys.stderr.flush()
        line = sys.stdin.readline()
    except KeyboardInterrupt:
        return None
    return line or None


COMMAND = Command("chat", chat, "talk with a chat model in the terminal (its chat template, history kept)",
                  examples=(
                      'glasslm chat --checkpoint runs/llama-chat',
                      'glasslm chat --checkpoint runs/llama-chat --system "Answer briefly." --temperature 0',
                  ))
