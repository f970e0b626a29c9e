"""Connection hygiene for ``cbgen serve``: a cap on open connections, deadlines for request heads and
for clients that stop reading, and refusals that cost one log line per interval, not one per socket.

uvicorn (with h11, the HTTP implementation it picks without httptools) closes an idle keep-alive
connection after ``timeout_keep_alive``, but nothing closes a connection that never completes its
request head, ``limit_concurrency`` only answers 503 once a whole request has arrived, and closing a
connection whose client stopped reading waits for a flush that never comes.  A few thousand
half-open sockets then hold the process at its file-descriptor limit.  The protocol subclass below
adds what is missing, on uvicorn's own machinery:

* at most ``max_connections`` open: a new one past the cap evicts the connection that has been idle
  longest (no request in progress: an idle keep-alive or an incomplete head), else it is answered
  ``503`` and closed at once.  A connection is not evicted in its first ``EVICT_GRACE`` seconds, nor
  while bytes wait unread in its socket: during a burst the event loop may not have read yet a
  request head that arrived in time;
* a request head must be complete within ``header_timeout`` of the connection becoming idle;
* output waiting for a client that does not read is dropped, and the connection aborted, after
  ``write_timeout`` without progress (streams enforce the same deadline on each write, see
  :mod:`cbgen.server.streaming`);
* each connection's send buffer is ``write_buffer`` bytes in the kernel, at most 64 KiB in the process,
  so a client that stops reading is noticed after that much output, not after megabytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import resource
import socket
import struct
import termios
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from cbgen.utils import get_logger

logger = get_logger("cbgen.server")

CONNECTION_KEY = "cbgen.connection"  # key of a connection's handle in each request's scope["state"]
_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b'content-length: 104\r\n\r\n{"error":{"message":"too many open connections; retry later",'
    b'"type":"server_error","param":null,"code":null}}'
)
_FD_RESERVE = 256  # descriptors kept for the model, logs and the engine when capping connections
EVICT_GRACE = 0.25  # seconds
_EVICT_SCAN = 32  # idle connections looked at, oldest first, for one that may be evicted


@dataclass
class ConnectionLimits:
    """Per-server connection limits (see the module docstring); seconds and bytes."""

    max_connections: int = 4096
    header_timeout: float = 10.0
    write_timeout: float = 30.0
    write_buffer: int = 256 * 1024

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.write_buffer < 4096:
            raise ValueError("max_connections must be >= 1 and write_buffer >= 4096")
        if not (self.header_timeout > 0 and self.write_timeout > 0):
            raise ValueError("header_timeout and write_timeout must be > 0")


class ConnectionGuard:
    """The state every connection of one server shares: which are open and idle, and what was refused."""

    def __init__(self, limits: ConnectionLimits, log_interval: float = 10.0) -> None:
        self.limits = limits
        self.open = 0
        self.counts = {"refused": 0, "evicted": 0, "header_timeout": 0, "write_timeout": 0}
        self._idle: OrderedDict[GuardedH11Protocol, None] = OrderedDict()  # oldest first
        self._log_interval = log_interval
        self._last_log = 0.0
        self._unlogged: dict[str, int] = {}

    def note(self, event: str, n: int = 1) -> None:
        """Counts an event; logs a summary at most once per interval (a flood stays one line)."""
        self.counts[event] = self.counts.get(event, 0) + n
        self._unlogged[event] = self._unlogged.get(event, 0) + n
        now = time.monotonic()
        if now - self._last_log >= self._log_interval:
            summary = ", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in sorted(self._unlogged.items()))
            logger.warning(
                "connections (%d open, cap %d) since the last report: %s",
                self.open,
                self.limits.max_connections,
                summary,
            )
            self._last_log, self._unlogged = now, {}

    def opened(self, conn: GuardedH11Protocol) -> bool:
        """Registers a new connection; False if it must be refused (the cap is reached by busy ones)."""
        if self.open >= self.limits.max_connections:
            victim = self._victim(conn.loop.time())
            if victim is None:
                self.note("refused")
                return False
            del self._idle[victim]
            self.note("evicted")
            victim.drop()
        self.open += 1
        self._idle[conn] = None
        return True

    def _victim(self, now: float) -> GuardedH11Protocol | None:
        for i, conn in enumerate(self._idle):
            if i == _EVICT_SCAN or now - conn.idle_since < EVICT_GRACE:
                return None  # the rest are younger
            if not conn.unread_bytes():
                return conn
        return None

    def busy(self, conn: GuardedH11Protocol) -> None:
        """A request started on ``conn``: it cannot be evicted until its response is complete."""
        self._idle.pop(conn, None)

    def idle(self, conn: GuardedH11Protocol) -> None:
        """``conn`` has no request in progress (again): evictable, newest last."""
        self._idle.pop(conn, None)
        self._idle[conn] = None

    def closed(self, conn: GuardedH11Protocol, counted: bool) -> None:
        """Forgets a connection that is gone."""
        self._idle.pop(conn, None)
        if counted:
            self.open -= 1


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under a :class:`ConnectionGuard` (made per server by
    :func:`guarded_protocol`)."""

    guard: ClassVar[ConnectionGuard]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Each request's scope["state"] is a copy of this: the app finds its connection there.
        self.app_state = {**self.app_state, CONNECTION_KEY: self}
        self._counted = False
        self._refused = False
        self._timer: asyncio.TimerHandle | None = None
        self.idle_since = 0.0
        self._drain_mark = (0.0, 0)  # (when, bytes buffered) at the last sign of progress

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Sizes the send buffers, then admits the connection under the cap (or answers 503)."""
        super().connection_made(transport)
        limits = self.guard.limits
        transport.set_write_buffer_limits(high=min(limits.write_buffer, 64 * 1024))
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, limits.write_buffer)
        if not self.guard.opened(self):
            self._refused = True
            transport.write(_REFUSAL)
            transport.close()
            return
        self._counted = True
        self._became_idle()

    def data_received(self, data: bytes) -> None:
        """Ignores what a refused connection sends while its close completes."""
        if not self._refused:
            super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        """Releases the connection's place under the cap."""
        self._cancel_timer()
        self.guard.closed(self, self._counted)
        self._counted = False
        super().connection_lost(exc)

    # ------------------------------------------------------------------ uvicorn hooks
    def handle_events(self) -> None:
        """Marks the connection busy (not evictable, no head deadline) once a request head arrived."""
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle and not self.cycle.response_complete:
            self._cancel_timer()  # a head arrived: the request's own deadlines apply now
            self.guard.busy(self)

    def on_response_complete(self) -> None:
        """Makes the connection evictable again and starts the deadline for the next head."""
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self.guard.idle(self)
            self._became_idle()

    def timeout_keep_alive_handler(self) -> None:
        """uvicorn's keep-alive expiry, which must not wait forever for a client that does not read."""
        self._close_idle()

    # ------------------------------------------------------------------ deadlines
    def _became_idle(self) -> None:
        self.idle_since = self.loop.time()
        self._drain_mark = (self.idle_since, self.transport.get_write_buffer_size())
        self._set_timer(self.guard.limits.header_timeout, self._head_deadline)

    def _set_timer(self, delay: float, callback: Callable[[], None]) -> None:
        self._cancel_timer()
        self._timer = self.loop.call_later(delay, callback)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _idle_now(self) -> bool:
        return not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete)

    def _head_deadline(self) -> None:
        self._timer = None
        if self._idle_now():
            if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
                self.guard.note("header_timeout")  # some bytes of a head, never all of them
            self._close_idle()

    def _close_idle(self) -> None:
        """Closes an idle connection, once what it still has to send is sent or hopeless."""
        if not self._idle_now():
            return
        buffered = self.transport.get_write_buffer_size()
        if buffered:
            now = self.loop.time()
            since, before = self._drain_mark
            if buffered < before:
                self._drain_mark = (now, buffered)
            elif now - since >= self.guard.limits.write_timeout:
                self.guard.note("write_timeout")
                self.transport.abort()
                return
            self._set_timer(1.0, self._close_idle)
            return
        with contextlib.suppress(h11.LocalProtocolError):
            self.conn.send(h11.ConnectionClosed())
        self.transport.close()

    def unread_bytes(self) -> int:
        """Bytes received by the kernel that the event loop has not read yet."""
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return 0
        try:
            return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
        except OSError:
            return 0

    def drop(self) -> None:
        """Closes the connection now (evicted), dropping anything it still had to send."""
        self._cancel_timer()
        self.transport.abort()

    def abort_stalled(self) -> None:
        """Aborts a connection whose client stopped reading mid-response (a stream's write timeout)."""
        self.guard.note("write_timeout")
        self.drop()


def guarded_protocol(guard: ConnectionGuard) -> type[GuardedH11Protocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` whose connections share ``guard``."""
    return type("CbgenH11Protocol", (GuardedH11Protocol,), {"guard": guard})


def raise_fd_limit(max_connections: int) -> int:
    """Raises the soft descriptor limit to the hard one and returns the connection cap it allows
    (``max_connections``, lowered if the limit leaves too few descriptors)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, max_connections + 4 * _FD_RESERVE)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    allowed = max(1, soft - _FD_RESERVE)
    if allowed < max_connections:
        logger.warning(
            "the descriptor limit (%d) allows %d connections, not --max-connections %d",
            soft,
            allowed,
            max_connections,
        )
    return min(max_connections, allowed)


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, guard: ConnectionGuard) -> None:
    """Counts the accept loop's resource errors (descriptor exhaustion) instead of logging a
    traceback for each: asyncio retries the accept after a second on its own."""
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if "accept" in str(context.get("message", "")) and isinstance(context.get("exception"), OSError):
            guard.note("accept_error")
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
