"""Chat templating where every field the template renders is data: only the template's own control
tokens become control tokens.

The threat: a chat template places client strings (message text, ``name`` and ``tool_call_id``,
tool call names and arguments, tool descriptions and parameter schemas, their keys included) into a
text that is then tokenised with special-token text parsed.  A string holding ``<|im_end|>`` would
end its turn and could open a forged one (``<|im_start|>system ...``).  ``tojson`` does not escape
``<``, so JSON-rendered fields are as open as plain ones.

Two ways out were considered:

* Mark the fields: render each with a placeholder, find the placeholders in the output and tokenise
  the fields' text literally there.  This needs every field to come out verbatim and exactly once,
  which templates do not promise: ``tojson`` re-escapes strings (a placeholder stands for text whose
  rendered form is unknown), schemas are rendered whole, a field may be trimmed, tested, repeated
  or dropped, and dict keys (property names) cannot be swapped for placeholders without changing
  what the template looks up.  It also costs a search of the output per field.
* Defuse the data (done here): before rendering, every string in the conversation and the tools,
  keys and values at any depth, has each occurrence of control-token text broken by an escape
  character inserted between its characters.  No client string then contains control-token text,
  whatever the template does with it (``tojson``, ``trim``, repeats, any filter that keeps
  characters), so every intact control token in the rendered text was written by the template (as
  a literal, a ``bos_token`` variable, or a concatenation such as Phi-3's ``'<|' + role + '|>'``).
  The rendered text is split at those tokens, which become their ids; the text between them has the
  escapes removed and is tokenised with special-token text read as plain text.  One pass over the
  data, one render, one pass over the output: linear in the size of the request.

The escape character (a private-use character the template does not contain) is itself doubled in
client strings, so removing "escape + next character -> next character" restores every string
exactly.  Strings without control-token text or the escape are passed unchanged, so templates see
ordinary requests exactly as sent, and such requests are tokenised in one call as before.

What is not covered: a control token assembled across the edge of a field, from the end of a client
string and the template text (or the next field) right after it.  Templates put fixed text or a
control token of their own around every field, and no control token begins with the end of another,
so real templates give no such edge; a template that slices strings or replaces text inside them
could.  A template that looks for control-token text in client strings (``content.startswith(...)``)
no longer finds it there: by design, client text is never control-token text.  Control tokens one
character long cannot be broken by insertion and are not defused.
Added tokens that are not special (Qwen's ``<tool_call>``) are vocabulary, not control tokens: they
tokenise the same in client text as the model would write them.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

# Private-use characters: no tokenizer gives them meaning and clients rarely send them.
_ESCAPE_CANDIDATES = [chr(c) for c in range(0xE000, 0xE100)]


class ControlTokens:
    """A tokenizer's control tokens: how to defuse their text in client data, find the template's own
    in rendered text, and tokenise the rest as plain text.  Thread-safe (nothing changes after
    construction); get one with :func:`control_tokens`."""

    def __init__(self, tokenizer: Any, texts: Iterable[str]) -> None:
        texts = tuple(texts)
        self.tokenizer = tokenizer
        self.key = (texts, getattr(tokenizer, "chat_template", None))  # what it was built from
        template = str(getattr(tokenizer, "chat_template", "") or "")
        self.escape = next(c for c in _ESCAPE_CANDIDATES if c not in template)
        self.ids = _control_ids(tokenizer, texts)
        self.id_set = frozenset(self.ids.values())
        breakable = sorted({t for t in texts if len(t) > 1}, key=len, reverse=True)
        # Longest first: at one position the longest text wins, as the tokenizer matches them.
        self._find = re.compile("|".join(map(re.escape, breakable))) if breakable else None
        self._split = _split_pattern(tokenizer, self.ids)
        self._unescape = re.compile(re.escape(self.escape) + "(.)", re.DOTALL)
        self._literal = _literal_tokenizer(tokenizer)

    # ------------------------------------------------------------------ client data
    def defuse(self, value: Any) -> tuple[Any, bool]:
        """``value`` (JSON-like: dicts, lists, strings, scalars) with control-token text broken in every
        string, keys included; and whether anything changed.  Unchanged parts are returned as they are
        (nothing is copied or mutated)."""
        changed = False

        def walk(v: Any) -> Any:
            nonlocal changed
            if isinstance(v, str):
                out = self._defuse_str(v)
                changed = changed or out is not v
                return out
            if isinstance(v, dict):
                items = [(walk(k), walk(x)) for k, x in v.items()]
                same = all(k is k0 and x is x0 for (k, x), (k0, x0) in zip(items, v.items()))
                return v if same else dict(items)
            if isinstance(v, (list, tuple)):
                out_list = [walk(x) for x in v]
                return v if all(a is b for a, b in zip(out_list, v)) else type(v)(out_list)
            return v

        return walk(value), changed

    def _defuse_str(self, s: str) -> str:
        esc = self.escape
        if esc in s:
            s = s.replace(esc, esc + esc)
        if self._find is None:
            return s
        # Each pass puts an escape between every two characters of each match; a pass can only
        # leave text that overlapped a match (never with real token sets), and each pass removes
        # adjacent unescaped pairs, so this ends.
        while self._find.search(s) is not None:
            s = self._find.sub(lambda m: esc.join(m.group()), s)
        return s

    def restore(self, text: str) -> str:
        """Rendered text with the escapes of :meth:`defuse` removed."""
        return self._unescape.sub(r"\1", text) if self.escape in text else text

    # ------------------------------------------------------------------ rendered text
    def pieces(self, rendered: str) -> Iterator[str | int]:
        """The rendered text in order: the template's control tokens as ids, the text between them as
        restored strings (possibly empty)."""
        if self._split is None:
            yield self.restore(rendered)
            return
        pos = 0
        for m in self._split.finditer(rendered):
            yield self.restore(rendered[pos : m.start()])
            yield self._id_of(m.group())
            pos = m.end()
        yield self.restore(rendered[pos:])

    def _id_of(self, matched: str) -> int:
        found = self.ids.get(matched)
        return found if found is not None else self.ids[matched.strip()]  # stripped whitespace

    def encode_literal(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text with special-token text read as plain text (no control token)."""
        if self._literal is not None:
            return [e.ids for e in self._literal.encode_batch(texts, add_special_tokens=False)]
        return [
            list(self.tokenizer.encode(t, add_special_tokens=False, split_special_tokens=True)) for t in texts
        ]

    def safe_cut(self, text: str, cut: int) -> int:
        """``cut``, moved back to the start of a control token that would straddle it (a half token
        read as text would count several tokens)."""
        if self._split is None or cut >= len(text):
            return cut
        reach = max(map(len, self.ids)) + 64  # + stripped whitespace
        for m in self._split.finditer(text, max(0, cut - reach), min(len(text), cut + reach)):
            if m.start() < cut < m.end():
                return m.start()
        return cut


def _control_ids(tokenizer: Any, texts: Iterable[str]) -> dict[str, int]:
    """The texts the tokenizer reads as one token, with its id (others are not control tokens)."""
    out = {}
    for text in texts:
        if not text:
            continue
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        if len(ids) == 1:
            out[text] = int(ids[0])
    return out


def _split_pattern(tokenizer: Any, ids: dict[str, int]) -> re.Pattern[str] | None:
    """A regex of the control tokens as the tokenizer matches them: longest first, absorbing the
    whitespace an ``lstrip`` / ``rstrip`` token takes, and a ``single_word`` one only between non-word
    characters."""
    if not ids:
        return None
    flags = {str(t.content): t for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()}
    alts = []
    for text in sorted(ids, key=len, reverse=True):
        t = flags.get(text)
        core = re.escape(text)
        if t is not None and getattr(t, "single_word", False):
            core = rf"(?<!\w){core}(?!\w)"
        left = r"\s*" if t is not None and getattr(t, "lstrip", False) else ""
        right = r"\s*" if t is not None and getattr(t, "rstrip", False) else ""
        alts.append(left + core + right)
    return re.compile("|".join(alts))


def _literal_tokenizer(tokenizer: Any) -> Any:
    """A private copy of a fast tokenizer's backend that always reads special-token text as plain text.

    A copy, because ``split_special_tokens=True`` flips a flag on the shared backend before each
    encode: another thread's encode in between would parse this one's text as control tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(backend.to_str())
    copy.encode_special_tokens = True
    copy.no_truncation()
    copy.no_padding()
    return copy


_CACHE: weakref.WeakKeyDictionary[Any, ControlTokens] = weakref.WeakKeyDictionary()
_CACHE_LOCK = threading.Lock()


def control_tokens(tokenizer: Any, texts: Iterable[str]) -> ControlTokens:
    """The :class:`ControlTokens` of ``tokenizer`` with the special-token ``texts``, built once per
    tokenizer (and chat template)."""
    texts = tuple(texts)
    with _CACHE_LOCK:
        found = _CACHE.get(tokenizer)
    if found is not None and found.key == (texts, getattr(tokenizer, "chat_template", None)):
        return found
    built = ControlTokens(tokenizer, texts)  # outside the lock: two threads may both build one
    with _CACHE_LOCK:
        _CACHE[tokenizer] = built
    return built


__all__ = ["ControlTokens", "control_tokens"]
