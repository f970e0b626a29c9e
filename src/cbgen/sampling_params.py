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
            return ValueError(f"SamplingParams.{name}: {why} (got {getattr(self, name)!r})")

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
        self.structured_output = StructuredOutputParams.coerce(self.structured_output)

    def _checked_logit_bias(self, bad) -> dict[int, float]:
        if not isinstance(self.logit_bias, dict):
            raise bad("logit_bias", "must be a dict {token_id: bias}")
        fixed: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            # JSON object keys are strings ("50256"), so decimal strings are token ids too.
            token = int(key) if isinstance(key, str) and key.isdecimal() else _as_int(key)
            if token is None:
                raise bad("logit_bias", f"key {key!r} is not an integer token id")
            if token < 0:
                raise bad("logit_bias", f"key {token} is negative")
            # -inf bans the token; NaN and +inf would poison the whole row's distribution.
            if not (_is_finite(value) or value == -math.inf):
                raise bad("logit_bias", f"value for token {token} must be a finite number or -inf")
            fixed[token] = float(value)
        return fixed

    def verify_for_model(self, vocab_size: int, max_logprobs: int) -> None:
        """Checks that need the model: token ids inside the vocabulary, logprob counts within limits."""
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

    # ------------------------------------------------------------------ helpers
    @property
    def greedy(self) -> bool:
        """True when the request decodes greedily (temperature 0)."""
        return self.temperature == 0.0


# Temperatures below this are treated as greedy (as vLLM does): logits / 1e-320 overflow to inf.
_GREEDY_BELOW = 1e-5


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
