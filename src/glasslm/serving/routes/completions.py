"""OpenAI's completions API: POST /v1/completions (whole or streamed as server-sent events) and GET /v1/models.

A request becomes a `Job` for the app's `Engine`; its events become OpenAI's response shapes
(`glasslm.serving.schemas`). A full queue answers 429 at once, a draining server 503.

Example:
    >>> from fastapi import FastAPI
    >>> app = FastAPI()
    >>> app.include_router(router)
    >>> sorted(app.openapi()["paths"])
    ['/v1/completions', '/v1/models']
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from glasslm.generation.engine import Job, Overloaded, ShuttingDown
from glasslm.serving import schemas
from glasslm.serving.context import Served, ServedDep
from glasslm.serving.errors import error_response

log = logging.getLogger("glasslm.serving")

router = APIRouter()


@router.get("/v1/models")
async def models(served: ServedDep, request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": served.name, "object": "model", "created": int(request.app.state.started),
                                        "owned_by": "glasslm", "max_model_len": served.context_length}]}


@router.post("/v1/completions")
async def completions(body: schemas.CompletionRequest, request: Request, served: ServedDep) -> Any:
    if body.model is not None and body.model != served.name:
        return error_response(404, f"model {body.model!r} not found; this server serves {served.name!r}",
                              "not_found", "model")
    limit = served.config.max_tokens_limit
    if body.max_tokens > limit:
        raise schemas.BadRequest(f"max_tokens: {body.max_tokens} is more than this server's limit {limit}",
                                 "max_tokens")
    completion = _jobs(body, served)
    started = time.perf_counter()
    try:
        _submit(completion.jobs, served)
    except Overloaded as err:
        return error_response(429, str(err), "overloaded")
    except ShuttingDown as err:
        return error_response(503, str(err), "unavailable")
    if body.stream:
        return StreamingResponse(_events(completion, started), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        result = await schemas.collect(completion, request)
    finally:
        _done(completion, started)
    if "error" in result:
        return error_response(500, result["error"]["message"], "server_error")
    return result


def _jobs(body: schemas.CompletionRequest, served: Served) -> schemas.Completion:
    """`n` jobs per prompt, sharing one event queue; choice index = prompt number * n + choice."""
    prompts = body.prompts()
    many, room = len(prompts) > 1, served.config.max_batch + served.config.max_queue
    if len(prompts) * body.n > room:  # would never fit, however idle the server: not a 429
        raise schemas.BadRequest(f"n: {len(prompts)} prompts x n={body.n} is {len(prompts) * body.n} completions; "
                                 f"this server takes at most {room} at once (--max-batch + --max-queue)", "n")
    encoded = [served.encode(p, what=f"prompt[{k}]" if many else "prompt") for k, p in enumerate(prompts)]
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    jobs, echoes = [], []
    for prompt, ids in zip(prompts, encoded):
        echo = (prompt if isinstance(prompt, str) else served.tokenizer.decode(ids)) if body.echo else ""
        for choice in range(body.n):
            jobs.append(Job(ids, body.sampling(choice), served.tokenizer, loop, stop_tokens=served.eos,
                            events=events, index=len(jobs)))
            echoes.append(echo)
    return schemas.Completion(jobs, echoes, body, served.name, served.tokenizer)


def _submit(jobs: list[Job], served: Served) -> None:
    """Queue the jobs that need the model, all at once (or none: 429); the others finish at once."""
    needs_model = [job for job in jobs if job.sampling.max_tokens > 0 or job.sampling.prompt_logprobs is not None]
    if needs_model:
        served.engine.submit_all(needs_model)
    for job in jobs:
        if job.sampling.max_tokens <= 0 and job.sampling.prompt_logprobs is None:
            job.finish("length")


async def _events(completion: schemas.Completion, started: float) -> AsyncIterator[str]:
    """The server-sent event stream of one request, ending with `data: [DONE]`."""
    try:
        async for chunk in schemas.stream_chunks(completion):
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        _done(completion, started)


def _done(completion: schemas.Completion, started: float) -> None:
    for job in completion.jobs:
        job.cancelled.set()  # a no-op once finished; otherwise the client went away
        _log_done(job, started)


def _log_done(job: Job, started: float) -> None:
    elapsed = time.perf_counter() - started
    first = (job.first_token_time - job.created) if job.first_token_time else float("nan")
    log.info("%s prompt=%d completion=%d finish=%s first_token=%.3fs total=%.3fs", job.id,
             len(job.prompt), len(job.generated), job.finish_reason, first, elapsed)
