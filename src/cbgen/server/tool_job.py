"""A chat job whose output may hold tool calls: ``<tool_call>`` blocks become ``tool_calls``.

The rest of the job (streams, SSE framing, usage, logprobs, errors) is :class:`GenerationJob`'s;
only how one choice is rendered differs, whole (``message.tool_calls``) or streamed (``delta.tool_calls``
chunks, one per completed call, as the ``openai`` client accumulates them).  A choice that made at least
one call and stopped by itself finishes with ``"tool_calls"``.
"""

from __future__ import annotations

from typing import Any

from cbgen.outputs import CompletionOutput
from cbgen.server.job import GenerationJob, _Choice
from cbgen.server.logprobs import chat_logprobs
from cbgen.server.tools import ToolCallStream, parse_tool_calls


def _finish(reason: str | None, made_calls: bool) -> str | None:
    return "tool_calls" if made_calls and reason == "stop" else reason


class ToolCallJob(GenerationJob):
    """:class:`GenerationJob` for chat requests with tools (``tool_choice`` other than ``"none"``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._streams: dict[int, ToolCallStream] = {}

    def _stream_choice(self, choice: _Choice, c: CompletionOutput) -> dict[str, Any]:
        parser = self._streams.setdefault(choice.index, ToolCallStream())
        content, calls = parser.feed(c.text)
        if c.finish_reason is not None:
            content += parser.finish()
        delta: dict[str, Any] = {}
        if not choice.text:
            delta["role"] = "assistant"
        choice.text.append(c.text)
        if content or ("role" in delta and not calls):
            delta["content"] = content
        if calls:
            first = parser.num_calls - len(calls)
            delta["tool_calls"] = [{"index": first + k, **call} for k, call in enumerate(calls)]
        return {
            "index": choice.index,
            "delta": delta,
            "logprobs": chat_logprobs(*self._entries(c)) if self.logprobs else None,
            "finish_reason": _finish(c.finish_reason, parser.num_calls > 0),
            "stop_reason": c.stop_reason,
        }

    def _final_choice(self, ch: _Choice) -> dict[str, Any]:
        content, calls = parse_tool_calls("".join(ch.text))
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return {
            "index": ch.index,
            "message": message,
            "logprobs": chat_logprobs(ch.lp_tokens, ch.lp_values, ch.lp_top) if self.logprobs else None,
            "finish_reason": _finish(ch.finish_reason, bool(calls)),
            "stop_reason": ch.stop_reason,
        }


__all__ = ["ToolCallJob"]
