"""Server-sent events, and the watch on the client's connection that cancels work it left.

Starlette's streaming response notices a disconnect only through the ASGI spec version the
server reports; ``EventStream`` watches ``http.disconnect`` itself in every case, and when the
client goes it cancels the task reading the events, which closes the Triton stream under them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")
DONE = "data: [DONE]\n\n"


def event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ``ClientGone``."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone
    return task.result()


class EventStream(Response):
    """``text/event-stream`` of ``events``; a client disconnect cancels the reading of them."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str]) -> None:
        # No body and so no Content-Length, as in Starlette's StreamingResponse.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
        await send(start)
        try:
            await unless_disconnected(receive, self._send_events(send))
        except ClientGone:
            return
        finally:
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _send_events(self, send: Send) -> None:
        async for text in self.events:
            await send({"type": "http.response.body", "body": text.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
