"""Structured output from an HTTP request: OpenAI's ``response_format``, vLLM's ``guided_*`` fields and
``structured_outputs``, and forced tool calls, as one :class:`~cbgen.structured_params.StructuredOutputParams`.

* ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}`` (any JSON object),
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``.  The
  schema is enforced whether ``strict`` is true or not: cbgen constrains decoding either way, so the
  output always validates (OpenAI's non-strict mode only promises a best effort).
* vLLM's extras, on completions and chat alike: ``guided_json`` (a schema, object or string),
  ``guided_regex``, ``guided_choice`` (a list of strings), ``guided_grammar`` (Lark), and the newer
  ``structured_outputs`` object (``{"json": ...}``, ``{"regex": ...}``, ``{"choice": [...]}``,
  ``{"grammar": ...}``, ``{"json_object": true}``).
* ``tool_choice`` ``"required"`` or a named function (see :mod:`cbgen.server.tools`).

At most one of them may constrain a request (a 400 otherwise).  The constraint is compiled here, so a
schema or grammar that does not compile, or that hits one of the grammar library's limits within its
first tokens, is a 400 naming the field it came from, before anything is queued.

The grammar library's view of the tokenizer (about a second for a 49k vocabulary) is built when the
server starts (:func:`prepare_structured_output`), not by the first constrained request: request
planning runs on the event loop, where that second would stall every other connection.
"""

from __future__ import annotations

import asyncio
from typing import Any

from cbgen.server.errors import bad_request
from cbgen.server.schemas import ChatCompletionRequest, SamplingFields
from cbgen.server.tools import forced_call_grammar, needs_special_tokens, tool_plan
from cbgen.structured_params import StructuredOutputParams

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def structured_kwargs(state: Any, req: SamplingFields) -> dict[str, Any]:
    """``SamplingParams`` fields for the request's constraint: ``structured_output`` (absent when
    unconstrained), and ``skip_special_tokens=False`` when tool-call markers are special tokens."""
    tools = tool_plan(req) if isinstance(req, ChatCompletionRequest) else None
    found: list[tuple[str, StructuredOutputParams]] = []
    if isinstance(req, ChatCompletionRequest) and req.response_format is not None:
        spec = _response_format(req.response_format)
        if spec is not None:
            found.append(("response_format", spec))
    for field, kind in _GUIDED.items():
        value = getattr(req, field, None)
        if value is not None:
            found.append((field, _spec(field, {kind: value})))
    if req.structured_outputs is not None:
        if not isinstance(req.structured_outputs, dict):
            raise bad_request("structured_outputs must be an object", param="structured_outputs")
        found.append(("structured_outputs", _spec("structured_outputs", req.structured_outputs)))
    if tools is not None and tools.forced:
        found.append(("tool_choice", forced_call_grammar(tools, state.tokenizer)))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"only one output constraint per request, got {names}", param=found[1][0])
    out: dict[str, Any] = {}
    if (
        tools is not None
        and tools.parse
        and state.tokenizer is not None
        and needs_special_tokens(state.tokenizer)
    ):
        out["skip_special_tokens"] = False
    if not found:
        return out
    field, spec = found[0]
    _compile(state, field, spec)
    out["structured_output"] = spec
    return out


async def prepare_structured_output(state: Any) -> bool:
    """Builds the grammar backend of ``state``'s engine on a worker thread (for the app's startup);
    True when built, False when structured output is unavailable (the requests that ask for it
    then get the 400 saying why)."""
    return await asyncio.to_thread(state.engine.engine.structured.prepare)


def _response_format(fmt: dict[str, Any]) -> StructuredOutputParams | None:
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputParams(json_object=True)
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict) or not isinstance(inner.get("schema", {}), dict):
            raise bad_request(
                'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                param="response_format",
            )
        strict = inner.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request("response_format.json_schema.strict must be a boolean", param="response_format")
        # No schema at all means any JSON value is fine; OpenAI requires one, vLLM tolerates it.
        schema = inner.get("schema")
        return _spec("response_format", {"json": schema} if schema is not None else {"json_object": True})
    raise bad_request(
        f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
        param="response_format",
    )


def _spec(field: str, value: dict[str, Any]) -> StructuredOutputParams:
    try:
        return StructuredOutputParams.coerce(value)
    except (TypeError, ValueError) as exc:
        raise bad_request(f"{field}: {_plain(exc)}", param=field) from None


def _compile(state: Any, field: str, spec: StructuredOutputParams) -> None:
    structured = state.engine.engine.structured
    try:
        structured.compiled(spec)
    except ImportError as exc:
        raise bad_request(
            f"{field}: structured output is not installed on this server: {exc}", param=field
        ) from None
    except ValueError as exc:
        raise bad_request(f"{field}: {_plain(exc)}", param=field) from None


def _plain(exc: Exception) -> str:
    """An error without the ``SamplingParams.structured_output.<kind>:`` prefix meant for Python callers."""
    text = str(exc)
    prefix = "SamplingParams.structured_output"
    if text.startswith(prefix):
        text = text[len(prefix) :].lstrip(".:").strip()
    return text


__all__ = ["prepare_structured_output", "structured_kwargs"]
