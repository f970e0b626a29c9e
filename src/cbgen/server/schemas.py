"""Request bodies of the OpenAI-compatible endpoints.

Scalars are strict (``"16"`` is not an integer, ``true`` is not a number) so that a client bug is
reported as a 400 instead of being silently coerced.  Unknown fields are ignored, as OpenAI's own API
does for fields it added after a client was written.  Responses are built as plain dicts in
:mod:`cbgen.server.job`, which keeps the hot streaming path free of model construction.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = StrictFloat | StrictInt

# "developer" is OpenAI's newer name for "system"; "tool" messages carry tool results (tool calling:
# cbgen.server.tools); legacy "function" messages are rejected rather than silently mis-rendered.
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    """``stream_options``: ``include_usage`` adds a final chunk carrying ``usage``."""

    include_usage: StrictBool = False


class SamplingFields(_Body):
    """Fields shared by completions and chat completions (OpenAI names plus vLLM's extras)."""

    model: StrictStr
    n: StrictInt = 1
    temperature: Number | None = None
    top_p: Number | None = None
    max_tokens: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[StrictStr, Number] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # vLLM-compatible extras (sent by the openai client through ``extra_body``).
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    min_tokens: StrictInt | None = None
    ignore_eos: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    stop_token_ids: list[StrictInt] | None = None
    # Structured output (cbgen.server.structured): vLLM's guided decoding fields.
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    logprobs: StrictInt | None = None
    echo: StrictBool | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None


class ContentPart(_Body):
    """One part of a multi-part message; only ``{"type": "text", "text": ...}`` is supported."""

    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(_Body):
    """One chat message."""

    role: ChatRole
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    # Tool calling (cbgen.server.tools): an assistant's calls, and which call a tool message answers.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: StrictStr | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    response_format: dict[str, Any] | None = None
