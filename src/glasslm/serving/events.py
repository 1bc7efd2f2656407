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
from collections.abc import AsyncIterator, Callable
from typing import Any

from glasslm.generation.engine import Job
from glasslm.serving.schemas import error_event

log = logging.getLogger("glasslm.serving")

DISCONNECTED = "client disconnected"


async def gather(jobs: list[Job], request: Any) -> list[dict[str, Any]] | str:
    """Every event of `jobs` until each has finished, in arrival order; or why not (a job's error
    message, or `DISCONNECTED` as soon as the client leaves: the server's disconnect message is awaited
    beside the events, so a waiting or running job is cancelled at once)."""
    events, received, unfinished = jobs[0].events, [], len(jobs)
    left = asyncio.ensure_future(_disconnected(request))
    try:
        while unfinished:
            if events.empty():  # wait for an event or the client's leaving, whichever comes first
                getter = asyncio.ensure_future(events.get())
                await asyncio.wait({getter, left}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    return DISCONNECTED
                event = getter.result()
            else:
                event = events.get_nowait()
            if "error" in event:
                return event["error"]
            received.append(event)
            unfinished -= "finish_reason" in event
        return received
    finally:
        left.cancel()


async def _disconnected(request: Any) -> None:
    """Returns once the client has gone (the ASGI server's `http.disconnect`; the body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
