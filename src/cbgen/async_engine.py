"""``AsyncEngine``: an asyncio front end over one :class:`~cbgen.engine.Engine` driven by a background thread.

The engine is not thread-safe, so exactly one thread (the *engine thread*) ever calls into it.  Callers
on any asyncio loop submit adds and aborts through a locked command queue; the engine thread drains that
queue between steps, runs ``step()`` while there is work and sleeps on a condition variable when there
is none.  Torch releases the GIL inside its kernels, so the event loop keeps serving sockets while a
step runs.  Outputs go back to each request's ``asyncio.Queue`` through ``loop.call_soon_threadsafe``,
batched per loop and per step so a busy engine costs one wake-up per step, not one per request.

Failure isolation:

* bad input raises ``ValueError`` in the caller before anything reaches the engine thread;
* an error inside one request (e.g. a failing logits processor) arrives as that request's final
  output with ``finish_reason == "error"`` and ``RequestOutput.error`` set; others are untouched;
* an exception escaping ``Engine.step()`` itself fails every request in flight with an error output
  (their blocks are released through ``Engine.abort``) and the loop keeps running for new requests.

Admission and backpressure:

* a request's *work* is ``n x (prompt + max_tokens)`` token slots.  Besides the count of requests
  in flight, the work in flight may be bounded (``max_inflight_work``), and one client (the
  ``client`` tag of ``add_request``) may hold at most ``client_share`` of either bound.  Past a
  bound a request raises :class:`QueueFullError`; a request that could never fit raises ValueError.
* each stream buffers at most ``stream_buffer`` undelivered outputs: past that its request is
  paused (the scheduler preempts it, keeping its tokens) until the consumer has read most of them.
* ``fairness`` turns on the scheduler's fair policy (:class:`~cbgen.core.fairness.Fairness`);
  ``add_request(job=...)`` puts several requests in one job, e.g. the prompts of one HTTP request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from cbgen.core.admission import Admission, QueueFullError
from cbgen.core.fairness import Fairness
from cbgen.core.stats import EngineStats
from cbgen.engine import Engine
from cbgen.inputs import as_token_ids
from cbgen.limits import RequestLimits
from cbgen.outputs import CompletionOutput, RequestOutput
from cbgen.sampling_params import SamplingParams

logger = logging.getLogger("cbgen")

__all__ = [
    "AsyncEngine",
    "AsyncEngineStats",
    "EngineShutdownError",
    "QueueFullError",
    "RequestStream",
]


class EngineShutdownError(RuntimeError):
    """Raised when a request is submitted to an engine that is shutting down or has stopped."""


@dataclass
class AsyncEngineStats(EngineStats):
    """A consistent snapshot of the engine's counters plus its gauges, taken on the engine thread
    after every loop iteration (a copy: later steps do not change it)."""

    running: int = 0  # sequences in the scheduler's running list
    waiting: int = 0  # sequences waiting for admission (or preempted)
    in_flight: int = 0  # requests submitted and not yet finished or cancelled
    kv_usage: float = 0.0  # fraction of KV blocks in use
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_used_blocks: int = 0
    step_errors: int = 0
    paused: bool = False
    alive: bool = True
    streams_paused: int = 0  # requests paused because their consumer fell behind
    inflight_work: int = 0  # token slots (n x (prompt + max_tokens)) of the requests in flight


class RequestStream:
    """The consumer side of one request: an async iterator of delta :class:`RequestOutput`.

    The last item has ``finished=True``.  Call :meth:`cancel` (or let :meth:`AsyncEngine.generate`
    do it) when giving up early, so the engine aborts the request and frees its blocks.
    """

    def __init__(self, request_id: str, owner: AsyncEngine, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.arrival_time = time.monotonic()
        self._owner = owner
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False  # the consumer has seen the final output (or an exception)
        self.cancelled = False
        self.n = 1  # samples per request, so a synthesised error output has one entry per sample
        self.work = 0  # token slots it holds in the owner's budget
        self.client: str | None = None
        self.held = False  # paused because the consumer fell behind

    @property
    def buffered(self) -> int:
        """Outputs delivered to this stream and not read yet."""
        return self._queue.qsize()

    def _put(self, item: RequestOutput | BaseException) -> None:
        if self.cancelled:
            return
        self._queue.put_nowait(item)
        limit = self._owner.stream_buffer
        if not self.held and limit is not None and self._queue.qsize() >= limit:
            self.held = True
            self._owner._hold(self, True)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self.cancelled:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        elif self.held and self._queue.qsize() <= (self._owner.stream_buffer or 0) // 4:
            # Hysteresis: a reader a little slower than generation is paused and resumed in long
            # periods, not every step (each pause costs a recompute of the sequence's last block).
            self.held = False
            self._owner._hold(self, False)
        return item

    def cancel(self) -> None:
        """Aborts the request unless it already finished; idempotent and safe from the stream's loop."""
        if self.finished or self.cancelled:
            return
        self.cancelled = True
        self._owner._cancel_stream(self)


class _Pause:
    """Context manager (sync and async) returned by :meth:`AsyncEngine.pause`."""

    def __init__(self, owner: AsyncEngine) -> None:
        self._owner = owner

    def __enter__(self) -> AsyncEngine:
        self._owner._pause_begin()
        try:
            self._owner._wait_parked()
        except BaseException:
            self._owner._pause_end()
            raise
        return self._owner

    def __exit__(self, *exc: object) -> None:
        self._owner._pause_end()

    async def __aenter__(self) -> AsyncEngine:
        self._owner._pause_begin()
        try:
            # Waiting on a threading.Condition would block the loop; a worker thread waits instead.
            await asyncio.to_thread(self._owner._wait_parked)
        except BaseException:
            self._owner._pause_end()
            raise
        return self._owner

    async def __aexit__(self, *exc: object) -> None:
        self._owner._pause_end()


class AsyncEngine:
    """Serves many concurrent asyncio consumers from one engine stepped by a background thread.

    ``llm_or_engine`` is an :class:`~cbgen.llm.LLM` (its engine and tokenizer are used) or an
    :class:`~cbgen.engine.Engine`.  ``max_concurrent_requests`` bounds the requests in flight and
    ``max_inflight_work`` their token slots (None: unbounded); ``client_share`` is the fraction of
    each bound one client may hold; past them, submissions raise :class:`QueueFullError`.
    ``stream_buffer`` outputs wait in a stream before its request is paused (None: never paused).
    ``fairness`` (None: first come, first served) is the scheduler's policy between requests.
    """

    # A tensor-parallel root with nothing to do steps this often (far below the group's timeout).
    HEARTBEAT_S = 2.0

    def __init__(
        self,
        llm_or_engine: Any,
        max_concurrent_requests: int | None = None,
        tokenizer: Any = None,
        *,
        max_inflight_work: int | None = None,
        client_share: float | None = None,
        stream_buffer: int | None = 64,
        fairness: Fairness | None = None,
    ) -> None:
        engine = (
            llm_or_engine if isinstance(llm_or_engine, Engine) else getattr(llm_or_engine, "engine", None)
        )
        if not isinstance(engine, Engine):
            raise TypeError(f"AsyncEngine needs an LLM or an Engine, got {type(llm_or_engine).__name__}")
        if stream_buffer is not None and stream_buffer < 1:
            raise ValueError(f"stream_buffer must be >= 1 or None, got {stream_buffer!r}")
        self.admission = Admission(max_concurrent_requests, max_inflight_work, client_share)  # under _cond
        self.engine = engine
        # Everything besides add, step and abort goes through the engine's facade.
        self.control = engine.control
        self.tokenizer = tokenizer or getattr(llm_or_engine, "tokenizer", None) or engine.tokenizer
        self.max_concurrent_requests = max_concurrent_requests
        self.stream_buffer = stream_buffer
        if fairness is not None:
            self.control.fairness = fairness

        self._cond = threading.Condition()
        self._commands: deque[tuple] = deque()
        self._active: dict[str, RequestStream] = {}  # admission and id uniqueness; guarded by _cond
        self._by_rid: dict[str, RequestStream] = {}  # engine-thread only: engine request -> its stream
        self._accepting = True
        self._stopping = False
        self._pause_depth = 0
        self._parked = False
        self._step_errors = 0
        self._stats = AsyncEngineStats()
        self._snapshot()
        self._thread = threading.Thread(target=self._run, name="cbgen-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_llm(cls, llm: Any, **kwargs: Any) -> AsyncEngine:
        """Builds an AsyncEngine over ``llm.engine`` (keyword arguments as in the constructor)."""
        return cls(llm, **kwargs)

    # ------------------------------------------------------------------ submitting
    def _encode(self, prompt: str | Sequence[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer; pass token ids instead")
            return list(self.tokenizer.encode(prompt, add_special_tokens=True)), prompt
        return as_token_ids(prompt), None

    @property
    def request_limits(self) -> RequestLimits:
        """The engine's limits on one request (context, KV cache); immutable, safe from any thread."""
        return self.engine.request_limits

    def work_of(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """Token slots a request holds while in flight: ``n x (prompt + max_tokens)``, with the
        ``max_tokens`` the engine will run it with (:meth:`RequestLimits.work`)."""
        return self.request_limits.work(params.n, num_prompt_tokens, params.max_tokens)

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        client: str | None = None,
        job: str | None = None,
    ) -> RequestStream:
        """Validates and queues one request; returns its :class:`RequestStream`.

        ``client`` names who sent it (for ``client_share``); ``job`` puts it in a fairness job
        (default: its own).  Must be called from a running asyncio loop (the stream delivers to it).
        Raises ``ValueError`` for bad input or work no bound could ever admit, :class:`QueueFullError`
        past a bound and :class:`EngineShutdownError` once shutdown started; nothing is queued then.
        """
        loop = asyncio.get_running_loop()
        ids, text = self._encode(prompt)
        # Validation reads only immutable engine facts (vocab, context, cache size), so it is safe
        # on the caller's thread and reports errors before the request exists anywhere.
        self.engine.validate(ids, params)
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        rid = request_id or f"areq-{uuid.uuid4().hex}"
        stream = RequestStream(rid, self, loop)
        stream.n = params.n
        stream.work = self.work_of(len(ids), params)
        stream.client = client
        with self._cond:
            if not self._accepting or not self._thread.is_alive():
                raise EngineShutdownError("the engine is shutting down and accepts no new requests")
            if rid in self._active:
                raise ValueError(f"request id {rid!r} is already in use")
            self.admission.check(stream.work, client)
            self._active[rid] = stream
            self.admission.add(stream.work, client)
            self._commands.append(("add", stream, ids, params, text, job or rid))
            self._cond.notify_all()
        return stream

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields delta outputs of one request; the last has ``finished=True``.

        Raises ``ValueError`` (bad input), :class:`QueueFullError` or :class:`EngineShutdownError`
        on the first iteration, before anything is queued.  Closing the generator or cancelling the
        consuming task aborts the request and frees its KV blocks.
        """
        stream = self.add_request(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.cancel()

    async def abort(self, request_id: str) -> None:
        """Aborts a request; its consumer receives a final output with ``finish_reason == "abort"``."""
        with self._cond:
            if request_id not in self._active:
                return
            self._commands.append(("abort", request_id))
            self._cond.notify_all()

    def _cancel_stream(self, stream: RequestStream) -> None:
        with self._cond:
            self._forget(stream)
            self._commands.append(("abort", stream.request_id))
            self._cond.notify_all()

    def _hold(self, stream: RequestStream, hold: bool) -> None:
        with self._cond:
            self._commands.append(("hold" if hold else "release", stream.request_id))
            self._cond.notify_all()

    def _forget(self, stream: RequestStream) -> None:
        """Releases the stream's slot and work if it still holds them (caller holds ``_cond``)."""
        if self._active.get(stream.request_id) is not stream:
            return
        del self._active[stream.request_id]
        self.admission.remove(stream.work, stream.client)

    # ------------------------------------------------------------------ control
    def pause(self) -> _Pause:
        """Context manager (``with`` or ``async with``) that parks the engine thread between steps.

        KV cache and in-flight requests are kept; while parked the engine thread makes no engine calls
        at all, so the holder may use the engine (e.g. update weights; the change is detected on the
        next step).  Submissions made meanwhile are queued and run after the pause ends.  Pauses nest.

        A streamed request in flight across a weight change keeps the tokens it already sent; only its
        K/V is recomputed under the new weights, and later outputs carry the new ``weight_version``.
        Its early tokens therefore came from the old weights: RL users who need one policy per sample
        should use the non-streamed APIs, which restart such requests from the prompt.
        """
        return _Pause(self)

    def _pause_begin(self) -> None:
        with self._cond:
            self._pause_depth += 1
            self._cond.notify_all()

    def _pause_end(self) -> None:
        with self._cond:
            self._pause_depth -= 1
            self._cond.notify_all()

    def _wait_parked(self) -> None:
        with self._cond:
            while not self._parked and self._thread.is_alive():
                self._cond.wait(0.05)

    def start_shutdown(self, abort_inflight: bool = True) -> None:
        """Stops accepting requests without waiting; with ``abort_inflight`` every request in flight is
        aborted (its consumer gets a final ``"abort"`` output), else they run to completion.
        Safe to call from any thread, any number of times."""
        with self._cond:
            self._accepting = False
            self._stopping = True
            if abort_inflight:
                for rid in self._active:
                    self._commands.append(("abort", rid))
            self._cond.notify_all()

    def shutdown(self, abort_inflight: bool = True, timeout: float | None = None) -> None:
        """:meth:`start_shutdown`, then waits (up to ``timeout`` seconds) for the engine thread to exit.

        With ``abort_inflight=False`` this waits for every request in flight to finish.
        """
        self.start_shutdown(abort_inflight)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        """True while the engine thread is alive and new requests are accepted."""
        return self._accepting and self._thread.is_alive()

    def stats(self) -> AsyncEngineStats:
        """The latest snapshot (refreshed by the engine thread after every iteration)."""
        with self._cond:
            stats = self._stats
            in_flight, work = len(self._active), self.admission.work
        alive = self._thread.is_alive()
        return dataclasses.replace(stats, in_flight=in_flight, inflight_work=work, alive=alive)

    # ------------------------------------------------------------------ engine thread
    def _next_commands(self) -> list[tuple] | None:
        """Blocks until there is something to do; returns the queued commands, or None to exit."""
        with self._cond:
            while True:
                if self._pause_depth > 0:
                    if not self._parked:
                        self._parked = True
                        self._stats = dataclasses.replace(self._stats, paused=True)
                        self._cond.notify_all()
                    self._cond.wait()
                    continue
                self._parked = False
                if self._commands:
                    commands = list(self._commands)
                    self._commands.clear()
                    return commands
                if self.engine.has_unfinished():
                    if self._stopping:
                        # Paused requests run to their end too, so a shutdown never waits forever.
                        self.control.resume_all()
                    if self.control.has_runnable_work():
                        return []  # else every request left is paused: wait for a command
                if self._stopping:
                    return None
                if self.control.lockstep:
                    # Tensor-parallel root: an idle group still steps now and then, or the other ranks,
                    # waiting in the root's next exchange, would time out.
                    if not self._cond.wait(self.HEARTBEAT_S):
                        return [("tick",)]
                    continue
                self._cond.wait()

    def _run(self) -> None:
        try:
            while True:
                commands = self._next_commands()
                if commands is None:
                    return
                deliveries: list[tuple[RequestStream, RequestOutput | BaseException]] = []
                for command in commands:
                    self._apply(command, deliveries)
                if self.engine.has_unfinished() or commands == [("tick",)]:
                    try:
                        outputs = self.engine.step()
                    except Exception as exc:
                        self._fail_in_flight(exc, deliveries)
                    else:
                        for out in outputs:
                            self._route(out, deliveries)
                # Snapshot first, so a consumer that just saw its final output also sees it in stats().
                self._snapshot()
                self._deliver(deliveries)
        except BaseException as exc:  # pragma: no cover - a bug here must fail consumers, not hang them
            logger.exception("cbgen engine thread crashed")
            self._crash(exc)
            raise
        finally:
            with self._cond:
                self._accepting = False
                self._cond.notify_all()
            if self.control.lockstep and self._stopping:
                with contextlib.suppress(Exception):  # the followers may be gone already
                    self.engine.stop_followers()

    def _apply(self, command: tuple, deliveries: list) -> None:
        kind = command[0]
        if kind == "tick":
            return
        if kind == "add":
            _, stream, ids, params, text, job = command
            if stream.cancelled:
                return  # given up before it started: never touch the engine
            try:
                self.engine.add_request(ids, params, request_id=stream.request_id, prompt=text, stream=True)
            except Exception as exc:
                with self._cond:
                    self._forget(stream)
                deliveries.append((stream, exc if isinstance(exc, ValueError) else RuntimeError(str(exc))))
                return
            self._by_rid[stream.request_id] = stream
            self.control.set_job(stream.request_id, job)
        elif kind in ("hold", "release"):
            rid = command[1]
            if rid in self._by_rid and not self._stopping:  # else it ended (and was released) already
                self.control.pause(rid) if kind == "hold" else self.control.resume(rid)
        else:
            rid = command[1]
            try:
                out = self.engine.abort(rid)
            except Exception as exc:
                logger.exception("aborting %s failed", rid)
                out = _error_output(rid, self._by_rid.get(rid), f"abort failed: {exc!r}")
            if out is not None:
                self._route(out, deliveries)

    def _route(self, out: RequestOutput, deliveries: list) -> None:
        stream = self._by_rid.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            del self._by_rid[out.request_id]
            self.control.release(out.request_id)
            with self._cond:
                self._forget(stream)
        if not stream.cancelled:
            deliveries.append((stream, out))

    def _fail_in_flight(self, exc: Exception, deliveries: list) -> None:
        """A step blew up: the engine's state for the batch is unknown, so every request in flight
        ends with an error rather than risk a hang or a silently wrong continuation."""
        self._step_errors += 1
        logger.exception("engine step failed; failing %d request(s) in flight", self.engine.num_unfinished)
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        try:
            outputs = self.engine.abort_all(message)
        except Exception:
            logger.exception("could not end the requests of a failed step cleanly")
            outputs = [_error_output(rid, stream, message) for rid, stream in self._by_rid.items()]
        for out in outputs:
            out.error = message
            self._route(out, deliveries)

    @staticmethod
    def _deliver(deliveries: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for stream, item in deliveries:
            by_loop[stream.loop].append((stream, item))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the consumer's loop is closed: nobody is listening
                loop.call_soon_threadsafe(_dispatch, items)

    def _snapshot(self) -> None:
        counters = {f.name: getattr(self.engine.stats, f.name) for f in dataclasses.fields(EngineStats)}
        counters["times"] = dict(counters["times"])
        gauges = self.control.snapshot()
        stats = AsyncEngineStats(
            **counters,
            running=gauges.running,
            waiting=gauges.waiting,
            kv_usage=gauges.kv_usage,
            num_blocks=gauges.num_blocks,
            num_free_blocks=gauges.num_free_blocks,
            num_used_blocks=gauges.num_used_blocks,
            step_errors=self._step_errors,
            streams_paused=gauges.paused,
        )
        with self._cond:
            self._stats = stats

    def _crash(self, exc: BaseException) -> None:
        with self._cond:
            self._accepting = False
            streams = list(self._active.values())
            for stream in streams:
                self._forget(stream)
        error = EngineShutdownError(f"the engine thread crashed: {exc!r}")
        self._deliver([(s, error) for s in streams])


def _dispatch(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream._put(item)


def _error_output(request_id: str, stream: RequestStream | None, message: str) -> RequestOutput:
    n = stream.n if stream is not None else 1
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=[],
        outputs=[CompletionOutput(index=i, finish_reason="error") for i in range(n)],
        finished=True,
        error=message,
    )
