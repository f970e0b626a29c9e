"""One HTTP generation request from submission to response: its engine streams, SSE chunks, final body."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cbgen.async_engine import RequestStream
from cbgen.outputs import CompletionOutput, RequestOutput
from cbgen.server.errors import APIError, bad_request, log_internal_error
from cbgen.server.logprobs import TopLogprobs, chat_logprobs, completion_logprobs, logprob_entries
from cbgen.server.metrics import ServerMetrics
from cbgen.server.state import ServerState
from cbgen.server.streaming import SSEResponse, merge_streams, wait_disconnect
from cbgen.server.translate import GenerationPlan


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


# A non-streamed body with more tokens than this is rendered on a worker thread: JSON for tens of
# thousands of tokens (with logprobs, megabytes) would otherwise stall the event loop.
_OFFLOAD_TOKENS = 4096


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


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
    lp_top: list[TopLogprobs] = field(default_factory=list)


@dataclass
class _PromptTiming:
    """Latency bookkeeping of one prompt, feeding the TTFT, inter-token and end-to-end histograms."""

    arrival: float
    first: float | None = None
    last: float | None = None

    def observe(self, out: RequestOutput, now: float, metrics: ServerMetrics) -> None:
        new_tokens = sum(len(c.token_ids) for c in out.outputs)
        if new_tokens:
            if self.first is None:
                self.first = now
                metrics.observe_ttft(now - self.arrival)
            elif self.last is not None:
                metrics.observe_itl(now - self.last, new_tokens)
            self.last = now
        if out.finished:
            metrics.observe_e2e(now - self.arrival)


class GenerationJob:
    """One HTTP generation request: its engine streams and how to render them."""

    def __init__(
        self, state: ServerState, plan: GenerationPlan, streams: list[RequestStream], arrival: float
    ) -> None:
        self.state = state
        self.chat = plan.chat
        self.streams = streams
        self.prompt_tokens = sum(len(p) for p in plan.prompts)
        self.n = plan.n
        self.greedy = plan.params[0].greedy
        self.logprobs = plan.logprobs
        self.include_usage = plan.include_usage
        self.id = ("chatcmpl-" if plan.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.choices = [_Choice(index=i) for i in range(len(streams) * plan.n)]
        self.timings = [_PromptTiming(arrival) for _ in streams]
        self.completion_tokens = 0
        self.error: str | None = None

    def absorb(self, p: int, out: RequestOutput) -> list[tuple[_Choice, CompletionOutput]]:
        """Records one delta output; returns the choices it changed (each at most once finished)."""
        self.timings[p].observe(out, time.monotonic(), self.state.metrics)
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
                self.state.metrics.observe_finish(c.finish_reason)
            changed.append((choice, c))
        if out.finished and out.error and self.error is None:
            self.error = out.error
        return changed

    def _entries(self, c: CompletionOutput) -> tuple[list[str], list[float], list[TopLogprobs]]:
        return logprob_entries(c, self.greedy, self.state.token_text)

    # ---------------------------------------------------------------- streaming
    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.state.model_name,
            "choices": choices,
        }
        if self.include_usage:
            body["usage"] = usage
        return f"data: {_dumps(body)}\n\n"

    def _stream_choice(self, choice: _Choice, c: CompletionOutput) -> dict[str, Any]:
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
                "logprobs": chat_logprobs(*self._entries(c)) if self.logprobs else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
        choice.text.append(c.text)
        lp = None
        if self.logprobs:
            lp, choice.text_offset = completion_logprobs(*self._entries(c), choice.text_offset)
        return {
            "index": choice.index,
            "text": c.text,
            "logprobs": lp,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }

    async def sse(self) -> AsyncIterator[str]:
        """The SSE body: a chunk per engine delta, any error in-band, optional usage, ``[DONE]``."""
        try:
            try:
                async for p, out in merge_streams(self.streams):
                    changed = self.absorb(p, out)
                    if changed:
                        yield self._chunk([self._stream_choice(ch, c) for ch, c in changed])
                    if out.finished and out.error:
                        yield f"data: {_dumps(APIError(500, out.error, 'server_error').body())}\n\n"
            except Exception as exc:  # the engine failed underneath: end the stream in-band
                log_internal_error(f"stream {self.id}", exc)
                yield f"data: {_dumps(APIError(500, str(exc), 'server_error').body())}\n\n"
            if self.include_usage:
                yield self._chunk([], _usage(self.prompt_tokens, self.completion_tokens))
            yield "data: [DONE]\n\n"
        finally:
            for s in self.streams:
                s.cancel()

    # ---------------------------------------------------------------- non-streaming
    async def collect(self) -> None:
        """Runs every stream to its end, accumulating text and logprobs for :meth:`final_body`."""
        async for p, out in merge_streams(self.streams):
            for choice, c in self.absorb(p, out):
                choice.text.append(c.text)
                if self.logprobs:
                    tokens, values, tops = self._entries(c)
                    choice.lp_tokens += tokens
                    choice.lp_values += values
                    choice.lp_top += tops

    def _final_choice(self, ch: _Choice) -> dict[str, Any]:
        text = "".join(ch.text)
        lp = None
        if self.chat:
            if self.logprobs:
                lp = chat_logprobs(ch.lp_tokens, ch.lp_values, ch.lp_top)
            return {
                "index": ch.index,
                "message": {"role": "assistant", "content": text},
                "logprobs": lp,
                "finish_reason": ch.finish_reason,
                "stop_reason": ch.stop_reason,
            }
        if self.logprobs:
            lp, _ = completion_logprobs(ch.lp_tokens, ch.lp_values, ch.lp_top, 0)
        return {
            "index": ch.index,
            "text": text,
            "logprobs": lp,
            "finish_reason": ch.finish_reason,
            "stop_reason": ch.stop_reason,
        }

    def final_json(self) -> bytes:
        """:meth:`final_body` as the bytes of a JSON response."""
        return _dumps(self.final_body()).encode("utf-8")

    def final_body(self) -> dict[str, Any]:
        """The non-streaming response body, once :meth:`collect` has finished."""
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.state.model_name,
            "choices": [self._final_choice(ch) for ch in self.choices],
            "usage": _usage(self.prompt_tokens, self.completion_tokens),
        }


async def respond(job: GenerationJob, request: Request, stream: bool) -> Response:
    """The job's HTTP response: SSE, or the whole body once done (499 if the client left first)."""
    if stream:
        return SSEResponse(job.sse(), job.streams, job.state.limits.write_timeout)
    consume = asyncio.ensure_future(job.collect())
    watch = asyncio.ensure_future(wait_disconnect(request.receive))
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
            raise bad_request(str(exc))
        raise APIError(500, f"generation failed: {exc}", "server_error")
    if job.error is not None:
        raise APIError(500, job.error, "server_error")
    if job.completion_tokens > _OFFLOAD_TOKENS:
        return Response(await job.state.off_loop(job.final_json), media_type="application/json")
    return JSONResponse(job.final_body())
