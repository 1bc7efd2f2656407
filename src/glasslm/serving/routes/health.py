"""GET /health: whether the server takes work, how busy it is, and the engine's counters.

Example:
    >>> from fastapi import FastAPI
    >>> app = FastAPI()
    >>> app.include_router(router)
    >>> list(app.openapi()["paths"])
    ['/health']
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from glasslm.serving.context import ServedDep

COUNTERS = ("submitted", "completed", "cancelled", "rejected", "aborted", "largest_batch", "steps", "rows")

router = APIRouter()


@router.get("/health")
async def health(served: ServedDep) -> JSONResponse:
    engine = served.engine
    body = {"status": "draining" if engine.draining else "ok", "model": served.name, "active": len(engine.active),
            "queued": engine.queued(), **{k: engine.stats[k] for k in COUNTERS}}
    return JSONResponse(body, status_code=503 if engine.draining else 200)
