"""OpenAI's completions API: POST /v1/completions (whole or streamed as server-sent events), GET /v1/models
and GET /v1/models/{id}.

A request becomes a `Job` for the app's `Engine`; its events become OpenAI's response shapes
(`glasslm.serving.schemas`). A full queue answers 429 at once, a draining server 503.

Example:
    >>> from fastapi import FastAPI
    >>> app = FastAPI()
    >>> app.include_router(router)
    >>> sorted(app.openapi()["paths"])
    ['/v1/completions', '/v1/models', '/v1/models/{model_id}']
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from glasslm.generation.engine import Job, Overloaded, ShuttingDown
from glasslm.serving import schemas
from glasslm.serving.context import Served, ServedDep
from glasslm.serving.errors import error_response, refused
from glasslm.serving.events import gather, server_sent

log = logging.getLogger("glasslm.serving")

router = APIRouter()


def _model_card(served: Served, request: Request, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": int(request.app.state.started), "owned_by": "glasslm",
            "max_model_len": served.context_length}


@router.get("/v1/models")
async def models(served: ServedDep, request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(served, request, served.name)]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, served: ServedDep, request: Request) -> dict[str, Any]:
    """One model, as the openai client's `models.retrieve` reads it (404 for a name this server does not answer to)."""
    served.check_model(model_id)
    return _model_card(served, request, model_id)


@router.post("/v1/completions")
async def completions(body: schemas.CompletionRequest, request: Request, served: ServedDep) -> Any:
    served.check(body, len(body.prompts()))
    completion = _jobs(body, served)
    started = time.perf_counter()
    try:
        _submit(completion.jobs, served)
    except (Overloaded, ShuttingDown) as err:
        return refused(err, served.engine)
    if body.stream:
        return StreamingResponse(server_sent(schemas.stream_chunks(completion), lambda: _done(completion, started)),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        events = await gather(completion.jobs, request)
    finally:
        _done(completion, started)
    if isinstance(events, str):
        return error_response(500, events, "server_error")
    return completion.result(events)


def _jobs(body: schemas.CompletionRequest, served: Served) -> schemas.Completion:
    """`n` jobs per prompt, sharing one event queue; choice index = prompt number * n + choice."""
    prompts = body.prompts()
    many = len(prompts) > 1
    encoded = [served.encode(p, what=f"prompt[{k}]" if many else "prompt") for k, p in enumerate(prompts)]
    shown = served.shown_for(body.skip_special_tokens)
    loop, events, stops = asyncio.get_running_loop(), asyncio.Queue(), body.stop_tokens(served.eos)
    jobs, echoes = [], []
    for prompt, ids in zip(prompts, encoded):
        echo = (prompt if isinstance(prompt, str) else shown.decode(ids)) if body.echo else ""
        for choice in range(body.n):
            jobs.append(Job(ids, body.choice_sampling(choice), shown, loop, stop_tokens=stops, events=events,
                            index=len(jobs)))
            echoes.append(echo)
    return schemas.Completion(jobs, echoes, body, served.name, shown)


def _submit(jobs: list[Job], served: Served) -> None:
    """Queue the jobs that need the model, all at once (or none: 429); the others finish at once."""
    needs_model = [job for job in jobs if job.sampling.max_tokens > 0 or job.sampling.prompt_logprobs is not None]
    if needs_model:
        served.engine.submit_all(needs_model)
    for job in jobs:
        if job.sampling.max_tokens <= 0 and job.sampling.prompt_logprobs is None:
            job.finish("length")


def _done(completion: schemas.Completion, started: float) -> None:
    for job in completion.jobs:
        job.cancelled.set()  # a no-op once finished; otherwise the client went away
        _log_done(job, started)


def _log_done(job: Job, started: float) -> None:
    elapsed = time.perf_counter() - started
    first = (job.first_token_time - job.created) if job.first_token_time else float("nan")
    log.info("%s prompt=%d completion=%d finish=%s first_token=%.3fs total=%.3fs", job.id,
             len(job.prompt), len(job.generated), job.finish_reason, first, elapsed)
