"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over an :class:`~cbgen.async_engine.AsyncEngine`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream with SSE and end with
``data: [DONE]``), ``GET /v1/models``, ``GET /health`` and ``GET /metrics``.  See ``docs/server.md``.

Logprobs.  The engine records two log-probabilities per sampled token: ``raw_logprobs`` (log-softmax of
the model's logits at temperature 1, before any penalty or truncation) and ``token_logprobs`` (under
the processed distribution actually sampled from).  For greedy requests (``temperature == 0``) the
processed distribution is a point mass, so its logprob is always 0 and says nothing; the server then
reports the raw model logprob of the chosen token.  For ``temperature > 0`` it reports the processed
logprob, i.e. the probability with which the token was really drawn.  The top candidates
(``top_logprobs``) are the engine's per-position top-k (``CompletionOutput.top_logprobs``) as they
are, most likely first; should any value be non-finite it is sent as ``-9999.0``, because JSON has
no infinity.

Errors always use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for any
invalid request (bad JSON or UTF-8, schema violations, limits), 401 for a missing or wrong API key,
404 for an unknown model or path, 413 for a body over ``--max-body-bytes``, 429 when
``--max-concurrent-requests`` are in flight, 503 while shutting down.  Bad input never yields a 500.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import math
import os
import re
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from cbgen.async_engine import AsyncEngine, EngineShutdownError, QueueFullError, RequestStream
from cbgen.outputs import CompletionOutput, RequestOutput
from cbgen.sampling_params import SamplingParams
from cbgen.server.metrics import CONTENT_TYPE, ServerMetrics
from cbgen.server.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from cbgen.utils import get_logger

logger = get_logger("cbgen.server")

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
MISSING_LOGPROB = -9999.0  # stands in for -inf, which JSON cannot carry


# ---------------------------------------------------------------------------------------------- limits
@dataclass
class ServerLimits:
    """Per-request limits the server enforces before anything reaches the engine (400 past them).

    ``None`` for ``max_prompt_tokens`` / ``max_tokens_limit`` means "whatever the model's context
    allows".  ``api_key`` set: every ``/v1`` path needs ``Authorization: Bearer <key>``.
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
    api_key: str | None = field(default=None, repr=False)


class APIError(Exception):
    """An error answered with OpenAI's error body and ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The error as a response."""
        return JSONResponse(self.body(), status_code=self.status)


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


# ---------------------------------------------------------------------------------------------- auth
class _APIKeyMiddleware:
    """Rejects ``/v1`` requests without the right bearer token (``/health`` and ``/metrics`` stay open).

    A plain ASGI middleware rather than a route dependency, so unknown ``/v1`` paths are covered too
    and nothing about the API (not even which routes exist) is visible without the key.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode("utf-8")

    def _authorized(self, scope: Scope) -> bool:
        header = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value
                break
        scheme, _, token = header.strip().partition(b" ")
        # compare_digest even when the scheme is wrong, so timing says nothing about the key.
        ok = hmac.compare_digest(token.strip(), self._key)
        return ok and scheme.lower() == b"bearer"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and not self._authorized(scope):
            error = APIError(
                401, "missing or invalid API key", "authentication_error", code="invalid_api_key"
            )
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


# ---------------------------------------------------------------------------------------------- parsing
def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def _read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    """The request body as a JSON object, enforcing the size limit before parsing anything."""
    length = request.headers.get("content-length")
    if length is not None:
        try:
            declared = int(length)
        except ValueError:
            raise _bad("invalid Content-Length header") from None
        if declared > max_bytes:
            raise APIError(
                413,
                f"request body of {declared} bytes exceeds the limit of {max_bytes} bytes",
                code="request_too_large",
            )
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        # Checked while streaming: a chunked body has no Content-Length to check up front.
        if total > max_bytes:
            raise APIError(
                413, f"request body exceeds the limit of {max_bytes} bytes", code="request_too_large"
            )
        chunks.append(chunk)
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _bad(f"request body is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise _bad(f"request body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise _bad("request body must be a JSON object")
    return obj


def _validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": str(exc)}
    # Drop union-member tags (e.g. "str", "list[int]") that pydantic adds to locations.
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = (
        ".".join(p for p in loc if not re.fullmatch(r"[a-z]+\[.*\]|str|int|float|bool|function-.*", p))
        or None
    )
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    where = f"{param}: " if param else ""
    return _bad(f"{where}{first.get('msg', 'invalid value')}{more}", param=param)


def _parse(model: type[SamplingFields], obj: dict[str, Any]) -> Any:
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def _param_of(message: str) -> str | None:
    m = re.search(r"SamplingParams\.(\w+)", message)
    return m.group(1) if m else None


# ---------------------------------------------------------------------------------------------- per-choice state
@dataclass
class _Choice:
    """What one choice (prompt x sample) has produced so far."""

    index: int
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    done: bool = False
    text_offset: int = 0
    lp_tokens: list[str] = field(default_factory=list)
    lp_values: list[float] = field(default_factory=list)
    lp_top: list[list[tuple[str, float]]] = field(default_factory=list)


@dataclass
class _PromptTiming:
    arrival: float
    first: float | None = None
    last: float | None = None


def _finite(value: float) -> float:
    if math.isnan(value):
        return MISSING_LOGPROB
    return value if math.isfinite(value) else MISSING_LOGPROB


class _Server:
    """Request handling state shared by the routes of one app."""

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
        self.max_model_len = int(core.max_model_len)
        self.vocab_size = int(core.vocab_size)
        self.block_size = int(core.block_manager.block_size)
        self.num_blocks = int(core.block_manager.num_blocks)
        self.max_logprobs = min(limits.max_logprobs, int(core.config.max_logprobs))
        self._token_text: dict[int, str] = {}

    # ------------------------------------------------------------------ validation
    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def check_prompt(self, ids: list[int]) -> None:
        limit = self.limits.max_prompt_tokens
        if limit is None:
            limit = self.max_model_len - 1
        if len(ids) > limit:
            raise _bad(f"prompt has {len(ids)} tokens, over the limit of {limit} tokens", param="prompt")
        if not ids:
            raise _bad("prompt is empty", param="prompt")

    def resolve_max_tokens(
        self, requested: int | None, default: int | None, prompt_len: int, param: str
    ) -> int:
        """The ``max_tokens`` to run with; a requested value that cannot fit is a 400, never clamped."""
        room = self.max_model_len - prompt_len
        cap = self.limits.max_tokens_limit
        if requested is None:
            # An unspecified length must never turn into an error, so it also stays within the KV cache.
            kv_room = self.num_blocks * self.block_size - prompt_len
            value = min(room, kv_room) if default is None else min(default, room, kv_room)
            if cap is not None:
                value = min(value, cap)
            value = max(value, 1)
        else:
            if requested < 1:
                raise _bad(f"{param} must be at least 1, got {requested}", param=param)
            if cap is not None and requested > cap:
                raise _bad(f"{param}={requested} exceeds the server limit of {cap}", param=param)
            if requested > room:
                raise _bad(
                    f"this model's context is {self.max_model_len} tokens; the prompt has {prompt_len} and "
                    f"{param}={requested} would exceed it",
                    param=param,
                )
            value = requested
        need = -(-(prompt_len + value) // self.block_size)
        if need > self.num_blocks:
            raise _bad(
                f"prompt + {param} need {need} KV-cache blocks but the server has {self.num_blocks}; "
                f"lower {param} or shorten the prompt",
                param=param,
            )
        return value

    def sampling_params(self, req: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
        lim = self.limits
        if req.n < 1:
            raise _bad(f"n must be at least 1, got {req.n}", param="n")
        if req.n > lim.max_n:
            raise _bad(f"n={req.n} exceeds the server limit of {lim.max_n}", param="n")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > lim.max_stop_sequences:
            raise _bad(f"at most {lim.max_stop_sequences} stop sequences are allowed", param="stop")
        if any(len(s) > lim.max_stop_length for s in stop):
            raise _bad(f"stop sequences are limited to {lim.max_stop_length} characters", param="stop")
        if req.seed is not None and not -(2**63) <= req.seed < 2**63:
            raise _bad("seed must fit in a signed 64-bit integer", param="seed")
        logit_bias = None
        if req.logit_bias:
            if len(req.logit_bias) > lim.max_logit_bias:
                raise _bad(f"logit_bias may name at most {lim.max_logit_bias} tokens", param="logit_bias")
            logit_bias = {}
            for key, value in req.logit_bias.items():
                if not re.fullmatch(r"\d{1,9}", key):
                    raise _bad(f"logit_bias key {key!r} is not a token id", param="logit_bias")
                if not -100 <= value <= 100:
                    raise _bad(f"logit_bias value for token {key} must be in [-100, 100]", param="logit_bias")
                logit_bias[int(key)] = float(value)
        top_k = -1 if req.top_k is None else req.top_k
        if top_k >= self.vocab_size:
            top_k = -1  # keeping the whole vocabulary is the same as no top-k
        kwargs: dict[str, Any] = dict(
            n=req.n,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens or 0,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            logit_bias=logit_bias,
            stop=stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=bool(req.ignore_eos),
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            skip_special_tokens=True if req.skip_special_tokens is None else req.skip_special_tokens,
            seed=req.seed,
            logprobs=logprobs,
        )
        if kwargs["min_tokens"] > max_tokens:
            raise _bad(
                f"min_tokens={kwargs['min_tokens']} exceeds max_tokens={max_tokens}", param="min_tokens"
            )
        try:
            return SamplingParams(**kwargs)
        except ValueError as exc:
            raise _bad(str(exc), param=_param_of(str(exc))) from None

    def check_stream_options(self, req: SamplingFields) -> bool:
        if req.stream_options is not None and not req.stream:
            raise _bad("stream_options is only allowed together with stream=true", param="stream_options")
        return bool(req.stream and req.stream_options is not None and req.stream_options.include_usage)

    # ------------------------------------------------------------------ submission
    def submit(
        self, prompts: list[list[int]], params: list[SamplingParams], base_id: str
    ) -> list[RequestStream]:
        """Queues every prompt of one HTTP request, or none of them."""
        streams: list[RequestStream] = []
        try:
            for i, (ids, p) in enumerate(zip(prompts, params)):
                streams.append(self.engine.add_request(ids, p, request_id=f"{base_id}-{i}"))
        except BaseException as exc:
            for s in streams:
                s.cancel()
            if isinstance(exc, QueueFullError):
                raise APIError(429, str(exc), "rate_limit_error", code="rate_limit_exceeded") from None
            if isinstance(exc, EngineShutdownError):
                raise APIError(503, str(exc), "server_error", code="service_unavailable") from None
            if isinstance(exc, ValueError):
                raise _bad(str(exc), param=_param_of(str(exc))) from None
            raise
        return streams

    # ------------------------------------------------------------------ outputs
    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            if self.tokenizer is None:
                text = f"<{token_id}>"
            else:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    def logprob_entries(
        self, c: CompletionOutput, greedy: bool
    ) -> tuple[list[str], list[float], list[list[tuple[str, float]]]]:
        chosen = c.raw_logprobs if greedy else c.token_logprobs
        tokens = [self.token_text(t) for t in c.token_ids]
        values = [_finite(float(v)) for v in chosen[: len(tokens)]]
        values += [MISSING_LOGPROB] * (len(tokens) - len(values))
        tops: list[list[tuple[str, float]]] = []
        for pos in range(len(tokens)):
            top = c.top_logprobs[pos] if c.top_logprobs is not None and pos < len(c.top_logprobs) else {}
            ranked = sorted(
                ((tid, lp) for tid, lp in top.items() if tid >= 0 and not math.isnan(lp)),
                key=lambda kv: -kv[1],
            )
            tops.append([(self.token_text(tid), _finite(float(lp))) for tid, lp in ranked])
        return tokens, values, tops

    def observe(self, timing: _PromptTiming, out: RequestOutput, now: float) -> None:
        new_tokens = sum(len(c.token_ids) for c in out.outputs)
        if new_tokens:
            if timing.first is None:
                timing.first = now
                self.metrics.observe_ttft(now - timing.arrival)
            elif timing.last is not None:
                self.metrics.observe_itl(now - timing.last, new_tokens)
            timing.last = now
        if out.finished:
            self.metrics.observe_e2e(now - timing.arrival)


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class _SSEResponse(StreamingResponse):
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


# ---------------------------------------------------------------------------------------------- handlers
def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class _Job:
    """One HTTP generation request: its engine streams and how to render them."""

    def __init__(
        self,
        server: _Server,
        chat: bool,
        streams: list[RequestStream],
        prompt_lens: list[int],
        n: int,
        greedy: bool,
        logprobs: bool,
        include_usage: bool,
        arrival: float,
    ) -> None:
        self.server = server
        self.chat = chat
        self.streams = streams
        self.prompt_tokens = sum(prompt_lens)
        self.n = n
        self.greedy = greedy
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.choices = [_Choice(index=i) for i in range(len(streams) * n)]
        self.timings = [_PromptTiming(arrival) for _ in streams]
        self.completion_tokens = 0
        self.error: str | None = None

    def absorb(self, p: int, out: RequestOutput) -> list[tuple[_Choice, CompletionOutput]]:
        """Records one delta output; returns the choices it changed (each at most once finished)."""
        self.server.observe(self.timings[p], out, time.monotonic())
        changed = []
        for c in out.outputs:
            choice = self.choices[p * self.n + c.index]
            if choice.done:
                continue
            if not c.token_ids and not c.text and c.finish_reason is None:
                continue
            choice.num_tokens += len(c.token_ids)
            self.completion_tokens += len(c.token_ids)
            if c.finish_reason is not None:
                choice.done = True
                choice.finish_reason = c.finish_reason
                choice.stop_reason = c.stop_reason
                self.server.metrics.observe_finish(c.finish_reason)
            changed.append((choice, c))
        if out.finished and out.error and self.error is None:
            self.error = out.error
        return changed

    # ---------------------------------------------------------------- logprob rendering
    def completion_logprobs(self, choice: _Choice, c: CompletionOutput) -> dict[str, Any]:
        tokens, values, tops = self.server.logprob_entries(c, self.greedy)
        offsets = []
        for t in tokens:
            offsets.append(choice.text_offset)
            choice.text_offset += len(t)
        top_dicts = []
        for top in tops:
            d: dict[str, float] = {}
            for tok, lp in top:
                d.setdefault(tok, lp)  # ranked, so the first occurrence is the most likely
            top_dicts.append(d)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top_dicts, "text_offset": offsets}

    def chat_logprobs(self, c: CompletionOutput) -> dict[str, Any]:
        tokens, values, tops = self.server.logprob_entries(c, self.greedy)
        content = []
        for tok, lp, top in zip(tokens, values, tops):
            content.append(
                {
                    "token": tok,
                    "logprob": lp,
                    "bytes": list(tok.encode("utf-8")),
                    "top_logprobs": [
                        {"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))} for t, v in top
                    ],
                }
            )
        return {"content": content, "refusal": None}

    def merge_logprobs(self, choice: _Choice, c: CompletionOutput) -> None:
        tokens, values, tops = self.server.logprob_entries(c, self.greedy)
        choice.lp_tokens += tokens
        choice.lp_values += values
        choice.lp_top += tops

    # ---------------------------------------------------------------- streaming
    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.server.model_name,
            "choices": choices,
        }
        if self.include_usage:
            body["usage"] = usage
        return f"data: {_dumps(body)}\n\n"

    def stream_choice(self, choice: _Choice, c: CompletionOutput) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {}
            if not choice.text:
                delta["role"] = "assistant"
            if c.text or not choice.text:
                delta["content"] = c.text
            choice.text.append(c.text)
            return {
                "index": choice.index,
                "delta": delta,
                "logprobs": self.chat_logprobs(c) if self.logprobs else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
        choice.text.append(c.text)
        return {
            "index": choice.index,
            "text": c.text,
            "logprobs": self.completion_logprobs(choice, c) if self.logprobs else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }

    async def sse(self) -> AsyncIterator[str]:
        try:
            try:
                async for p, out in _merge(self.streams):
                    changed = self.absorb(p, out)
                    if changed:
                        yield self.chunk([self.stream_choice(ch, c) for ch, c in changed])
                    if out.finished and out.error:
                        yield f"data: {_dumps(APIError(500, out.error, 'server_error').body())}\n\n"
            except Exception as exc:  # the engine failed underneath: end the stream in-band
                logger.exception("stream %s failed", self.id)
                yield f"data: {_dumps(APIError(500, str(exc), 'server_error').body())}\n\n"
            if self.include_usage:
                yield self.chunk([], _usage(self.prompt_tokens, self.completion_tokens))
            yield "data: [DONE]\n\n"
        finally:
            for s in self.streams:
                s.cancel()

    # ---------------------------------------------------------------- non-streaming
    async def collect(self) -> None:
        async for p, out in _merge(self.streams):
            for choice, c in self.absorb(p, out):
                choice.text.append(c.text)
                if self.logprobs:
                    self.merge_logprobs(choice, c)

    def final_body(self) -> dict[str, Any]:
        choices = []
        for ch in self.choices:
            text = "".join(ch.text)
            if self.chat:
                lp = None
                if self.logprobs:
                    lp = {
                        "content": [
                            {
                                "token": t,
                                "logprob": v,
                                "bytes": list(t.encode("utf-8")),
                                "top_logprobs": [
                                    {"token": a, "logprob": b, "bytes": list(a.encode("utf-8"))}
                                    for a, b in top
                                ],
                            }
                            for t, v, top in zip(ch.lp_tokens, ch.lp_values, ch.lp_top)
                        ],
                        "refusal": None,
                    }
                choices.append(
                    {
                        "index": ch.index,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": lp,
                        "finish_reason": ch.finish_reason,
                        "stop_reason": ch.stop_reason,
                    }
                )
            else:
                lp = None
                if self.logprobs:
                    offsets, pos = [], 0
                    for t in ch.lp_tokens:
                        offsets.append(pos)
                        pos += len(t)
                    tops = []
                    for top in ch.lp_top:
                        d: dict[str, float] = {}
                        for tok, v in top:
                            d.setdefault(tok, v)
                        tops.append(d)
                    lp = {
                        "tokens": ch.lp_tokens,
                        "token_logprobs": ch.lp_values,
                        "top_logprobs": tops,
                        "text_offset": offsets,
                    }
                choices.append(
                    {
                        "index": ch.index,
                        "text": text,
                        "logprobs": lp,
                        "finish_reason": ch.finish_reason,
                        "stop_reason": ch.stop_reason,
                    }
                )
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.server.model_name,
            "choices": choices,
            "usage": _usage(self.prompt_tokens, self.completion_tokens),
        }


async def _respond(job: _Job, request: Request, stream: bool) -> Response:
    if stream:
        return _SSEResponse(job.sse(), job.streams)
    consume = asyncio.ensure_future(job.collect())
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({consume, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not consume.done():
            consume.cancel()
        for s in job.streams:
            s.cancel()
    if consume not in done:
        return Response(status_code=499)  # the client is gone; nobody reads this
    exc = consume.exception()
    if exc is not None:
        if isinstance(exc, ValueError):
            raise _bad(str(exc))
        raise APIError(500, f"generation failed: {exc}", "server_error")
    if job.error is not None:
        raise APIError(500, job.error, "server_error")
    return JSONResponse(job.final_body())


def _chat_prompt(server: _Server, req: ChatCompletionRequest) -> list[int]:
    if server.tokenizer is None or not getattr(server.tokenizer, "chat_template", None):
        raise _bad("this model has no chat template; use /v1/completions", param="messages")
    if req.tools:
        raise _bad("tool calling is not supported by this server", param="tools")
    if req.tool_choice not in (None, "none"):
        raise _bad("tool_choice is not supported by this server", param="tool_choice")
    if req.response_format is not None and req.response_format.get("type", "text") != "text":
        raise _bad("only response_format {'type': 'text'} is supported", param="response_format")
    conversation = []
    for i, m in enumerate(req.messages):
        if m.content is None:
            text = ""
        elif isinstance(m.content, str):
            text = m.content
        else:
            parts = []
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise _bad(
                        f"messages[{i}]: only text content parts are supported, got {part.type!r}",
                        param=f"messages.{i}.content",
                    )
                parts.append(part.text)
            text = "\n".join(parts)
        role = "system" if m.role == "developer" else m.role
        conversation.append({"role": role, "content": text})
    try:
        ids = server.tokenizer.apply_chat_template(
            conversation, tokenize=True, add_generation_prompt=req.add_generation_prompt, return_dict=False
        )
    except Exception as exc:  # template errors (e.g. a template's raise_exception) are the caller's input
        raise _bad(f"could not apply the chat template: {exc}", param="messages") from None
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(t) for t in ids]


def _completion_prompts(server: _Server, req: CompletionRequest) -> list[list[int]]:
    prompt = req.prompt
    if isinstance(prompt, str) or (isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int))):
        items: list[Any] = [prompt]
    else:
        items = list(prompt)
        if not items:
            raise _bad("prompt is empty", param="prompt")
    if len(items) > server.limits.max_prompts_per_request:
        raise _bad(f"at most {server.limits.max_prompts_per_request} prompts per request", param="prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            if server.tokenizer is None:
                raise _bad("text prompts need a tokenizer; send token ids", param="prompt")
            if len(item) > 64 * server.max_model_len:
                # Far longer than any context: reject before spending time tokenising it.
                raise _bad("prompt is far longer than the model's context", param="prompt")
            ids = list(server.tokenizer.encode(item, add_special_tokens=True))
        else:
            ids = list(item)
            bad = next((t for t in ids if not 0 <= t < server.vocab_size), None)
            if bad is not None:
                raise _bad(
                    f"prompt token id {bad} is outside the vocabulary [0, {server.vocab_size})",
                    param="prompt",
                )
        server.check_prompt(ids)
        out.append(ids)
    return out


def build_app(
    async_engine: AsyncEngine,
    tokenizer: Any,
    served_model_name: str,
    limits: ServerLimits | None = None,
    shutdown_engine_on_exit: bool = True,
) -> FastAPI:
    """The FastAPI app serving ``async_engine`` as ``served_model_name``.

    With ``shutdown_engine_on_exit`` the app's lifespan shutdown aborts in-flight requests and stops
    the engine thread.
    """
    limits = limits or ServerLimits()
    server = _Server(async_engine, tokenizer, served_model_name, limits)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if shutdown_engine_on_exit:
            await asyncio.to_thread(async_engine.shutdown, True, 30.0)

    app = FastAPI(title="cbgen", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.cbgen = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), param=None, code=code).response()

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> Response:
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return APIError(500, "internal server error", "server_error").response()

    @app.get("/health")
    async def health() -> Response:
        if async_engine.is_running:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": served_model_name,
                        "object": "model",
                        "created": server.created,
                        "owned_by": "cbgen",
                        "max_model_len": server.max_model_len,
                    }
                ],
            }
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        req: CompletionRequest = _parse(CompletionRequest, await _read_json(request, limits.max_body_bytes))
        server.check_model(req.model)
        if req.echo:
            raise _bad("echo is not supported", param="echo")
        if req.suffix:
            raise _bad("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise _bad("best_of other than n is not supported", param="best_of")
        if req.logprobs is not None and not 0 <= req.logprobs <= server.max_logprobs:
            raise _bad(f"logprobs must be between 0 and {server.max_logprobs}", param="logprobs")
        include_usage = server.check_stream_options(req)
        prompts = _completion_prompts(server, req)
        params = [
            server.sampling_params(
                req, server.resolve_max_tokens(req.max_tokens, 16, len(ids), "max_tokens"), req.logprobs
            )
            for ids in prompts
        ]
        streams = server.submit(prompts, params, "cmpl-" + uuid.uuid4().hex)
        job = _Job(
            server,
            False,
            streams,
            [len(p) for p in prompts],
            req.n,
            params[0].greedy,
            req.logprobs is not None,
            include_usage,
            arrival,
        )
        return await _respond(job, request, bool(req.stream))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.monotonic()
        req: ChatCompletionRequest = _parse(
            ChatCompletionRequest, await _read_json(request, limits.max_body_bytes)
        )
        server.check_model(req.model)
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise _bad("top_logprobs requires logprobs=true", param="top_logprobs")
            if not 0 <= req.top_logprobs <= server.max_logprobs:
                raise _bad(f"top_logprobs must be between 0 and {server.max_logprobs}", param="top_logprobs")
        include_usage = server.check_stream_options(req)
        ids = _chat_prompt(server, req)
        server.check_prompt(ids)
        requested, name = (req.max_completion_tokens, "max_completion_tokens")
        if requested is None:
            requested, name = req.max_tokens, "max_tokens"
        max_tokens = server.resolve_max_tokens(requested, None, len(ids), name)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = server.sampling_params(req, max_tokens, logprobs)
        streams = server.submit([ids], [params], "chatcmpl-" + uuid.uuid4().hex)
        job = _Job(
            server,
            True,
            streams,
            [len(ids)],
            req.n,
            params.greedy,
            bool(req.logprobs),
            include_usage,
            arrival,
        )
        return await _respond(job, request, bool(req.stream))

    if limits.api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=limits.api_key)
    return app


# ---------------------------------------------------------------------------------------------- main
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cbgen serve", description="OpenAI-compatible HTTP server.")
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="name clients must send as 'model' (default: SmolLM2-135M-Instruct or the folder name)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--num-blocks", type=int, default=None, help="KV-cache blocks (default: sized from memory)"
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="default: the model's context - 1")
    p.add_argument(
        "--max-tokens-limit",
        type=int,
        default=None,
        help="largest max_tokens a request may ask for (default: what the context allows)",
    )
    p.add_argument("--max-n", type=int, default=16)
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument(
        "--max-concurrent-requests", type=int, default=1024, help="requests in flight before new ones get 429"
    )
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--max-prompts-per-request", type=int, default=32)
    p.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set CBGEN_API_KEY)"
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument(
        "--graceful-shutdown-timeout",
        type=float,
        default=15.0,
        help="seconds to wait for open connections after SIGTERM",
    )
    return p


def _served_name(model: str | None, explicit: str | None) -> str:
    if explicit:
        return explicit
    if model is None:
        return DEFAULT_SERVED_NAME
    path = Path(model.rstrip("/\\"))
    return path.stem if path.suffix == ".gguf" else path.name or str(model)


def main(argv: list[str] | None = None) -> None:
    """``cbgen serve``: loads the model and serves it until SIGINT/SIGTERM (exit code 0 on SIGTERM)."""
    args = _parser().parse_args(argv)
    for name in ("max_n", "max_body_bytes", "max_concurrent_requests", "max_prompts_per_request"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    # cbgen's package logger already has a stderr handler; basicConfig would print every record twice.
    get_logger("cbgen").setLevel(args.log_level.upper())
    api_key = args.api_key or os.environ.get("CBGEN_API_KEY") or None

    from cbgen.llm import LLM

    engine_kwargs: dict[str, Any] = {"max_logprobs": args.max_logprobs}
    if args.max_model_len is not None:
        engine_kwargs["max_model_len"] = args.max_model_len
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_blocks=args.num_blocks,
        **engine_kwargs,
    )
    async_engine = AsyncEngine.from_llm(llm, max_concurrent_requests=args.max_concurrent_requests)
    limits = ServerLimits(
        max_prompt_tokens=args.max_prompt_tokens,
        max_tokens_limit=args.max_tokens_limit,
        max_n=args.max_n,
        max_body_bytes=args.max_body_bytes,
        max_logprobs=args.max_logprobs,
        max_prompts_per_request=args.max_prompts_per_request,
        api_key=api_key,
    )
    name = _served_name(args.model, args.served_model_name)
    app = build_app(async_engine, llm.tokenizer, name, limits)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        lifespan="on",
        timeout_graceful_shutdown=args.graceful_shutdown_timeout,
    )
    server = _GracefulServer(config, async_engine.start_shutdown)
    # uvicorn re-raises the signal it shut down for once it restored the previous handler; a no-op
    # previous handler turns a SIGTERM-initiated graceful shutdown into a normal exit with code 0.
    previous = signal.signal(signal.SIGTERM, _note_sigterm)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    logger.info("server stopped")


def _note_sigterm(signum: int, frame: Any) -> None:
    logger.info("SIGTERM handled: graceful shutdown complete")


class _GracefulServer(uvicorn.Server):
    """uvicorn's server, ending in-flight generations as soon as shutdown starts.

    uvicorn waits for open connections before it runs the lifespan shutdown, and a stream keeps its
    connection open until its generation ends; aborting first lets every stream finish promptly with
    a final chunk and ``[DONE]``.
    """

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets: Any = None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets)
