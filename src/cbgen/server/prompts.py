"""Prompt token ids from a request: completions prompts (text or ids, one or many) and chat templating."""

from __future__ import annotations

from typing import Any

from cbgen.server.errors import bad_request
from cbgen.server.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from cbgen.server.state import ServerState
from cbgen.server.tools import chat_message, template_kwargs, tool_plan


def check_prompt(state: ServerState, ids: list[int]) -> None:
    """400 unless ``ids`` is a non-empty prompt within ``--max-prompt-tokens`` (default: context - 1)."""
    limit = state.limits.max_prompt_tokens
    if limit is None:
        limit = state.max_model_len - 1
    if len(ids) > limit:
        raise bad_request(f"prompt has {len(ids)} tokens, over the limit of {limit} tokens", param="prompt")
    if not ids:
        raise bad_request("prompt is empty", param="prompt")


def completion_prompts(state: ServerState, req: CompletionRequest) -> list[list[int]]:
    """The token ids of each prompt of a completions request, each checked against the limits."""
    prompt = req.prompt
    if isinstance(prompt, str) or (isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int))):
        items: list[Any] = [prompt]
    else:
        items = list(prompt)
        if not items:
            raise bad_request("prompt is empty", param="prompt")
    if len(items) > state.limits.max_prompts_per_request:
        raise bad_request(
            f"at most {state.limits.max_prompts_per_request} prompts per request", param="prompt"
        )
    out = []
    for item in items:
        if isinstance(item, str):
            if state.tokenizer is None:
                raise bad_request("text prompts need a tokenizer; send token ids", param="prompt")
            if len(item) > 64 * state.max_model_len:
                # Far longer than any context: reject before spending time tokenising it.
                raise bad_request("prompt is far longer than the model's context", param="prompt")
            ids = list(state.tokenizer.encode(item, add_special_tokens=True))
        else:
            ids = list(item)
            bad = next((t for t in ids if not 0 <= t < state.vocab_size), None)
            if bad is not None:
                raise bad_request(
                    f"prompt token id {bad} is outside the vocabulary [0, {state.vocab_size})",
                    param="prompt",
                )
        check_prompt(state, ids)
        out.append(ids)
    return out


def _message_text(i: int, m: ChatMessage) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    parts = []
    for part in m.content:
        if part.type != "text" or part.text is None:
            raise bad_request(
                f"messages[{i}]: only text content parts are supported, got {part.type!r}",
                param=f"messages.{i}.content",
            )
        parts.append(part.text)
    return "\n".join(parts)


def chat_prompt(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    """The conversation rendered with the tokenizer's chat template, as token ids (not yet length-checked)."""
    if state.tokenizer is None or not getattr(state.tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", param="messages")
    # Tools (cbgen.server.tools): checked, and the template must render them; response_format is
    # the sampling side's (cbgen.server.structured).
    tool_kwargs = template_kwargs(state, req, tool_plan(req))
    conversation = []
    for i, m in enumerate(req.messages):
        tool_entry = chat_message(i, m)  # a tool result, or an assistant message with tool calls
        if tool_entry is not None:
            conversation.append(tool_entry)
            continue
        role = "system" if m.role == "developer" else m.role
        conversation.append({"role": role, "content": _message_text(i, m)})
    try:
        ids = state.tokenizer.apply_chat_template(
            conversation,
            tokenize=True,
            add_generation_prompt=req.add_generation_prompt,
            return_dict=False,
            **tool_kwargs,
        )
    except Exception as exc:  # template errors (e.g. a template's raise_exception) are the caller's input
        raise bad_request(f"could not apply the chat template: {exc}", param="messages") from None
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(t) for t in ids]
