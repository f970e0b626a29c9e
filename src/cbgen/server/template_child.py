"""Chat templating of large request bodies in a child process, so that it never holds this process's GIL.

Rendering a chat template is pure-Python Jinja: a megabyte body of tiny messages holds the GIL for
most of a second, and every other request (and the engine thread between its kernels) waits for its
turns.  Bodies of ``LARGE_BYTES`` or more are therefore parsed and templated by a child process
that holds a copy of the tokenizer and of the limits templating reads (sent pickled when the child
starts): it answers with the parsed body and the prompt's token ids, or the 400 the templating
raised.  The result is :func:`cbgen.server.prompts.chat_prompt`'s, computed by the same code on an
equal tokenizer; this process still validates the body and applies every other check in order.

The child imports cbgen and the tokenizer's libraries: it takes a few seconds and a few hundred MB
to start, on the first large body.  Any trouble with it (it cannot start, it dies, the tokenizer
does not pickle) means the work is done here, as before; a body is never lost.  A body whose answer
the child cannot pickle back (JSON nested too deeply) is refused with the JSON child's 400, and the
child stays up (``server/child_worker.py``).
"""

from __future__ import annotations

import pickle
import sys
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from cbgen.server.child_worker import CHILD_LOOP, ChildWorker, UnserialisableAnswer, python_argv
from cbgen.server.errors import APIError
from cbgen.server.json_child import loads_here, unserialisable_body

if TYPE_CHECKING:
    from cbgen.server.state import ServerLimits


@dataclass
class TemplateSettings:
    """What :func:`cbgen.server.prompts.chat_prompt` reads of a ``ServerState``: sent to the child."""

    tokenizer: Any
    special_tokens: tuple[str, ...]
    max_token_chars: int
    limits: ServerLimits
    max_prompt_tokens: int

    @classmethod
    def of(cls, state: Any) -> TemplateSettings:
        """The settings of a ``ServerState`` (its API key left out: templating never reads it)."""
        return cls(
            state.tokenizer,
            tuple(state.special_tokens),
            state.max_token_chars,
            replace(state.limits, api_key=None),
            state.request_limits.max_prompt_tokens,
        )


@dataclass
class _RequestLimits:
    max_prompt_tokens: int


@dataclass
class _ChildState:
    # The attributes of ServerState that chat_prompt and what it calls read.
    tokenizer: Any
    special_tokens: tuple[str, ...]
    max_token_chars: int
    limits: ServerLimits
    request_limits: _RequestLimits


@dataclass
class Templated:
    """The child's answer for one body: the parsed JSON (or ``json_error``, ``json.loads``'s message)
    and the templated prompt: token ``ids``, or the ``error`` templating raised, or neither when the
    body did not get as far (this process's own checks then answer it)."""

    obj: Any = None
    json_error: str | None = None
    ids: list[int] | None = None
    error: APIError | None = None

    def loads(self, raw: bytes) -> Any:
        """The parsed body, as ``json.loads`` would give it (for ``translate.parse_json``)."""
        if self.json_error is not None:
            raise ValueError(self.json_error)
        return self.obj

    def prompt(self) -> list[int] | None:
        """The prompt's ids; raises the templating's error; None when not templated."""
        if self.error is not None:
            raise self.error
        return self.ids


def template_body(state: Any, raw: bytes) -> Templated:
    """In the child: ``raw`` parsed, checked as this process would check it, and templated."""
    from cbgen.server.prompts import chat_prompt
    from cbgen.server.schemas import ChatCompletionRequest
    from cbgen.server.translate import parse_json

    try:
        obj = loads_here(raw)
    except (ValueError, RecursionError) as exc:
        return Templated(json_error=str(exc))
    try:
        parse_json(raw, lambda _raw: obj)
        req = ChatCompletionRequest.model_validate(obj)
    except Exception:  # the parent's own checks raise the error, in their order
        return Templated(obj=obj)
    try:
        return Templated(obj=obj, ids=chat_prompt(state, req))
    except APIError as exc:
        return Templated(obj=obj, error=exc)
    except Exception:  # anything else: the parent templates it, and answers as it always did
        return Templated(obj=obj)


def child_handler() -> Any:
    """The child's request handler: the first frame is the pickled :class:`TemplateSettings`."""
    state: _ChildState | None = None

    def handle(raw: bytes) -> Any:
        nonlocal state
        if state is None:
            s = pickle.loads(raw)
            state = _ChildState(
                s.tokenizer,
                s.special_tokens,
                s.max_token_chars,
                s.limits,
                _RequestLimits(s.max_prompt_tokens),
            )
            return "ready"
        return template_body(state, raw)

    return handle


def _program() -> str:
    # This interpreter's import path, so the child finds cbgen wherever this process found it.
    return f"import sys\nsys.path[:0] = {sys.path!r}\n{CHILD_LOOP}\nfrom cbgen.server.template_child import child_handler\nserve(child_handler())\n"


class TemplateChild:
    """One child process templating large chat bodies for this process's threads, one at a time."""

    def __init__(self, state: Any) -> None:
        self._state = state
        self.worker = ChildWorker(lambda: python_argv(_program()), self._greeting)

    def _greeting(self) -> bytes:
        return pickle.dumps(TemplateSettings.of(self._state), protocol=5)

    def template(self, raw: bytes) -> Templated | None:
        """The child's :class:`Templated` for a chat body, or None when no child can answer.  Raises
        :class:`APIError` (400) when the child's answer for this body cannot be passed back."""
        try:
            answer = self.worker.ask(raw)
        except UnserialisableAnswer as exc:
            raise unserialisable_body(exc) from None
        return answer if isinstance(answer, Templated) else None

    def close(self) -> None:
        """Stops the child."""
        self.worker.close()


__all__ = ["TemplateChild", "TemplateSettings", "Templated", "template_body"]
