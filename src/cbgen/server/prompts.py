"""Prompt token ids from a request: completions prompts (text or ids, one or many) and chat templating.

Special tokens: a completions prompt is tokenised as it is, control tokens included (its client writes
the whole prompt anyway).  Chat message text is the user's, inside a template the server applies: by
default any special-token text in it (``<|im_end|>``, ``<|im_start|>system``...) is kept literal, so
a message cannot close its turn and forge a system one (``ServerLimits.allow_special_tokens`` parses it).
"""

from __future__ import annotations

import uuid
from typing import Any

from cbgen.server.errors import bad_request
from cbgen.server.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from cbgen.server.state import ServerState
from cbgen.server.tools import chat_message, template_kwargs, tool_plan

# Text longer than this many characters per token of the limit is first counted on a prefix of that
# length: most text has several tokens per four characters, so a prompt far over the limit is found
# without tokenising all of it (a megabyte takes seconds of CPU the engine needs).
_PREFIX_CHARS_PER_TOKEN = 4


def _prefix_over_limit(state: ServerState, text: str, literal: bool, what: str) -> None:
    """400 if a prefix of ``text`` alone has more tokens than the prompt limit."""
    limit = prompt_limit(state)
    cut = _PREFIX_CHARS_PER_TOKEN * (limit + 2)
    if len(text) <= cut:
        return
    n = len(state.tokenizer.encode(text[:cut], add_special_tokens=False, split_special_tokens=literal))
    if n > limit + 1:  # + 1: the cut may split a token in two
        raise bad_request(
            f"{what} {'has' if what == 'prompt' else 'have'} more than {n - 1} tokens in the first {cut:,} "
            "characters, over the limit of "
            f"{limit} tokens",
            param=what,
        )


def prompt_limit(state: ServerState) -> int:
    """The longest prompt accepted, in tokens (``--max-prompt-tokens``, default: context - 1)."""
    limit = state.limits.max_prompt_tokens
    return state.request_limits.max_prompt_tokens if limit is None else limit


def check_prompt(state: ServerState, ids: list[int]) -> None:
    """400 unless ``ids`` is a non-empty prompt within ``--max-prompt-tokens`` (default: context - 1)."""
    limit = prompt_limit(state)
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
            if len(item) > state.max_token_chars * prompt_limit(state):
                raise bad_request(
                    f"prompt has {len(item):,} characters, far more than the limit of {prompt_limit(state)} "
                    "tokens can hold",
                    param="prompt",
                )
            _prefix_over_limit(state, item, False, "prompt")
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
        # OpenAI allows it only beside tool calls, which this server does not support.
        raise bad_request(f"messages[{i}]: content must not be null", param=f"messages.{i}.content")
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
    texts = [m["content"] for m in conversation if isinstance(m.get("content"), str)]
    chars = sum(map(len, texts))
    if chars > state.max_token_chars * prompt_limit(state):
        raise bad_request(
            f"messages hold {chars:,} characters, far more than the prompt limit of {prompt_limit(state)} "
            "tokens can hold",
            param="messages",
        )
    literal = not state.limits.allow_special_tokens
    _prefix_over_limit(state, "\n".join(texts), literal, "messages")
    specials = state.special_tokens
    if not state.limits.allow_special_tokens and any(t in text for text in texts for t in specials):
        return _literal_chat_prompt(state, conversation, req.add_generation_prompt, tool_kwargs)
    return _template_ids(
        state, conversation, req.add_generation_prompt, tokenize=True, tool_kwargs=tool_kwargs
    )


def _template_ids(
    state: ServerState,
    conversation: list[dict[str, Any]],
    add_generation_prompt: bool,
    tokenize: bool,
    tool_kwargs: dict[str, Any],
) -> Any:
    try:
        out = state.tokenizer.apply_chat_template(
            conversation,
            tokenize=tokenize,
            add_generation_prompt=add_generation_prompt,
            return_dict=False,
            **tool_kwargs,
        )
    except Exception as exc:  # template errors (e.g. a template's raise_exception) are the caller's input
        raise bad_request(f"could not apply the chat template: {exc}", param="messages") from None
    if not tokenize:
        return out
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list):
        out = out[0]
    return [int(t) for t in out]


def _literal_chat_prompt(
    state: ServerState,
    conversation: list[dict[str, Any]],
    add_generation_prompt: bool,
    tool_kwargs: dict[str, Any],
) -> list[int]:
    """The templated conversation with each message's text tokenised literally: the template is rendered
    around a unique marker per message, its own text tokenised with control tokens, each message's
    text with its special-token text split into ordinary tokens."""
    tok = state.tokenizer
    # Messages without text (tool calls) render as they are; only text is kept literal.
    marks = [f"cbgen-{uuid.uuid4().hex}" if isinstance(m.get("content"), str) else None for m in conversation]
    rendered = _template_ids(
        state,
        [{**m, "content": mark} if mark else m for m, mark in zip(conversation, marks)],
        add_generation_prompt,
        tokenize=False,
        tool_kwargs=tool_kwargs,
    )
    ids: list[int] = []
    pos = 0
    for m, mark in ((m, mark) for m, mark in zip(conversation, marks) if mark):
        at = rendered.find(mark, pos)
        if at < 0 or rendered.count(mark) != 1:
            raise bad_request(
                "this model's chat template does not place each message's text once, so special-token "
                "text in a message cannot be kept literal; remove it",
                param="messages",
            )
        ids += tok.encode(rendered[pos:at], add_special_tokens=False)
        ids += tok.encode(m["content"], add_special_tokens=False, split_special_tokens=True)
        pos = at + len(mark)
    ids += tok.encode(rendered[pos:], add_special_tokens=False)
    return [int(t) for t in ids]
