"""The explorer page (/ and /static) and its JSON endpoints: thin wrappers around `glasslm.interp.explore`.

The routes check what a request itself gets wrong (token ids, lengths, one-token answers) and
answer 400 naming the field; the numbers are `explore`'s.

Each endpoint takes the engine's model lock (`Served.run_locked`), which the worker holds during
a decode step, so hooks never see a decode step's activations.

Example:
    >>> from fastapi import FastAPI
    >>> app = FastAPI()
    >>> app.include_router(router)
    >>> paths = sorted(p for p in app.openapi()["paths"] if p.startswith("/api"))
    >>> paths[:5]
    ['/api/attention', '/api/experts', '/api/head-scores', '/api/info', '/api/logit-attribution']
    >>> paths[5:]
    ['/api/logit-lens', '/api/next-token', '/api/patching', '/api/token-loss', '/api/tokenize']
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from glasslm.interp.explore import (activation_patching, attention, expert_choices, head_scores, logit_attribution,
                                    logit_lens, next_token, page_defaults, token_loss, token_texts)
from glasslm.serving import schemas
from glasslm.serving.context import ServedDep
from glasslm.transforms import parameter_count

STATIC_DIR = Path(__file__).parent.parent / "static"
LOSS_LIMIT_CONTEXTS = 16  # /api/token-loss scores (and /api/tokenize splits) texts up to this many context lengths

router = APIRouter()
router.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")


@router.get("/", include_in_schema=False)
async def index() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html")


@router.get("/api/info")
def info(served: ServedDep) -> dict[str, Any]:
    model, c = served.model, served.model.config
    return {"model": served.name, "context_length": c.context_length, "vocab_size": c.vocab_size,
            "n_layers": c.n_layers, "n_heads": c.n_heads, "n_experts": c.n_experts, "d_model": c.d_model, "parameters": parameter_count(model),
            "tokenizer": getattr(served.tokenizer, "kind", type(served.tokenizer).__name__),
            "max_tokens_limit": served.config.max_tokens_limit,
            "defaults": page_defaults(served.tokenizer, c.context_length)}  # the page's example texts


@router.post("/api/tokenize")
def api_tokenize(body: schemas.TextRequest, served: ServedDep) -> dict[str, Any]:
    # Longer than the context: the page tokenizes a long text to show (and say) which window it inspects.
    limit = LOSS_LIMIT_CONTEXTS * served.context_length
    ids = body.ids(lambda value, what: served.encode(value, limit=limit, what=what))
    return {"tokens": ids, "texts": token_texts(served.tokenizer, ids)}


@router.post("/api/next-token")
def api_next_token(body: schemas.NextTokenRequest, served: ServedDep) -> Any:
    ids = body.ids(lambda value, what: served.encode(value, what=what))
    return served.run_locked(next_token, ids, body.temperature, body.top_k or None, body.top_p, body.min_p, body.k)


@router.post("/api/token-loss")
def api_token_loss(body: schemas.TextRequest, served: ServedDep) -> Any:
    limit = LOSS_LIMIT_CONTEXTS * served.context_length
    return served.run_locked(token_loss, body.ids(lambda value, what: served.encode(value, limit=limit, what=what)))


@router.post("/api/attention")
def api_attention(body: schemas.AttentionRequest, served: ServedDep) -> Any:
    config = served.model.config
    if body.layer >= config.n_layers:
        raise schemas.BadRequest(f"layer: layer {body.layer} does not exist; the model has layers 0..{config.n_layers - 1}",
                                 "layer")
    if body.head is not None and body.head >= config.n_heads:
        raise schemas.BadRequest(f"head: head {body.head} does not exist; the model has heads 0..{config.n_heads - 1}",
                                 "head")
    return served.run_locked(attention, body.ids(lambda value, what: served.encode(value, what=what)), body.layer, body.head)


@router.post("/api/logit-lens")
def api_logit_lens(body: schemas.TextRequest, served: ServedDep) -> Any:
    return served.run_locked(logit_lens, body.ids(lambda value, what: served.encode(value, what=what)))


@router.post("/api/experts")
def api_experts(body: schemas.TextRequest, served: ServedDep) -> Any:
    return served.run_locked(expert_choices, body.ids(lambda value, what: served.encode(value, what=what)))


def one_token(served: Any, value: int | str, field: str) -> int:
    """A request's token: an id in the vocabulary, or a text that encodes to exactly one token."""
    if isinstance(value, int):
        return served.encode([value], what=field)[0]
    if value == "":
        raise schemas.BadRequest(f"{field}: the text is empty; give one token's text or its id", field)
    ids = served.encode(value, what=field)
    if len(ids) != 1:
        pieces = ", ".join(repr(t) for t in token_texts(served.tokenizer, ids[:8]))
        raise schemas.BadRequest(f"{field}: {value!r} is {len(ids)} tokens ({pieces}); give one token's text or its id",
                                 field)
    return ids[0]


@router.post("/api/logit-attribution")
def api_logit_attribution(body: schemas.AttributionRequest, served: ServedDep) -> Any:
    ids = body.ids(lambda value, what: served.encode(value, what=what))
    token = None if body.token is None else one_token(served, body.token, "token")
    return served.run_locked(logit_attribution, ids, token, body.k)


@router.post("/api/head-scores")
def api_head_scores(body: schemas.HeadScoresRequest, served: ServedDep) -> Any:
    return served.run_locked(head_scores, body.ids(lambda value, what: served.encode(value, what=what)), body.seed)


@router.post("/api/patching")
def api_patching(body: schemas.PatchingRequest, served: ServedDep) -> Any:
    clean = body.ids(lambda value, what: served.encode(value, what=what))
    corrupted = body.corrupted_ids(lambda value, what: served.encode(value, what=what))
    field = "corrupted_text" if body.corrupted_text is not None else "corrupted_tokens"
    if len(corrupted) != len(clean):
        raise schemas.BadRequest(f"{field}: the corrupted prompt is {len(corrupted)} tokens and the clean one "
                                 f"{len(clean)}; patching pairs positions, so give one of {len(clean)} tokens", field)
    if corrupted == clean:
        raise schemas.BadRequest(f"{field}: the corrupted prompt is the clean one; change at least one token", field)
    answer, wrong = one_token(served, body.answer, "answer"), one_token(served, body.wrong_answer, "wrong_answer")
    if answer == wrong:
        raise schemas.BadRequest("wrong_answer: it is the answer's token; the metric is the logit difference "
                                 "answer - wrong_answer, so give another", "wrong_answer")
    if body.hook == "mlp_out" and any(block.mlp is None for block in served.model.blocks):
        raise schemas.BadRequest("hook: this model is attention-only (no MLPs); patch resid_pre or attn_out", "hook")
    return served.run_locked(activation_patching, clean, corrupted, answer, wrong, body.hook)
