"""Incremental detokenisation and stop-string matching for streamed generation.

Decoding token by token is wrong in two ways: a character can span several byte-level tokens
(decoding a prefix of it yields U+FFFD), and SentencePiece-style decoders drop the leading space
of the first token they see.  :class:`IncrementalDetokenizer` therefore decodes a small window
that starts a few tokens back (the left context), and emits only the part of the window's text
beyond what the context alone decodes to, once it no longer ends in an incomplete character.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text, one stable delta at a time.

    ``prompt_token_ids`` supplies left context for the first output tokens (so a leading space of
    the first generated word survives with SentencePiece tokenizers).  ``add_tokens`` returns only
    text that can no longer change; :meth:`flush` returns whatever is still withheld (an
    incomplete multi-byte character at the very end) and should be called when the sequence ends.
    Across all ``add_tokens`` deltas plus ``flush()``, the text equals
    ``tokenizer.decode(output_ids, skip_special_tokens=...)`` for byte-level BPE tokenizers.
    """

    # A handful of tokens is enough context for every decoder we know of (leading-space rules look
    # at one token; byte-level characters span at most four).
    CONTEXT_TOKENS = 5

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = list(prompt_token_ids[-self.CONTEXT_TOKENS :])
        # A prompt cut inside a multi-byte character would glue its bytes to the output's; start
        # without context then, so the output decodes on its own.
        if context and self._decode(context).endswith(_REPLACEMENT):
            context = []
        # _ids[0:_read] is context already accounted for; _ids[_read:] is not yet emitted.
        self._ids: list[int] = context
        self._read = len(context)
        self._context_text = self._decode(context) if context else ""
        self._text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=self._skip_special)

    @property
    def text(self) -> str:
        """All stable output text so far."""
        return self._text

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Appends output tokens; returns the newly stable text (possibly empty)."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        window = self._decode(self._ids)
        if window == self._context_text:
            # The new tokens add no text (e.g. skipped special tokens): drop them so the window
            # does not grow while nothing is emitted.
            del self._ids[self._read :]
            return ""
        if window.endswith(_REPLACEMENT) or len(window) <= len(self._context_text):
            return ""
        delta = window[len(self._context_text) :]
        self._text += delta
        # The tokens just emitted become the next context; older ones can go.
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        self._context_text = self._decode(self._ids)
        if len(self._ids) > self.CONTEXT_TOKENS:
            self._trim()
        return delta

    def _trim(self) -> None:
        # Keep the last few emitted tokens as context, unless cutting there would split a character.
        tail = self._ids[-self.CONTEXT_TOKENS :]
        tail_text = self._decode(tail)
        if tail_text.endswith(_REPLACEMENT) or not self._context_text.endswith(tail_text):
            return
        self._ids = tail
        self._read = len(tail)
        self._context_text = tail_text

    def flush(self) -> str:
        """Returns (and adds to :attr:`text`) any withheld text, e.g. a trailing incomplete character.

        Call it when the sequence ends.  Tokens added afterwards are decoded without context, so
        text already returned never changes.
        """
        window = self._decode(self._ids)
        delta = window[len(self._context_text) :] if len(window) > len(self._context_text) else ""
        self._text += delta
        self._ids = []
        self._read = 0
        self._context_text = ""
        return delta


class StopStringMatcher:
    """Finds the first stop string completed by newly added text.

    When several stop strings are completed by the same chunk of text, the one that ends first
    wins (what a character-by-character stream would have hit first); among those, the one that
    starts first.  The cut position excludes the stop string unless ``include_stop_str_in_output``.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool) -> None:
        self._stop = [s for s in stop if s]
        self._include = include_stop_str_in_output
        self._max_len = max((len(s) for s in self._stop), default=0)

    @property
    def holdback(self) -> int:
        """Characters to withhold from a streamed delta: they could be the start of a stop string."""
        return max(self._max_len - 1, 0)

    def check(self, text: str, new_text_len: int) -> tuple[str | None, int | None]:
        """Looks for a stop string that ends in the last ``new_text_len`` characters of ``text``.

        Returns ``(stop string, cut position)``, or ``(None, None)``; the output text is ``text[:cut]``.
        """
        if not self._stop or new_text_len <= 0:
            return None, None
        new_start = max(len(text) - new_text_len, 0)
        best: tuple[int, int, str] | None = None
        for s in self._stop:
            idx = text.find(s, max(new_start - len(s) + 1, 0))
            if idx < 0:
                continue
            key = (idx + len(s), idx, s)
            if best is None or key[:2] < best[:2]:
                best = key
        if best is None:
            return None, None
        end, start, s = best
        return s, end if self._include else start


__all__ = ["IncrementalDetokenizer", "StopStringMatcher"]
