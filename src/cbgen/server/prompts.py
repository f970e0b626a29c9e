"""Prompt token ids from a request: completions prompts (text or ids, one or many) and chat templating.

Special tokens: a completions prompt is tokenised as it is, control tokens included (its client writes
the whole prompt anyway).  Everything a chat template renders from the request (message text, names,
tool calls, tools and their schemas) is the client's data inside a template the server applies: by
default special-token text anywhere in it (``<|im_end|>``, ``<|im_start|>system``...) is kept literal,
so no field can close its turn and forge a system one (:mod:`cbgen.server.template_escape` says how;
``ServerLimits.allow_special_tokens`` parses it instead).

Cost: templating and tokenising are linear in the request's size, and a conversation over the prompt
limit is refused once a prefix of it is found over (a megabyte of tiny messages costs one render and
the tokens of about one prompt, not all of it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cbgen.server.errors import bad_request
from cbgen.server.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from cbgen.server.state import ServerState
from cbgen.server.template_escape import ControlTokens, control_tokens
from cbgen.server.tools import chat_message, template_kwargs, tool_plan

# Text longer than this many characters per token of the limit is first counted on a prefix of that
# length: most text has several tokens per four characters, so a prompt far over the limit is found
# without tokenising all of it (a megabyte takes seconds of CPU the engine needs).
_PREFIX_CHARS_PER_TOKEN = 4


def _prefix_over_limit(
    state: ServerState, text: str, what: str, count: Callable[[str], int], guard: ControlTokens | None = None
) -> None:
    """400 if a prefix of ``text`` alone has more tokens (as ``count`` counts them) than the prompt
    limit.  ``guard``: the cut is kept off the middle of the template's control tokens."""
    limit = prompt_limit(state)
    cut = _PREFIX_CHARS_PER_TOKEN * (limit + 2)
    if len(text) <= cut:
        return
    if guard is not None:
        cut = guard.safe_cut(text, cut)
    n = count(text[:cut])
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
            _prefix_over_limit(state, item, "prompt", _parsed_count(state))
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
    """The conversation rendered with the tokenizer's chat template, as token ids: with the request's
    special-token text as plain text (unless allowed), and refused (400) as soon as it is found over
    the prompt limit (the exact check is the caller's)."""
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
    guard = control_tokens(state.tokenizer, state.special_tokens)
    literal = not state.limits.allow_special_tokens
    count = _literal_count(guard) if literal else _parsed_count(state)
    _prefix_over_limit(state, "\n".join(texts), "messages", count)
    defused = False
    if literal:
        try:
            (conversation, tool_kwargs), defused = guard.defuse((conversation, tool_kwargs))
        except RecursionError:
            raise bad_request("messages or tools are nested too deeply", param="messages") from None
    rendered = _render(state, conversation, req.add_generation_prompt, tool_kwargs)
    _check_rendered_chars(state, guard, rendered)
    if not defused:
        # The whole text in one call, as apply_chat_template(tokenize=True) would: nothing in it came
        # from the request as control-token text (or the server allows it).
        _prefix_over_limit(state, rendered, "messages", _parsed_count(state), guard)
        return [int(t) for t in state.tokenizer.encode(rendered, add_special_tokens=False)]
    return _encode_pieces(state, guard, rendered)


def _literal_count(guard: ControlTokens) -> Callable[[str], int]:
    return lambda text: len(guard.encode_literal([text])[0])


def _parsed_count(state: ServerState) -> Callable[[str], int]:
    return lambda text: len(state.tokenizer.encode(text, add_special_tokens=False))


def _render(
    state: ServerState,
    conversation: list[dict[str, Any]],
    add_generation_prompt: bool,
    tool_kwargs: dict[str, Any],
) -> str:
    try:
        return state.tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            return_dict=False,
            **tool_kwargs,
        )
    except Exception as exc:  # template errors (e.g. a template's raise_exception) are the caller's input
        raise bad_request(f"could not apply the chat template: {exc}", param="messages") from None


def _check_rendered_chars(state: ServerState, guard: ControlTokens, rendered: str) -> None:
    """400 if the templated text is far longer than the prompt limit can hold (before tokenising it:
    thousands of tiny messages are small in the body and large once templated)."""
    chars = len(rendered) - rendered.count(guard.escape)
    limit = prompt_limit(state)
    if chars > state.max_token_chars * limit:
        raise bad_request(
            f"the templated conversation has {chars:,} characters, far more than the prompt limit of {limit} "
            "tokens can hold",
            param="messages",
        )


def _encode_pieces(state: ServerState, guard: ControlTokens, rendered: str) -> list[int]:
    """Token ids of a rendered conversation whose request data held control-token text: the template's
    control tokens as ids, all other text as plain text.  Tokenised a chunk of about one prompt's worth
    of text at a time, and refused as soon as the tokens so far are over the prompt limit."""
    limit = prompt_limit(state)
    chunk_chars = _PREFIX_CHARS_PER_TOKEN * (limit + 2)
    ids: list[int] = []
    chunk: list[str | int] = []
    size = 0
    for piece in guard.pieces(rendered):
        chunk.append(piece)
        size += len(piece) if isinstance(piece, str) else 1
        if size >= chunk_chars:
            _encode_chunk(guard, chunk, ids)
            chunk, size = [], 0
            if len(ids) > limit:
                raise bad_request(
                    f"the templated conversation has more than {len(ids) - 1} tokens, over the limit of "
                    f"{limit} tokens",
                    param="messages",
                )
    _encode_chunk(guard, chunk, ids)
    return ids


def _encode_chunk(guard: ControlTokens, chunk: list[str | int], out: list[int]) -> None:
    """Appends the ids of ``chunk`` (control ids and texts, in order) to ``out``."""
    encoded = iter(guard.encode_literal([p for p in chunk if isinstance(p, str)]))
    for piece in chunk:
        if isinstance(piece, int):
            out.append(piece)
            continue
        ids = next(encoded)
        # A tokenizer whose merges spell a control token from plain text would defeat the split.
        if not guard.id_set.isdisjoint(ids):
            raise bad_request(
                "this tokenizer reads special-token text in messages as control tokens even when told "
                "not to; remove it",
                param="messages",
            )
        out.extend(ids)
