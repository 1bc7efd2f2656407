"""`glasslm generate` (or `sample`): write text from a checkpoint, streamed as it is decoded."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from glasslm.cli.command import Command
from glasslm.cli.common import CheckpointOption, RuntimeOptions, Terminated, load_for_inference
from glasslm.cli.options import Group
from glasslm.generation import GenerationConfig, encode_prompt, with_eos, with_vocab_limit


@dataclass
class PromptOptions:
    """the prompt (one of --prompt, --prompt-file, --interactive)"""

    prompt: str = field(default="", metadata={"exclusive": "prompt"})  # the prompt text; '-' reads it from stdin;
                                                                       # empty: the tokenizer's bos, else a newline
    prompt_file: str | None = field(default=None, metadata={"exclusive": "prompt"})  # read the prompt from this
                                                                                     # UTF-8 file
    interactive: bool = field(default=False, metadata={"exclusive": "prompt"})  # keep the model loaded and
                                                                                # answer each line of stdin until EOF

    def read(self) -> str:
        if self.prompt_file:
            if Path(self.prompt_file).is_dir():
                raise ValueError(f"--prompt-file {self.prompt_file} is a directory, not a text file")
            return Path(self.prompt_file).read_text(encoding="utf-8")
        return sys.stdin.read() if self.prompt == "-" else self.prompt


@dataclass
class DraftOptions:
    """speculative decoding"""

    # a small checkpoint with the same vocabulary for speculative decoding; output stays the model's
    # own greedy tokens, needs --temperature 0
    draft: str | None = None
    lookahead: int = field(default=4, metadata={"minimum": 1})  # tokens the draft proposes per target pass


SAMPLING = Group("sampling", skip=frozenset({"logprobs", "pad_token", "vocab_limit"}),
                 aliases={"stop_strings": ["--stop"], "stop_tokens": ["--stop-token"]})


def generate(source: CheckpointOption, prompt: PromptOptions, sampling: Annotated[GenerationConfig, SAMPLING],
             runtime: RuntimeOptions, speculation: DraftOptions) -> int:
    model, tokenizer = load_for_inference(source.checkpoint, runtime, decoding=True, base=source.base)
    draft = None
    if speculation.draft:
        if sampling.temperature != 0:
            raise ValueError("--draft (speculative decoding) is greedy here: add --temperature 0")
        draft, _ = load_for_inference(speculation.draft, runtime, decoding=True, need_tokenizer=False)
    if sampling.compile:
        _say_whether_compiling_pays(model, sampling, speculation.draft is not None, prompt.interactive)
    writer = _Writer(model, draft, tokenizer, sampling, speculation.lookahead)
    if prompt.interactive:
        _answer_lines(writer)
    else:
        writer.respond(prompt.read(), echo=True)
    return 0


def _say_whether_compiling_pays(model: Any, sampling: GenerationConfig, drafting: bool, interactive: bool) -> None:
    """--compile is the user's to choose, so it is never dropped silently: one line says when it
    does nothing (speculative decoding runs eagerly) or when this generation is too short to win
    the compiling back. Interactive answers share one compiled step, so they are not judged."""
    from glasslm.generation.compiled import compile_advice
    from glasslm.transforms import parameter_count

    if drafting:
        print("note: --compile does nothing with --draft: speculative decoding runs eagerly", file=sys.stderr)
        return
    advice = None if interactive else compile_advice(parameter_count(model), sampling.max_new_tokens)
    if advice:
        print(advice, file=sys.stderr)


@dataclass
class _Writer:
    """Streams one answer to stdout and its speed to stderr."""

    model: Any
    draft: Any
    tokenizer: Any
    config: GenerationConfig
    lookahead: int

    streamer: Any = None

    def __post_init__(self) -> None:
        # Stop at the model's eos ids (generation_config.json's, else the tokenizer's) unless --ignore-eos;
        # never pick a padded embedding table's rows past the tokenizer.
        self.config = with_vocab_limit(with_eos(self.config, self.model, self.tokenizer), self.model, self.tokenizer)

    def respond(self, prompt: str, echo: bool) -> str:
        import time
        from contextlib import nullcontext

        from glasslm.generation import TextStreamer
        from glasslm.generation.compiled import CompileClock, compile_clock
        from glasslm.generation.speculative import SpeculativeStats

        prompt_ids = encode_prompt(self.tokenizer, prompt)  # an empty prompt: bos, else a newline
        if not prompt_ids:
            raise ValueError("the prompt encodes to no tokens")
        if echo:
            sys.stdout.write(prompt)
        streamer, stats = TextStreamer(self.tokenizer, self.config.stop_strings), SpeculativeStats()
        self.streamer = streamer  # what was written so far, even if Ctrl-C ends the answer
        start, n_tokens = time.perf_counter(), 0
        timing_compiles = self.config.compile and self.draft is None  # speculative decoding runs eagerly
        with compile_clock() if timing_compiles else nullcontext(CompileClock()) as compiling:
            for token in self._tokens(prompt_ids, stats):
                n_tokens += 1
                sys.stdout.write(streamer.push(token))
                sys.stdout.flush()
                if streamer.stopped:
                    break
        sys.stdout.write(streamer.finish() + "\n")
        sys.stdout.flush()
        seconds = time.perf_counter() - start - compiling.seconds  # decoding alone
        speculation = "" if self.draft is None else (
            f", draft accepted {stats.acceptance_rate:.0%} of proposals, "
            f"{stats.tokens_per_target_pass:.2f} tokens per target pass")
        compiled = f"; compiling took {compiling.seconds:.2f} s more" if compiling.compiles else ""
        print(f"[{n_tokens} tokens in {seconds:.2f} s: {n_tokens / max(seconds, 1e-9):.1f} tokens/s, "
              f"prompt {len(prompt_ids)} tokens{speculation}{compiled}]", file=sys.stderr)
        return streamer.text

    def _tokens(self, prompt_ids: list[int], stats: Any) -> Any:
        from glasslm.generation import generate_tokens
        from glasslm.generation.speculative import speculative_tokens

        if self.draft is None:
            return generate_tokens(self.model, prompt_ids, config=self.config)
        return speculative_tokens(self.model, self.draft, prompt_ids, self._fitting_new_tokens(prompt_ids),
                                  self.lookahead, self.config.stop_tokens or (), stats, self.config.vocab_limit)

    def _fitting_new_tokens(self, prompt_ids: list[int]) -> int:
        """--max-new-tokens, capped (and said so) to what fits both contexts: speculative decoding
        does not slide its window, so prompt + new tokens + lookahead + 1 must fit."""
        bounded = [m.config.context_length for m in (self.model, self.draft) if m.config.positional != "none"]
        context = min(bounded, default=0)
        fits = context - len(prompt_ids) - self.lookahead - 1
        if not bounded or fits < 1 or self.config.max_new_tokens <= fits:
            return self.config.max_new_tokens  # speculative_tokens names what does not fit
        print(f"[--draft: {fits} new tokens, not {self.config.max_new_tokens}: the prompt ({len(prompt_ids)} tokens) "
              f"+ lookahead {self.lookahead} + 1 leave that many in the context of {context}]", file=sys.stderr)
        return fits


def _answer_lines(writer: _Writer) -> None:
    """The model stays loaded; every line read from stdin is a new prompt, until EOF. Ctrl-C stops
    the answer being written (back to the prompt); at the prompt it ends the session."""
    tty = sys.stdin.isatty()
    print("glasslm interactive: one prompt per line; Ctrl-C stops an answer; Ctrl-D (or Ctrl-C here) quits",
          file=sys.stderr)
    while True:
        try:
            if tty:
                sys.stderr.write("> ")
                sys.stderr.flush()
            line = sys.stdin.readline()
        except KeyboardInterrupt:
            line = ""
        if not line:  # EOF or Ctrl-C at the prompt: a clean exit
            if tty:
                sys.stderr.write("\n")
            return
        try:
            writer.respond(line.rstrip("\n"), echo=False)
        except Terminated:
            raise
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            sys.stdout.flush()
            print("[stopped]", file=sys.stderr)


COMMAND = Command("sample", generate, "write text from a trained checkpoint (streamed)", aliases=("generate",),
                  examples=(
                      'glasslm generate --checkpoint runs/shakespeare-char-cpu --prompt "ROMEO:" --max-new-tokens 300',
                      'glasslm generate --checkpoint runs/shakespeare-char-cpu --interactive',
                  ))
