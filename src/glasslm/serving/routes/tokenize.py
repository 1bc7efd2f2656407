"""vLLM's tokenizer endpoints, for clients that count or build token ids themselves (lm-eval's
`tokenizer_backend=remote`): POST /tokenize and /detokenize, GET /tokenizer_info.

`{"prompt": text}` -> `{"tokens": [ids], "count": n, "max_model_len": context length}` (a text longer
than the context is still tokenized: the count says how much is too much); `{"tokens": [ids]}` ->
`{"prompt": text}`. Ids outside the vocabulary and characters the tokenizer lacks are 400s naming the field.
/tokenizer_info gives the special tokens' text (`eos_token`, `bos_token`, `pad_token`, `unk_token`),
the chat template and the context length.

Example:
    >>> from fastapi import FastAPI
    >>> app = FastAPI()
    >>> app.include_router(router)
    >>> sorted(app.openapi()["paths"])
    ['/detokenize', '/tokenize', '/tokenizer_info']
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from glasslm.generation import eos_ids
from glasslm.serving.context import ServedDep
from glasslm.serving.schemas import BadRequest
from glasslm.tokenizers import special_token_ids

router = APIRouter()


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    prompt: str
    model: str | None = None
    add_special_tokens: bool = True  # vLLM's field; glasslm's tokenizers add none either way


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    tokens: list[int]
    model: str | None = None


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, served: ServedDep) -> Any:
    """The prompt's token ids, their count and the model's context length."""
    served.check_model(body.model)
    try:
        ids = served.tokenizer.encode(body.prompt)
    except ValueError as err:
        raise BadRequest(f"prompt: {err}", "prompt") from None
    return {"tokens": ids, "count": len(ids), "max_model_len": served.context_length}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, served: ServedDep) -> Any:
    """The text of the token ids (a padded embedding table's rows past the tokenizer read as "")."""
    served.check_model(body.model)
    vocab = served.model.config.vocab_size
    bad = [i for i in body.tokens if not 0 <= i < vocab]
    if bad:
        raise BadRequest(f"tokens: token id {bad[0]} is outside [0, {vocab})", "tokens")
    return {"prompt": served.shown.decode(body.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(served: ServedDep) -> dict[str, Any]:
    """The tokenizer's special tokens (text) and chat template, as vLLM's endpoint gives them: what
    lm-eval's `tokenizer_backend=remote` reads before it tokenizes through /tokenize and /detokenize."""
    roles = special_token_ids(served.tokenizer)
    if roles["eos"] is None and eos_ids(served.model, served.tokenizer):
        roles["eos"] = eos_ids(served.model, served.tokenizer)[0]  # the model's own, where the tokenizer names none
    texts = {f"{role}_token": None if i is None else served.shown.decode([i]) for role, i in roles.items()}
    return {**texts, "chat_template": served.chat_template, "model_max_length": served.context_length,
            "vocab_size": served.token_count, "tokenizer_class": getattr(served.tokenizer, "kind", None)}
