"""GET /metrics: Prometheus' text format (`glasslm.serving.metrics.ServerMetrics`).

Example:
    >>> from fastapi import FastAPI
    >>> app = FastAPI()
    >>> app.include_router(router)
    >>> list(app.openapi()["paths"])
    ['/metrics']
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

router = APIRouter()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus' text exposition format


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> PlainTextResponse:
    """Requests, queue depth, running sequences, tokens/s, time-to-first-token and latency histograms,
    KV-cache use."""
    return PlainTextResponse(request.app.state.metrics.render(), media_type=CONTENT_TYPE)
