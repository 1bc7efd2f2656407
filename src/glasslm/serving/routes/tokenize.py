"""POST /tokenize and /detokenize in vLLM's shapes, for clients that count or build token ids themselves.

`{"prompt": text}` -> `{"tokens": [ids], "count": n, "max_model_len": context length}` (a text longer
than the context is still tokenized: the count says how much is too much); `{"tokens": [ids]}` ->
`{"prompt": text}`. Ids outside the vocabulary and characters the tokenizer lacks are 400s naming the field.

Example:
    >>> from fastapi import FastAPI
    >>> app = FastAPI()
    >>> app.include_router(router)
    >>> sorted(app.openapi()["paths"])
    ['/detokenize', '/tokenize']
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from glasslm.serving.context import ServedDep
from glasslm.serving.errors import error_response
from glasslm.serving.schemas import BadRequest

router = APIRouter()


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str
    model: str | None = None
    add_special_tokens: bool = True  # vLLM's field; glasslm's tokenizers add none either way


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tokens: list[int]
    model: str | None = None


def _other_model(requested: str | None, name: str) -> Any:
    if requested is not None and requested != name:
        return error_response(404, f"model {requested!r} not found; this server serves {name!r}", "not_found", "model")
    return None


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, served: ServedDep) -> Any:
    """The prompt's token ids, their count and the model's context length."""
    refused = _other_model(body.model, served.name)
    if refused is not None:
        return refused
    try:
        ids = served.tokenizer.encode(body.prompt)
    except ValueError as err:
        raise BadRequest(f"prompt: {err}", "prompt") from None
    return {"tokens": ids, "count": len(ids), "max_model_len": served.context_length}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, served: ServedDep) -> Any:
    """The text of the token ids."""
    refused = _other_model(body.model, served.name)
    if refused is not None:
        return refused
    vocab = served.model.config.vocab_size
    bad = [i for i in body.tokens if not 0 <= i < vocab]
    if bad:
        raise BadRequest(f"tokens: token id {bad[0]} is outside [0, {vocab})", "tokens")
    try:
        return {"prompt": served.tokenizer.decode(body.tokens)}
    except (ValueError, KeyError, IndexError) as err:  # a tokenizer smaller than the embedding table
        raise BadRequest(f"tokens: {err}", "tokens") from None
