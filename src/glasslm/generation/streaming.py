"""Text out of tokens as they come: UTF-8-safe streaming, stop strings, and one-call helpers.

A byte-level token can be half of a UTF-8 character, and a stop string can arrive split over
several tokens, so text is released only once it is settled.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from glasslm.generation.decoding import generate_tokens
from glasslm.core.model import TransformerLM
from glasslm.generation.sampling import GenerationConfig, Tokenizer, find_stop, make_config, with_eos, with_vocab_limit
from glasslm.tokenizers import bos_token_id

REPLACEMENT_CHAR = "\ufffd"  # what a decoder prints for an incomplete UTF-8 sequence


class TextStreamer:
    """Turns token ids, pushed one at a time, into text pieces that are safe to print now.

    A byte-level BPE token can be part of a UTF-8 character, and the tail of the text may be the
    start of a stop string, so each push decodes everything so far and returns only the new,
    settled part (see `settled_length`). Once a stop string appears, `stopped` is set and the text
    ends exactly before it (with `include_stop`, exactly after it).

    >>> from glasslm.tokenizers import CharTokenizer
    >>> tok = CharTokenizer.from_text("abc.")
    >>> streamer = TextStreamer(tok, stop_strings=["c."])
    >>> [streamer.push(t) for t in tok.encode("abcab")]  # "c" waits: it might start "c."
    ['a', 'b', '', 'ca', 'b']
    >>> streamer = TextStreamer(tok, stop_strings=["c."])
    >>> [streamer.push(t) for t in tok.encode("abc.a")], streamer.text, streamer.stopped
    (['a', 'b', '', '', ''], 'ab', True)
    """

    def __init__(self, tokenizer: Tokenizer, stop_strings: Sequence[str] = (), include_stop: bool = False):
        self.tokenizer, self.stop_strings, self.include_stop = tokenizer, tuple(stop_strings), include_stop
        self.tokens: list[int] = []
        self.text = ""  # everything decoded so far
        self.shown = 0  # how many characters of it were returned
        self.stopped = False

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self.tokens.append(token)
        self.text = self.tokenizer.decode(self.tokens)
        cut = find_stop(self.text, self.stop_strings)
        if cut >= 0:
            if self.include_stop:  # the stop that just completed: the shortest one starting at the cut
                cut += min(len(s) for s in self.stop_strings if self.text.startswith(s, cut))
            self.stopped = True
            self.text = self.text[:cut]
            return self._take(cut)
        return self._take(settled_length(self.text, self.stop_strings))

    def finish(self) -> str:
        """Whatever is still held back, once no more tokens will come."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        piece = self.text[self.shown:end] if end > self.shown else ""
        self.shown = max(self.shown, end)
        return piece


def stream_text(
    model: TransformerLM, tokenizer: Tokenizer, prompt: str | Sequence[int],
    config: GenerationConfig | None = None, **controls: Any,
) -> Iterator[str]:
    """Yield the generated text in pieces as tokens arrive, ending exactly before any stop string
    or eos token (see `with_eos`). An empty prompt starts from bos (`encode_prompt`); ids past the
    tokenizer (a padded embedding table's) are never picked (`with_vocab_limit`)."""
    config = with_vocab_limit(with_eos(make_config(config, **controls), model, tokenizer), model, tokenizer)
    prompt_ids = encode_prompt(tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
    streamer = TextStreamer(tokenizer, config.stop_strings)
    for token in generate_tokens(model, prompt_ids, config=config):
        piece = streamer.push(token)
        if piece:
            yield piece
        if streamer.stopped:
            return
    piece = streamer.finish()
    if piece:
        yield piece


def encode_prompt(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """The ids of `prompt`; an empty prompt is the tokenizer's bos where it has one (as transformers
    starts), else a newline, the most neutral context a text model without one knows.

    >>> from glasslm.tokenizers import CharTokenizer
    >>> encode_prompt(CharTokenizer.from_text("ab\\n"), "")  # its bos, <|endoftext|>
    [3]
    >>> encode_prompt(CharTokenizer(["\\n", "a", "b"]), "")  # no bos (a file from before it had one)
    [0]
    """
    if prompt:
        return tokenizer.encode(prompt)
    bos = bos_token_id(tokenizer)
    ids = [bos] if bos is not None else tokenizer.encode("\n")
    if not ids:
        raise ValueError("the prompt is empty and the tokenizer has neither a bos token nor a newline to start from")
    return ids


def settled_length(text: str, stop_strings: Sequence[str] = ()) -> int:
    """Length of the prefix of `text` that later tokens can no longer change or cut.

    >>> settled_length("abc\ufffd"), settled_length("hello wo", ["world"])
    (3, 6)
    """
    end = len(text)
    while end > 0 and text[end - 1] == REPLACEMENT_CHAR:
        end -= 1  # maybe the first bytes of a character whose remaining bytes are still to come
    settled = end
    for stop in stop_strings:
        # If the text ends with the start of a stop string, that start may yet become the stop.
        for n in range(min(len(stop) - 1, end), 0, -1):
            if text[:end].endswith(stop[:n]):
                settled = min(settled, end - n)
                break
    return settled


def generate_text(
    model: TransformerLM, tokenizer: Tokenizer, prompt: str, config: GenerationConfig | None = None,
    **controls: Any,
) -> str:
    """The generated continuation of `prompt` as one string (without the prompt).

    >>> from glasslm.presets import get_preset
    >>> from glasslm.tokenizers import CharTokenizer
    >>> tok = CharTokenizer.from_text("abc")
    >>> model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=3, n_layers=1)).eval()
    >>> len(generate_text(model, tok, "ab", max_new_tokens=5, seed=0))
    5
    """
    return "".join(stream_text(model, tokenizer, prompt, config, **controls))
