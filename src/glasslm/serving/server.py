"""`glasslm serve`: the app (`glasslm.serving.app`) under uvicorn, with a graceful shutdown.

SIGTERM (or Ctrl-C) stops accepting requests, lets running ones finish for up to `grace` seconds,
then ends them with finish_reason "abort" (see `Engine.begin_shutdown`).

`serving_in_thread` runs an app from a background thread for the length of a `with` block: for
programs that embed the server (a notebook, a test, a benchmark) and want its URL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from glasslm.core.model import TransformerLM
from glasslm.generation.engine import Engine
from glasslm.serving.app import create_app
from glasslm.serving.config import ServeConfig


def serve(model: TransformerLM, tokenizer: Any, config: ServeConfig, chat_template: str | None = None,
          metrics_file: str | os.PathLike | None = None) -> None:
    """Run the server until SIGTERM or Ctrl-C; prints the URL once it is listening. `metrics_file`:
    the run's metrics.jsonl the explorer plots (see `create_app`)."""
    import uvicorn

    app = create_app(model, tokenizer, config, chat_template, metrics_file)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not config.api_key and config.host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("glasslm.serving").warning(
            "listening on %s without --api-key: anyone who can reach this address can use the model", config.host)
    server_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                   access_log=True, timeout_graceful_shutdown=config.grace + 5, log_config=None)
    Server(server_config, app.state.engine, config.grace).run()


@contextlib.contextmanager
def serving_in_thread(app: Any, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve `app` from a background thread for the length of a `with` block; yields its URL.

    For programs that embed the server (notebooks, tests, benchmarks): port 0 takes a free port,
    and leaving the block shuts the server down (running requests end; no grace period).

    Example:
        >>> import json, urllib.request
        >>> from glasslm.presets import get_preset
        >>> from glasslm.core.model import TransformerLM
        >>> from glasslm.tokenizers import CharTokenizer
        >>> tok = CharTokenizer.from_text("abc\\n")
        >>> app = create_app(TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=4, n_layers=1)).eval(), tok)
        >>> with serving_in_thread(app) as url:
        ...     with urllib.request.urlopen(f"{url}/health") as response:
        ...         json.loads(response.read())["status"]
        'ok'
    """
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", log_config=None))
    thread = threading.Thread(target=server.run, name="glasslm-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    try:
        yield server_url(server)
    finally:
        server.should_exit = True
        thread.join(30)


def server_url(server: Any) -> str:
    """http://host:port of a started uvicorn server (the real port when 0 was asked for)."""
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def _server_class() -> type:
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn's server, which also prints its URL once listening and drains the engine on SIGTERM."""

        def __init__(self, config: Any, engine: Engine, grace: float):
            super().__init__(config)
            self.engine, self.grace = engine, grace

        async def startup(self, sockets: Sequence[Any] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                print(f"glasslm serve: listening on {server_url(self)}  (explorer page at /, "
                      f"OpenAI API at /v1; Ctrl-C or SIGTERM to stop)", flush=True)

        def handle_exit(self, sig: int, frame: Any) -> None:
            self.engine.begin_shutdown(self.grace)
            super().handle_exit(sig, frame)

    return _Server


def Server(config: Any, engine: Engine, grace: float = 10.0) -> Any:
    """A uvicorn.Server that prints its URL when listening and drains `engine` on SIGTERM."""
    return _server_class()(config, engine, grace)
