"""`--api-key`: every route answers 401 unless the request carries `Authorization: Bearer KEY`.

As vLLM's and litgpt's servers take it (and the `openai` client sends its `api_key` so). Only
`/health` stays open, so a load balancer or orchestrator can probe liveness without the key. The
explorer page and its /api endpoints are closed too: behind a key, use them through something that
adds the header (a reverse proxy, or an SSH tunnel to a server without a key on 127.0.0.1).
The comparison takes the same time whatever the key sent, so timing tells nothing about the key.

Example:
    >>> import asyncio
    >>> async def app(scope, receive, send):
    ...     await send({"type": "http.response.start", "status": 200, "headers": []})
    ...     await send({"type": "http.response.body", "body": b"ok"})
    >>> sent = []
    >>> async def send(message):
    ...     sent.append(message)
    >>> guarded = BearerKey(app, "s3cret")
    >>> scope = {"type": "http", "path": "/v1/models", "headers": [(b"authorization", b"Bearer wrong")]}
    >>> asyncio.run(guarded(scope, None, send))
    >>> sent[0]["status"], dict(sent[0]["headers"])[b"www-authenticate"]
    (401, b'Bearer')
"""

from __future__ import annotations

import hmac
import json
from typing import Any

OPEN_PATHS = frozenset({"/health"})  # answered without the key: liveness probes


class BearerKey:
    """ASGI middleware: HTTP requests need `Authorization: Bearer <key>`, except `OPEN_PATHS`."""

    def __init__(self, app: Any, key: str):
        if not key:
            raise ValueError("api_key: an empty key would let anyone in; leave it unset to serve without one")
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {"message": "this server needs an API key: send the header "
                                     "'Authorization: Bearer <key>' (the openai client's api_key)",
                                     "type": "authentication_error", "param": None, "code": 401}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope: dict[str, Any]) -> bool:
        sent = next((value for name, value in scope.get("headers", ()) if name == b"authorization"), b"")
        return hmac.compare_digest(sent, self.expected)
