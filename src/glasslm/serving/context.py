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

from dataclasses import dataclass
from typing import Annotated, Any, Callable

from fastapi import Depends, Request

from glasslm.core.model import TransformerLM
from glasslm.generation import encode_prompt, eos_ids
from glasslm.generation.engine import Engine
from glasslm.serving.config import ServeConfig
from glasslm.serving.schemas import BadRequest


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

    @classmethod
    def build(cls, model: TransformerLM, tokenizer: Any, config: ServeConfig | None = None,
              chat_template: str | None = None) -> Served:
        if tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer, so text cannot be encoded")
        config = config or ServeConfig()
        eos = frozenset() if config.ignore_eos else frozenset(eos_ids(model, tokenizer))
        return cls(model, tokenizer, config, Engine(model, tokenizer, config.max_batch, config.max_queue),
                   config.name or "glasslm", eos, chat_template)

    @property
    def context_length(self) -> int:
        return self.model.config.context_length

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
        """`fn(model, tokenizer, ...)` while the engine is between steps; its ValueErrors become 400s."""
        with self.engine.model_lock:
            try:
                return fn(self.model, self.tokenizer, *args, **kwargs)
            except (ValueError, KeyError) as err:
                raise BadRequest(str(err).strip("'\"")) from None


def served(request: Request) -> Served:
    """The app's `Served` (a FastAPI dependency)."""
    return request.app.state.served


ServedDep = Annotated[Served, Depends(served)]
