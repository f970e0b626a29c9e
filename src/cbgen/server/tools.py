"""Tool calling for chat completions: Hermes-style ``<tool_call>`` blocks.

The chat template renders the request's ``tools`` (templates of Qwen2.5, Hermes and most open models
since put them in a ``<tools>`` system section and expect the model to answer with
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks).  The blocks in the output
become OpenAI ``tool_calls``, with ``finish_reason="tool_calls"``.  ``tool_choice``:

* ``"none"``: the tools are rendered, the output is returned as text;
* ``"auto"`` (the default with tools): the model decides, its blocks are parsed;
* ``"required"``: a grammar makes the output one or more tool-call blocks (one with
  ``parallel_tool_calls=false``), each naming a given tool with arguments valid against its schema;
* ``{"type": "function", "function": {"name": ...}}``: the same, for exactly that tool, once.

A tool's ``parameters`` must be a JSON schema with ``"type": "object"`` (OpenAI's rule: arguments are
a JSON object); absent or ``{}`` is a function without arguments.  Anything else is a 400, whatever
``tool_choice`` is.  A template that does not render tools (its output is the same with and without
them) is a 400.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from cbgen.server.errors import bad_request
from cbgen.server.schemas import ChatCompletionRequest, ChatMessage
from cbgen.structured_params import StructuredOutputParams

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
# The JSON inside a forced call, formatted as the Hermes prompts show it (and as structured output
# formats JSON elsewhere: no free whitespace).
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asked of tools: the tools, and whether and how to force a call."""

    tools: list[dict[str, Any]]
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None
    parallel: bool = True

    @property
    def parse(self) -> bool:
        """Whether ``<tool_call>`` blocks in the output become ``tool_calls``."""
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        """Whether a grammar makes the output tool calls."""
        return self.choice in ("required", "named")


def tool_plan(req: ChatCompletionRequest) -> ToolPlan | None:
    """``tools`` and ``tool_choice`` checked (400 naming the field); None without tools."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    tools = [_checked_tool(i, t) for i, t in enumerate(req.tools)]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", param="tools")
    parallel = req.parallel_tool_calls is not False
    if choice is None or choice in ("none", "auto", "required"):
        return ToolPlan(tools, choice or "auto", parallel=parallel)
    if (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str)
    ):
        name = choice["function"]["name"]
        if name not in names:
            raise bad_request(
                f"tool_choice names {name!r}, which is not among the tools", param="tool_choice"
            )
        return ToolPlan(tools, "named", named=name, parallel=False)
    raise bad_request(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


def _checked_tool(i: int, tool: Any) -> dict[str, Any]:
    where = f"tools.{i}"
    if (
        not isinstance(tool, dict)
        or tool.get("type") != "function"
        or not isinstance(tool.get("function"), dict)
    ):
        raise bad_request(f'{where}: expected {{"type": "function", "function": {{...}}}}', param=where)
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_request(
            f"{where}.function.name must match [A-Za-z0-9_.-]{{1,64}}", param=f"{where}.function.name"
        )
    params = _checked_parameters(fn.get("parameters"), f"{where}.function.parameters")
    return {"type": "function", "function": {**fn, "parameters": params}}


def _checked_parameters(params: Any, where: str) -> dict[str, Any]:
    """A function's ``parameters``: a JSON schema of ``"type": "object"`` (OpenAI's rule: the
    arguments are always a JSON object).  Absent or ``{}`` is a function without arguments."""
    if params is None or params == {}:
        # No arguments at all: the forced call's arguments are exactly {}.
        return {"type": "object", "properties": {}, "additionalProperties": False}
    if not isinstance(params, dict):
        raise bad_request(f"{where} must be a JSON schema object", param=where)
    kind = params.get("type")
    if kind != "object":
        got = "no type" if kind is None else f"type {json.dumps(kind)}"
        raise bad_request(f'{where} must be a JSON schema with "type": "object" (got {got})', param=where)
    return params


# ---------------------------------------------------------------------------------------- prompt
def template_kwargs(state: Any, req: ChatCompletionRequest, plan: ToolPlan | None) -> dict[str, Any]:
    """Extra ``apply_chat_template`` arguments: the tools, once the template is known to render them."""
    uses_tools = plan is not None or any(m.role == "tool" or m.tool_calls for m in req.messages)
    if not uses_tools:
        return {}
    if not renders_tools(state.tokenizer):
        raise bad_request(
            "this model's chat template does not support tools (it renders the same prompt with and "
            "without them)",
            param="tools" if plan is not None else "messages",
        )
    return {"tools": plan.tools} if plan is not None else {}


_RENDERS: dict[int, bool] = {}


def renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template puts tools into the prompt (checked once per template)."""
    template = getattr(tokenizer, "chat_template", None)
    key = hash(json.dumps(template, sort_keys=True, default=str))
    known = _RENDERS.get(key)
    if known is not None:
        return known
    probe = [{"type": "function", "function": {"name": "cbgen_probe_tool", "parameters": {"type": "object"}}}]
    conversation = [{"role": "user", "content": "hi"}]
    try:
        plain = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        with_tools = tokenizer.apply_chat_template(
            conversation, tools=probe, tokenize=False, add_generation_prompt=True
        )
        known = "cbgen_probe_tool" in with_tools and with_tools != plain
    except Exception:
        known = False
    _RENDERS[key] = known
    return known


def chat_message(i: int, m: ChatMessage) -> dict[str, Any] | None:
    """The template's form of a tool message or of an assistant message with ``tool_calls``; None
    for any other message (rendered as before)."""
    if m.role == "tool":
        if not isinstance(m.content, str):
            raise bad_request(
                f"messages[{i}]: a tool message needs string content", param=f"messages.{i}.content"
            )
        out: dict[str, Any] = {"role": "tool", "content": m.content}
        if m.tool_call_id is not None:
            out["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            out["name"] = m.name
        return out
    if m.role != "assistant" or not m.tool_calls:
        return None
    calls = []
    for k, call in enumerate(m.tool_calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(
                f"messages[{i}].tool_calls[{k}]: expected a function call with a name",
                param=f"messages.{i}.tool_calls",
            )
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            # Templates expect a mapping (they JSON-encode it themselves); a non-JSON string stays.
            with contextlib.suppress(ValueError, RecursionError):
                args = _decoded_arguments(args, f"messages.{i}.tool_calls.{k}.function.arguments")
        calls.append(
            {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}
        )
    content = m.content if isinstance(m.content, str) else ""
    return {"role": "assistant", "content": content, "tool_calls": calls}


# ---------------------------------------------------------------------------------------- grammar
def forced_call_grammar(plan: ToolPlan, tokenizer: Any) -> StructuredOutputParams:
    """A Lark grammar whose sentences are tool-call blocks naming the allowed tools with valid arguments.

    Each tool's arguments are their own ``%json`` rule, so each schema is compiled at its own root,
    exactly as ``response_format`` would compile it: ``$ref`` pointers (``#/$defs/...``, ``#`` for
    recursion) resolve from the tool's schema.  One combined schema (``anyOf`` over the tools, the
    arguments under ``properties``) would move every schema away from the root its pointers name."""
    tools = [t for t in plan.tools if plan.choice != "named" or t["function"]["name"] == plan.named]
    start = 'start: call ("\\n" call)*' if plan.parallel else "start: call"
    lines = [
        start,
        f'call: {_literal(OPEN, tokenizer)} "\\n" body "\\n" {_literal(CLOSE, tokenizer)}',
        "body: " + " | ".join(f"tool_{i}" for i in range(len(tools))),
    ]
    for i, tool in enumerate(tools):
        # The envelope is fixed text: the separators the JSON style below uses for the arguments.
        head = json.dumps({"name": tool["function"]["name"]})[:-1] + ', "arguments": '
        lines.append(f"tool_{i}: {json.dumps(head)} args_{i} {json.dumps('}')}")
        lines.append(f"args_{i}: %json " + json.dumps(_styled(tool["function"]["parameters"])))
    return StructuredOutputParams(grammar="\n".join(lines))


def _styled(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with the forced calls' JSON formatting, unless it asks for its own."""
    own = schema.get("x-guidance")
    return {**schema, "x-guidance": {**_JSON_STYLE, **(own if isinstance(own, dict) else {})}}


def _literal(text: str, tokenizer: Any) -> str:
    """``text`` in Lark: as its token when the tokenizer has it as one special token (which the
    grammar library does not match as text), else as a string."""
    special = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    if text in special:
        return f"<[{tokenizer.convert_tokens_to_ids(text)}]>"
    return json.dumps(text)


def needs_special_tokens(tokenizer: Any) -> bool:
    """Whether the tool-call markers are special tokens (detokenising must then keep them)."""
    special = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    return OPEN in special or CLOSE in special


# ---------------------------------------------------------------------------------------- output
def new_call_id() -> str:
    """An OpenAI-style tool call id."""
    return "call_" + uuid.uuid4().hex[:24]


def _decoded_arguments(text: str, param: str) -> Any:
    """A tool call's ``arguments`` string as JSON.  The body was checked for lone surrogates, but
    this string is JSON inside JSON: its own ``\\ud800`` escapes decode only here, into text that no
    tokenizer accepts, so they are refused here too."""
    value = json.loads(text)
    if "\\u" in text:
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request(
                "tool call arguments contain a lone UTF-16 surrogate escape, which is not valid Unicode",
                param=param,
            ) from None
    return value


def _call(body: str) -> dict[str, Any] | None:
    """One block's JSON as an OpenAI tool call, or None if it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": obj["name"], "arguments": arguments},
    }


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a whole output: every well-formed block becomes a call, the text
    around them (stripped; None if empty) is the content, a malformed block stays in it."""
    calls: list[dict[str, Any]] = []
    pieces: list[str] = []
    last = 0
    for m in _BLOCK.finditer(text):
        call = _call(m.group(1).strip())
        if call is None:
            continue
        pieces.append(text[last : m.start()])
        last = m.end()
        calls.append(call)
    if not calls:
        return text, []
    pieces.append(text[last:])
    return "".join(pieces).strip() or None, calls


class ToolCallStream:
    """Splits one choice's streamed text into content deltas and complete tool calls.

    Text that could be the start of ``<tool_call>`` is held back until it is known not to be, and so
    is trailing whitespace, which is dropped if a call follows (as in a whole response, where the
    content around calls is stripped).  A block is emitted as one tool call (name and whole arguments
    in one delta, as OpenAI clients accept) once its ``</tool_call>`` arrives.  A block never closed
    comes out as content at the end."""

    def __init__(self) -> None:
        self.buf = ""
        self.in_call = False
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Content to send now and the calls completed by ``text``."""
        self.buf += text
        content, calls = [], []
        while True:
            if self.in_call:
                j = self.buf.find(CLOSE)
                if j < 0:
                    break
                body, self.buf, self.in_call = self.buf[:j], self.buf[j + len(CLOSE) :], False
                call = _call(body.strip())
                if call is None:
                    content.append(OPEN + body + CLOSE)
                else:
                    calls.append(call)
                    self.num_calls += 1
                continue
            i = self.buf.find(OPEN)
            if i >= 0:
                content.append(self.buf[:i].rstrip())
                self.buf, self.in_call = self.buf[i + len(OPEN) :], True
                continue
            held = _partial_suffix(self.buf, OPEN)
            ready = self.buf[: len(self.buf) - held]
            body = ready.rstrip()
            content.append(body)
            self.buf = ready[len(body) :] + self.buf[len(self.buf) - held :]
            break
        return "".join(content), calls

    def finish(self) -> str:
        """What is still held back, as content (an unfinished block included)."""
        rest = (OPEN if self.in_call else "") + self.buf
        self.buf, self.in_call = "", False
        return rest.rstrip() if self.num_calls else rest


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


__all__ = [
    "ToolCallStream",
    "ToolPlan",
    "chat_message",
    "forced_call_grammar",
    "needs_special_tokens",
    "parse_tool_calls",
    "renders_tools",
    "template_kwargs",
    "tool_plan",
]
