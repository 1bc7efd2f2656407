"""`Served`: what every route of the app shares (model, tokenizer, config, engine), and how prompts are encoded.

`create_app` puts one on `app.state.served`; a route receives it as a parameter annotated
`ServedDep`, so a route module needs no closure over the app.

Example:
    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.tokenizers import CharTokenizer
    >>> tok = CharTokenizer.from_text("abc\\n")
    >>> model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=4, n_layers=1)).eval()
    >>> served = Served.build(model, tok)
    >>> served.name, served.encode("abc")
    ('glasslm', [1, 2, 3])
    >>> served.encode([7])
    Traceback (most recent call last):
    ...
    glasslm.serving.schemas.BadRequest: prompt: token id 7 is outside [0, 4)
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable

from fastapi import Depends, Request

from glasslm.core.model import TransformerLM
from glasslm.generation import encode_prompt, eos_ids
from glasslm.generation.constrained import Grammars
from glasslm.generation.engine import Engine
from glasslm.serving.config import ServeConfig
from glasslm.serving.schemas import BadRequest, SamplingFields, UnknownModel
from glasslm.tokenizers.gpt2 import has_gpt2_ids

# tiktoken's name for GPT-2's ids: lm-eval's tokenizer_backend=tiktoken sends it as the model
TIKTOKEN_GPT2 = "gpt2"


class ShownTokenizer:
    """The served tokenizer as the server shows text: ids from `known` on (a padded embedding table's
    rows, no token) decode to "" as transformers decodes them, and so do the ids in `skip`
    (`skip_special_tokens`). Everything else is the tokenizer's own.

    >>> from glasslm.tokenizers import CharTokenizer
    >>> shown = ShownTokenizer(CharTokenizer.from_text("ab"), known=3)
    >>> shown.decode([0, 7, 1, 2]), shown.vocab_size
    ('ab<|endoftext|>', 3)
    """

    def __init__(self, tokenizer: Any, known: int, skip: frozenset[int] = frozenset()):
        self.tokenizer, self.known, self.skip = tokenizer, known, skip

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([i for i in map(int, ids) if i < self.known and i not in self.skip])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


@dataclass
class Served:
    """The model behind the app, and the engine that decodes with it."""

    model: TransformerLM
    tokenizer: Any
    config: ServeConfig
    engine: Engine
    name: str
    eos: frozenset[int]  # tokens that end a completion: the model's eos ids (`eos_ids`), none with ignore_eos
    chat_template: str | None = None  # the Jinja template /v1/chat/completions renders messages with
    metrics_file: Path | None = None  # the served checkpoint's run's metrics.jsonl (/api/run), if it has one
    _grammars: Grammars | None = None

    @classmethod
    def build(cls, model: TransformerLM, tokenizer: Any, config: ServeConfig | None = None,
              chat_template: str | None = None, metrics_file: Path | None = None) -> Served:
        if tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer, so text cannot be encoded")
        config = config or ServeConfig()
        eos = frozenset() if config.ignore_eos else frozenset(eos_ids(model, tokenizer))
        engine = Engine(model, tokenizer, config.max_batch, config.max_queue, config.prefix_cache_mb << 20)
        return cls(model, tokenizer, config, engine,
                   config.name or "glasslm", eos, chat_template, metrics_file)

    @property
    def context_length(self) -> int:
        return self.model.config.context_length

    @property
    def token_count(self) -> int:
        """The ids that are tokens: the tokenizer's, where the embedding table has padding rows past them."""
        return min(self.tokenizer.vocab_size, self.model.config.vocab_size)

    @functools.cached_property
    def shown(self) -> ShownTokenizer:
        """The tokenizer decoding as responses show text (padding ids as "")."""
        return ShownTokenizer(self.tokenizer, self.token_count)

    def shown_for(self, skip_special_tokens: bool) -> ShownTokenizer:
        """`shown`, leaving out the special tokens' text too when asked to."""
        if not skip_special_tokens:
            return self.shown
        specials = frozenset((getattr(self.tokenizer, "special_tokens", None) or {}).values())
        return ShownTokenizer(self.tokenizer, self.token_count, specials)

    @functools.cached_property
    def names(self) -> frozenset[str]:
        """The model names a request may give: the served name, and tiktoken's "gpt2" where the
        tokenizer gives GPT-2's ids (so lm-eval's tokenizer_backend=tiktoken works under any name)."""
        return frozenset({self.name, TIKTOKEN_GPT2} if has_gpt2_ids(self.tokenizer) else {self.name})

    def grammars(self, field: str) -> Grammars:
        """The grammar compiler over this model's ids (built at the first structured request and kept),
        or a 400 naming `field` where the model has no end-of-sequence token to end a finished text."""
        if self._grammars is None:
            eos = eos_ids(self.model, self.tokenizer)
            if not eos:
                raise BadRequest(f"{field}: this model has no end-of-sequence token, so a constrained answer "
                                 "could not end", field)
            self._grammars = Grammars(self.tokenizer, self.model.config.vocab_size, eos)
        return self._grammars

    def check_model(self, requested: str | None) -> None:
        """`UnknownModel` (a 404) unless `requested` is None or one of `names`."""
        if requested is not None and requested != self.name and requested not in self.names:
            also = f" (or {TIKTOKEN_GPT2!r}: its tokenizer is GPT-2's)" if len(self.names) > 1 else ""
            raise UnknownModel(f"model {requested!r} not found; this server serves {self.name!r}{also}", "model")

    def check(self, body: SamplingFields, prompts: int = 1) -> None:
        """What a request asks of this model and server, checked before any work is queued."""
        self.check_model(body.model)
        room = self.config.max_batch + self.config.max_queue
        if prompts * body.n > room:  # would never fit, however idle the server: not a 429
            asked = f"{prompts} prompts x n={body.n} is {prompts * body.n}" if prompts > 1 else f"n={body.n}"
            raise BadRequest(f"n: {asked} completions; this server takes at most {room} at once "
                             "(--max-batch + --max-queue)", "n")
        for field, ids, bound in (("logit_bias", map(int, body.logit_bias or {}), self.token_count),
                                  ("stop_token_ids", body.stop_token_ids or (), self.model.config.vocab_size)):
            bad = [i for i in ids if i >= bound]
            if bad:
                raise BadRequest(f"{field}: token id {bad[0]} is outside [0, {bound})", field)
        field, asked = body.alternatives()
        vocab = self.model.config.vocab_size
        if asked is not None and asked > vocab:
            raise BadRequest(f"{field}: {asked} is more than the vocabulary's {vocab} tokens", field)
        field, asked = body.asked_tokens()
        limit = self.config.max_tokens_limit
        if asked is not None and asked > limit:
            raise BadRequest(f"{field}: {asked} is more than this server's limit {limit}", field)

    def encode(self, prompt: str | list[int] | list[str], limit: int | None = None, what: str = "prompt") -> list[int]:
        """Token ids of a request's text or ids, checked; `BadRequest` naming `what` otherwise.

        `limit` defaults to the context length. An empty string starts from the tokenizer's bos
        where it has one, else from a newline (`encode_prompt`).
        """
        limit = limit or self.context_length
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise BadRequest("prompt: only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            try:
                ids = encode_prompt(self.tokenizer, prompt)
            except ValueError as err:
                raise BadRequest(f"{what}: {err}", what) from None
        else:
            ids = list(prompt)
            vocab = self.model.config.vocab_size
            bad = [i for i in ids if not 0 <= i < vocab]
            if bad:
                raise BadRequest(f"{what}: token id {bad[0]} is outside [0, {vocab})", what)
        if not ids:
            raise BadRequest(f"{what}: the {what} encodes to no tokens", what)
        if len(ids) > limit:
            raise BadRequest(f"{what}: the {what} is {len(ids)} tokens; at most {limit} are allowed"
                             + (" (the model's context length)" if limit == self.context_length else ""), what)
        return ids

    def run_locked(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(model, tokenizer, ...)` while the engine is between steps; its ValueErrors become 400s.
        The tokenizer is `shown`: padding ids read as ""."""
        with self.engine.model_lock:
            try:
                return fn(self.model, self.shown, *args, **kwargs)
            except (ValueError, KeyError) as err:
                raise BadRequest(str(err).strip("'\"")) from None


def served(request: Request) -> Served:
    """The app's `Served` (a FastAPI dependency)."""
    return request.app.state.served


ServedDep = Annotated[Served, Depends(served)]
