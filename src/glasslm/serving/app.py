"""The FastAPI app of `glasslm serve`, assembled from the route modules of `glasslm.serving.routes`.

Requests never run the model themselves: completions queue jobs for the app's batching `Engine`
(`glasslm.generation.engine`), which starts and stops with the app. Every route receives the
shared `Served` (model, tokenizer, config, engine) as a dependency; adding an API route is one new
module in `routes/` exposing `router`, and one entry in `ROUTERS`.

Example (the app without a network socket; `uvicorn.run(app)` would serve it):
    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.tokenizers import CharTokenizer
    >>> tok = CharTokenizer.from_text("abc\\n")
    >>> app = create_app(TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=4, n_layers=1)).eval(), tok)
    >>> sorted(path for path in app.openapi()["paths"] if path.startswith("/v1"))
    ['/v1/chat/completions', '/v1/completions', '/v1/models', '/v1/models/{model_id}']
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from glasslm.core.model import TransformerLM
from glasslm.serving.auth import BearerKey
from glasslm.serving.config import ServeConfig
from glasslm.serving.context import Served
from glasslm.serving.errors import add_error_handlers, document_errors
from glasslm.serving.metrics import CountAnswers, ServerMetrics
from glasslm.serving.routes import chat, completions, explorer, health, metrics, ollama, tokenize, training_run

ROUTERS = (health.router, metrics.router, completions.router, chat.router, ollama.router, tokenize.router,
           explorer.router, training_run.router)
# The paths that answer 404 for a `model` other than the one served, and 429 when the queue is full.
NAMED_MODEL_PATHS = {"/v1/completions", "/v1/chat/completions", "/v1/models/{model_id}", "/tokenize", "/detokenize"}
QUEUED_PATHS = {"/v1/completions", "/v1/chat/completions"}


def create_app(model: TransformerLM, tokenizer: Any, config: ServeConfig | None = None,
               chat_template: str | None = None, metrics_file: str | os.PathLike | None = None) -> FastAPI:
    """The FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /tokenizer_info, /health,
    the explorer page and its /api endpoints.

    `config.max_batch` rows decode together; up to `config.max_queue` more wait; beyond that requests
    get 429. The host, port and grace of `config` are the server's (`serve`), not the app's.
    The engine is `app.state.served.engine` (also `app.state.engine`). With `config.api_key`, every
    route but /health needs `Authorization: Bearer KEY` (`glasslm.serving.auth`). `chat_template` (Jinja
    source) is what /v1/chat/completions renders conversations with; without one it answers 400.
    `metrics_file` (the run's metrics.jsonl, `run_metrics_file`) is what /api/run and the page's
    "Training run" panel read; without one they say the model comes from no training run.
    """
    metrics_file = None if metrics_file is None else Path(metrics_file)
    served = Served.build(model, tokenizer, config, chat_template, metrics_file)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        served.engine.start()
        yield
        served.engine.stop()

    app = FastAPI(title="glasslm", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.served, app.state.engine, app.state.started = served, served.engine, time.time()
    app.state.metrics = ServerMetrics(served.engine)
    app.add_middleware(ollama.JsonBodies)
    app.add_middleware(CountAnswers, metrics=app.state.metrics)
    add_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    if served.config.api_key:
        app.add_middleware(BearerKey, key=served.config.api_key)
    described = app.openapi  # FastAPI's own document, with the errors this app answers added once

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document_errors(described(), NAMED_MODEL_PATHS, QUEUED_PATHS)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
