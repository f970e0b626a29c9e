"""What one app knows about the engine it serves, and the limits it enforces on requests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cbgen.async_engine import AsyncEngine, EngineShutdownError, QueueFullError, RequestStream
from cbgen.sampling_params import SamplingParams
from cbgen.server.errors import APIError, bad_request, sampling_param_of
from cbgen.server.json_child import JsonChild
from cbgen.server.metrics import ServerMetrics
from cbgen.server.template_child import TemplateChild

T = TypeVar("T")

# Bodies at least this large are parsed, tokenised and templated on a worker thread: a megabyte of
# chat takes about a second, which on the event loop would stall every other connection.
OFFLOAD_BYTES = 64 * 1024
# Bodies at least this large get a worker of their own: a normal 66 KB chat request must not queue
# behind megabyte bodies (each ~1 s of templating) that a client may send back to back.
LARGE_BYTES = 256 * 1024


@dataclass
class ServerLimits:
    """Per-request limits the server enforces before anything reaches the engine (400 past them).

    ``None`` for ``max_prompt_tokens`` / ``max_tokens_limit`` means "whatever the model's context
    allows", for ``max_request_work`` ``max_n`` x the context.  A request's work is the token slots
    of all its sequences: n x (prompt + max_tokens), summed over its prompts.  ``max_response_bytes``
    bounds the estimated size of a non-streamed response.  ``body_timeout`` and ``write_timeout``
    (seconds) bound how long a request body may take to arrive and a stream's write may wait for a
    client that does not read.  ``allow_special_tokens``: chat message text is tokenised with its
    special-token text parsed as control tokens (by default it is kept literal).  ``api_key`` set:
    every ``/v1`` path needs ``Authorization: Bearer <key>``.
    """

    max_prompt_tokens: int | None = None
    max_tokens_limit: int | None = None
    max_n: int = 16
    max_body_bytes: int = 1 << 20
    max_logprobs: int = 20
    max_prompts_per_request: int = 32
    max_stop_sequences: int = 16
    max_stop_length: int = 512
    max_logit_bias: int = 300
    max_request_work: int | None = None
    max_response_bytes: int = 64 << 20
    body_timeout: float = 30.0
    write_timeout: float = 30.0
    allow_special_tokens: bool = False
    api_key: str | None = field(default=None, repr=False)


class ServerState:
    """Request handling state shared by the routes of one app (``app.state.cbgen``)."""

    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer: Any,
        served_model_name: str,
        limits: ServerLimits,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = served_model_name
        self.limits = limits
        self.metrics = ServerMetrics(engine, served_model_name)
        self.created = int(time.time())
        core = engine.engine
        # The engine's own rules for one request (context, KV fit, default length, work).
        self.request_limits = engine.request_limits
        self.max_model_len = self.request_limits.max_model_len
        self.vocab_size = int(core.vocab_size)
        self.max_logprobs = min(limits.max_logprobs, int(core.config.max_logprobs))
        self.max_request_work = limits.max_request_work or self.request_limits.max_work(limits.max_n)
        self.special_tokens = _special_tokens(tokenizer)
        self.max_token_chars = _max_token_chars(tokenizer)
        self._token_text: dict[int, str] = {}
        self._workers: dict[bool, ThreadPoolExecutor] = {}
        self.json_child = JsonChild()  # started by the first large body
        self.template_child = TemplateChild(self)  # started by the first large chat body

    async def off_loop(self, fn: Callable[[], T], large: bool = False) -> T:
        """Runs ``fn`` (heavy parsing, templating, rendering) on a worker thread: one of two for
        ordinary work, or, with ``large`` (bodies of ``LARGE_BYTES`` or more), the one thread that
        such bodies queue on, so they never delay the others' turn."""
        pool = self._workers.get(large)
        if pool is None:
            pool = self._workers[large] = ThreadPoolExecutor(
                1 if large else 2,
                thread_name_prefix="cbgen-server-large" if large else "cbgen-server",
                initializer=_lower_priority,
            )
        return await asyncio.get_running_loop().run_in_executor(pool, _short_gil_turns(fn) if large else fn)

    def close(self) -> None:
        """Stops the worker threads and the child processes."""
        for pool in self._workers.values():
            pool.shutdown(wait=False, cancel_futures=True)
        self.json_child.close()
        self.template_child.close()

    def submit(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        base_id: str,
        client: str | None = None,
    ) -> list[RequestStream]:
        """Queues every prompt of one HTTP request, or none of them; the prompts share one
        fairness job and count towards ``client``'s share."""
        streams: list[RequestStream] = []
        try:
            for i, (ids, p) in enumerate(zip(prompts, params)):
                stream = self.engine.add_request(
                    ids, p, request_id=f"{base_id}-{i}", client=client, job=base_id
                )
                streams.append(stream)
        except BaseException as exc:
            for s in streams:
                s.cancel()
            if isinstance(exc, QueueFullError):
                raise APIError(429, str(exc), "rate_limit_error", code="rate_limit_exceeded") from None
            if isinstance(exc, EngineShutdownError):
                raise APIError(503, str(exc), "server_error", code="service_unavailable") from None
            if isinstance(exc, ValueError):
                raise bad_request(str(exc), param=sampling_param_of(str(exc))) from None
            raise
        return streams

    def token_text(self, token_id: int) -> str:
        """The text of one token as logprobs show it (``<id>`` without a tokenizer), cached."""
        text = self._token_text.get(token_id)
        if text is None:
            if self.tokenizer is None:
                text = f"<{token_id}>"
            else:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text


def _max_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token can cover: the longest token string of the vocabulary
    (byte-level and SentencePiece tokens spell at least as many characters as they stand for).  A
    prompt longer than this many times the token limit cannot fit, and is refused untokenised.  At
    least 64: a margin for normalisers that shorten text."""
    vocab = getattr(tokenizer, "get_vocab", None)
    try:
        return max(64, *map(len, vocab())) if vocab is not None else 64
    except Exception:  # a tokenizer without a usable vocabulary: a generous bound
        return 256


def _special_tokens(tokenizer: Any) -> tuple[str, ...]:
    """The texts the tokenizer turns into special (control) tokens."""
    if tokenizer is None:
        return ()
    texts = set(getattr(tokenizer, "all_special_tokens", None) or ())
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(token, "special", False):
            texts.add(str(token.content))
    return tuple(sorted((t for t in texts if t), key=len, reverse=True))


# While a large body is templated (pure-Python Jinja holding the GIL for ~0.7 s a megabyte), other
# threads get the GIL back after this long instead of the default 5 ms: every small request needs it
# many times, and with 5 ms turns one took 13-23x its idle latency beside back-to-back 0.9 MB
# bodies (idle 2-core Zen 4).  Only one large job runs at a time (one worker), so setting and
# restoring the process-wide interval around it does not race.
_LARGE_JOB_SWITCH_INTERVAL = 0.0005


def _short_gil_turns(fn: Callable[[], T]) -> Callable[[], T]:
    def run() -> T:
        before = sys.getswitchinterval()
        sys.setswitchinterval(_LARGE_JOB_SWITCH_INTERVAL)
        try:
            return fn()
        finally:
            sys.setswitchinterval(before)

    return run


def _lower_priority() -> None:
    """Lowers the calling worker thread's CPU priority (Linux: per thread), so that the engine thread
    wins the cores when a client sends heavy bodies back to back."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
