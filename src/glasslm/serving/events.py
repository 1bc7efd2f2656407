"""From a request's jobs to what the client receives: all their events at once, or a server-sent stream.

Both completion routes use these. A request's jobs share one event queue (`Job.events`); each
event carries its job's `index`, and a job's last event has `finish_reason` (or `error`).

Example:
    >>> import asyncio
    >>> async def payloads():
    ...     yield {"text": "a"}
    ...     raise RuntimeError("the tokenizer failed")
    >>> async def lines():
    ...     return [line async for line in server_sent(payloads())]
    >>> for line in asyncio.run(lines()):
    ...     print(line.strip())
    data: {"text": "a"}
    data: {"error": {"message": "generating the stream failed: RuntimeError: the tokenizer failed", "type": "server_error", "param": null, "code": 500}}
    data: [DONE]
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from glasslm.generation.engine import Job
from glasslm.serving.schemas import error_event

log = logging.getLogger("glasslm.serving")

DISCONNECTED = "client disconnected"


async def gather(jobs: list[Job], request: Any) -> list[dict[str, Any]] | str:
    """Every event of `jobs` until each has finished, in arrival order; or why not (a job's error
    message, or `DISCONNECTED` if the client left first: looked at every quarter second)."""
    events, received, unfinished = jobs[0].events, [], len(jobs)
    checked = time.monotonic()
    while unfinished:
        try:
            event = await asyncio.wait_for(events.get(), timeout=0.25)
        except asyncio.TimeoutError:
            event = None
        if time.monotonic() - checked > 0.25:  # tokens may flow without pause: look by the clock
            checked = time.monotonic()
            if await request.is_disconnected():
                return DISCONNECTED
        if event is None:
            continue
        if "error" in event:
            return event["error"]
        received.append(event)
        unfinished -= "finish_reason" in event
    return received


async def server_sent(payloads: AsyncIterator[dict[str, Any]],
                      on_close: Callable[[], None] | None = None) -> AsyncIterator[str]:
    """`data: {json}` lines of the payloads, then `data: [DONE]`, whatever happens on the way.

    If making a payload fails, the stream ends with an error event and `[DONE]` rather than a cut
    connection. `on_close` runs at the end, also when the client leaves mid-stream.
    """
    try:
        try:
            async for payload in payloads:
                yield f"data: {json.dumps(payload)}\n\n"
        except Exception as err:  # noqa: BLE001 - the client gets an error event, the log the traceback
            log.exception("a streamed response failed")
            yield f"data: {json.dumps(error_event(f'generating the stream failed: {type(err).__name__}: {err}'))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if on_close is not None:
            on_close()
