"""Plumbing between engine streams and HTTP: merging streams, disconnect watching, the SSE response."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from cbgen.async_engine import RequestStream
from cbgen.outputs import RequestOutput
from cbgen.server.connections import CONNECTION_KEY


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's position.

    One read per stream is in flight, and a stream is read again only once its last output has been
    consumed: a consumer that falls behind leaves the outputs in the streams' bounded buffers, where
    they pause their requests, instead of in a queue here that would grow without bound.
    """
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    reads = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
    try:
        while reads:
            done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
            for read in sorted(done, key=reads.__getitem__):
                i = reads.pop(read)
                try:
                    out = read.result()
                except StopAsyncIteration:
                    continue
                yield i, out
                reads[asyncio.ensure_future(streams[i].__anext__())] = i
    finally:
        for read in reads:
            read.cancel()


async def wait_disconnect(receive: Receive) -> None:
    """Returns once the client has disconnected."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class WriteTimeout(Exception):
    """A write waited longer than the write timeout for a client that does not read."""


class SSEResponse(StreamingResponse):
    """A streaming response that always releases its engine requests, however the stream ends.

    Starlette cancels the sending task when the client disconnects; the body generator may then be
    left suspended at a ``yield`` and only closed by the garbage collector.  Cancelling the streams
    here frees their KV blocks immediately instead.

    A write that waits more than ``write_timeout`` seconds (the client stopped reading; by then its
    requests are paused, their buffers full) ends the response: the requests are aborted and the
    connection dropped with whatever it still had to send.
    """

    def __init__(
        self, content: AsyncIterator[str], streams: list[RequestStream], write_timeout: float | None = None
    ) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._streams = streams
        self._write_timeout = write_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        connection = (scope.get("state") or {}).get(CONNECTION_KEY)
        timeout = self._write_timeout

        async def timed_send(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), timeout)
            except asyncio.TimeoutError:
                self._cancel_streams()
                if connection is None:
                    raise WriteTimeout(f"no write progress in {timeout:g} s") from None
                # Once the connection is gone uvicorn ends the response as a disconnect, quietly.
                connection.abort_stalled()

        try:
            await super().__call__(scope, receive, send if timeout is None else timed_send)
        finally:
            self._cancel_streams()
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]

    def _cancel_streams(self) -> None:
        for s in self._streams:
            s.cancel()
