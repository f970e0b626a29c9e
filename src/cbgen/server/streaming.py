"""Plumbing between engine streams and HTTP: merging streams, disconnect watching, the SSE response."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from cbgen.async_engine import RequestStream
from cbgen.outputs import RequestOutput


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's position."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as exc:
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def wait_disconnect(receive: Receive) -> None:
    """Returns once the client has disconnected."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse(StreamingResponse):
    """A streaming response that always releases its engine requests, however the stream ends.

    Starlette cancels the sending task when the client disconnects; the body generator may then be
    left suspended at a ``yield`` and only closed by the garbage collector.  Cancelling the streams
    here frees their KV blocks immediately instead.
    """

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self._streams:
                s.cancel()
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
