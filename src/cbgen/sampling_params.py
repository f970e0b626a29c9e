"""Per-request sampling parameters, validated at construction with errors that name the field.

Names and meanings follow vLLM's ``SamplingParams`` so users can switch engines without
renaming anything.  Vocabulary-dependent checks (token ids, ``logit_bias`` keys) need the
model, so the engine runs :meth:`SamplingParams.verify_for_model` when a request is added.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

from cbgen.structured_params import StructuredOutputParams


@dataclass
class SamplingParams:
    """How to sample one request.

    Processing order (the same as ``transformers`` ``generate()``): penalties and logit bias,
    then temperature, top-k, top-p and min-p, each step renormalising over what survived.
    ``temperature == 0`` means greedy decoding.

    Stops, as in vLLM: EOS (unless ``ignore_eos``) and ``stop_token_ids`` end a request on that
    token, whose id stays in the output's ``token_ids`` but whose text is left out of ``text``;
    a ``stop`` string ends it where the text completes it, cut before the string.
    ``include_stop_str_in_output`` keeps the stop token's or string's text.  Before
    ``min_tokens`` tokens were generated nothing stops the request: stop tokens are masked and the
    text of those first tokens cannot complete a stop string.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Per-request arguments for the engine's batch-level logits processors, keyed by processor name.
    logits_processor_args: dict[str, Any] | None = None
    # Constrained output (JSON schema, any JSON object, regex, choice, Lark grammar): a
    # StructuredOutputParams or a dict of its fields, e.g. {"json": schema}.
    structured_output: StructuredOutputParams | dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}: {why} (got {_shown(getattr(self, name))})")

        def integer(name: str, low: int, optional: bool = False) -> None:
            # Integers only: bools, floats and strings are refused, numpy integers normalised.
            value = getattr(self, name)
            if value is None and optional:
                return
            number = _as_int(value)
            if number is None or number < low:
                raise bad(name, f"must be an integer >= {low}" + (" or None" if optional else ""))
            setattr(self, name, number)

        integer("n", 1)
        integer("max_tokens", 1, optional=True)
        integer("min_tokens", 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}")
        if not _is_finite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if self.temperature < _GREEDY_BELOW:
            # Dividing logits by less than this overflows them; the result is the argmax anyway.
            self.temperature = 0.0
        integer("top_k", -1)
        if not _is_finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not _is_finite(self.repetition_penalty) or not 0.01 <= self.repetition_penalty <= 100.0:
            raise bad("repetition_penalty", "must be in [0.01, 100] (1 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_finite(value) or not -2.0 <= value <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        if self.logit_bias is not None:
            self.logit_bias = self._checked_logit_bias(bad)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        tokens = [_as_int(t) for t in self.stop_token_ids]
        if any(t is None or t < 0 for t in tokens):
            raise bad("stop_token_ids", "must be non-negative integers")
        self.stop_token_ids = tokens
        if self.seed is not None and _as_int(self.seed) is None:
            raise bad("seed", "must be an integer or None")
        self.seed = _as_int(self.seed) if self.seed is not None else None
        integer("logprobs", 0, optional=True)
        integer("prompt_logprobs", 0, optional=True)
        if self.logits_processor_args is not None:
            self.logits_processor_args = self._checked_processor_args(bad)
        self.structured_output = StructuredOutputParams.coerce(self.structured_output)

    def _checked_logit_bias(self, bad) -> dict[int, float]:
        if not isinstance(self.logit_bias, dict):
            raise bad("logit_bias", "must be a dict {token_id: bias}")
        fixed: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            token = _token_id_key(key)
            if token is None:
                raise bad(
                    "logit_bias",
                    f"key {_shown(key)} is not a token id (a non-negative integer, or a string of ASCII digits)",
                )
            if token < 0:
                raise bad("logit_bias", f"key {token} is negative")
            # -inf bans the token; NaN and +inf would poison the whole row's distribution.
            if not (_is_finite(value) or value == -math.inf):
                raise bad("logit_bias", f"value for token {token} must be a finite number or -inf")
            fixed[token] = float(value)
        return fixed

    def _checked_processor_args(self, bad) -> dict[str, Any]:
        args = self.logits_processor_args
        if not isinstance(args, dict) or not all(isinstance(k, str) for k in args):
            raise bad("logits_processor_args", "must be a dict {processor name: argument}")
        args = dict(args)  # the caller's dict stays as it was
        if "bad_words" in args:
            args["bad_words"] = _checked_bad_words(args["bad_words"], bad)
        return args

    def verify_for_model(self, vocab_size: int, max_logprobs: int, tokenizer: Any = None) -> None:
        """Checks that need the model: token ids inside the vocabulary, logprob counts within limits.

        Bad words given as strings (vLLM's form) need ``tokenizer``: with one they are replaced
        here by the token-id sequences they stand for (:func:`bad_word_token_ids`); without one
        they are refused, so they never reach the sampler.
        """
        if self.logit_bias:
            for token in self.logit_bias:
                if token >= vocab_size:
                    raise ValueError(
                        f"SamplingParams.logit_bias: token id {token} is outside the vocabulary (size {vocab_size})"
                    )
        for token in self.stop_token_ids or ():
            if token >= vocab_size:
                raise ValueError(
                    f"SamplingParams.stop_token_ids: token id {token} is outside the vocabulary (size {vocab_size})"
                )
        if self.logprobs is not None and self.logprobs > max_logprobs:
            raise ValueError(
                f"SamplingParams.logprobs: {self.logprobs} exceeds the engine maximum max_logprobs={max_logprobs}"
            )
        if self.prompt_logprobs is not None and self.prompt_logprobs > max_logprobs:
            raise ValueError(
                f"SamplingParams.prompt_logprobs: {self.prompt_logprobs} exceeds the engine maximum "
                f"max_logprobs={max_logprobs}"
            )
        self._resolve_bad_words(tokenizer)  # last: nothing changes when a check above fails

    def _resolve_bad_words(self, tokenizer: Any) -> None:
        words = (self.logits_processor_args or {}).get("bad_words")
        if not words or not any(isinstance(w, str) for w in words):
            return
        if tokenizer is None:
            raise ValueError(
                "SamplingParams.logits_processor_args['bad_words']: words given as strings need a "
                "tokenizer when the request is validated, and none was given; pass token-id "
                "sequences instead, e.g. [tokenizer.encode(' mat', add_special_tokens=False)]"
            )
        resolved: list[list[int]] = []
        for word in words:
            for seq in bad_word_token_ids(word, tokenizer) if isinstance(word, str) else [word]:
                if seq not in resolved:
                    resolved.append(seq)
        # A new dict: a dict the caller may share between requests is not edited.
        self.logits_processor_args = {**self.logits_processor_args, "bad_words": resolved}

    # ------------------------------------------------------------------ helpers
    @property
    def greedy(self) -> bool:
        """True when the request decodes greedily (temperature 0)."""
        return self.temperature == 0.0


# Temperatures below this are treated as greedy (as vLLM does): logits / 1e-320 overflow to inf.
_GREEDY_BELOW = 1e-5


def bad_word_token_ids(word: str, tokenizer: Any) -> list[list[int]]:
    """The token-id sequences that spell ``word`` for the ``bad_words`` processor, vLLM's way.

    A word is banned both at the start of the text and after a space: byte-level BPE and
    SentencePiece tokenizers spell ``"mat"`` and ``" mat"`` with different tokens.  So the word
    (leading whitespace removed) is tokenised bare and with one leading space; each distinct
    non-empty result is one sequence.
    """
    bare = word.lstrip()
    found: list[list[int]] = []
    for text in (bare, " " + bare):
        ids = [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
        if ids and ids not in found:
            found.append(ids)
    if not found:
        raise ValueError(f"SamplingParams.logits_processor_args['bad_words']: {_shown(word)} has no tokens")
    return found


def _checked_bad_words(value: Any, bad) -> list[str | list[int]]:
    """``bad_words`` as a list whose entries are non-empty strings or non-empty token-id lists."""
    where = "logits_processor_args"
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise bad(where, "'bad_words' must be a list of words (strings or token-id lists)")
    out: list[str | list[int]] = []
    for entry in value:
        if isinstance(entry, str):
            if not entry.strip():
                raise bad(where, "'bad_words' strings must not be empty or only whitespace")
            out.append(entry)
            continue
        ids = [_as_int(t) for t in entry] if isinstance(entry, (list, tuple)) else None
        if not ids or any(t is None or t < 0 for t in ids):
            raise bad(
                where,
                f"'bad_words' entry {_shown(entry)} must be a non-empty string or a non-empty list "
                "of non-negative token ids",
            )
        out.append(ids)
    return out


# Longer digit strings are no token id of any vocabulary (and int() refuses past 4300 digits).
_MAX_ID_DIGITS = 18


def _token_id_key(key: Any) -> int | None:
    """A ``logit_bias`` key as a token id: an integer, or a string of ASCII digits (JSON object
    keys are strings, e.g. ``"50256"``).  ``str.isdecimal`` alone would take other scripts'
    digits, e.g. Arabic-Indic ``"١٢"`` as 12."""
    if isinstance(key, str):
        if key.isascii() and key.isdecimal() and len(key) <= _MAX_ID_DIGITS:
            return int(key)
        return None
    return _as_int(key)


# Error messages quote user values: bounded, and ASCII-safe (a lone surrogate from a JSON body
# could not be encoded into the HTTP response).
_SHOWN_CHARS = 80


def _shown(value: Any) -> str:
    """``repr(value)`` for an error message: at most ``_SHOWN_CHARS`` characters, ASCII only."""
    try:
        text = ascii(value)
    except Exception:  # a hostile __repr__ must not turn a 400 into a 500
        text = f"<{type(value).__name__}>"
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def _is_finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _as_int(value: Any) -> int | None:
    """``value`` as a Python int if it is an integer (numpy integers too), else None; bools are not."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None
