"""Per-request sampling parameters, validated at construction with errors that name the field.

Names and meanings follow vLLM's ``SamplingParams`` so users can switch engines without
renaming anything.  Vocabulary-dependent checks (token ids, ``logit_bias`` keys) need the
model, so the engine runs :meth:`SamplingParams.verify_for_model` when a request is added.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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

        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1 or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}")
        if not _is_number(self.temperature) or self.temperature < 0 or self.temperature != self.temperature:
            raise bad("temperature", "must be a number >= 0 (0 means greedy)")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise bad("top_k", "must be -1 or 0 (disabled) or a positive integer")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0 (1 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must be a dict {token_id: bias}")
            fixed: dict[int, float] = {}
            for key, value in self.logit_bias.items():
                try:
                    token = int(key)
                except (TypeError, ValueError):
                    raise bad("logit_bias", f"key {key!r} is not a token id") from None
                if token < 0:
                    raise bad("logit_bias", f"key {token} is negative")
                if not _is_number(value):
                    raise bad("logit_bias", f"value for token {token} is not a number")
                fixed[token] = float(value)
            self.logit_bias = fixed
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer or None")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", "must be an integer >= 0 or None")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0
        ):
            raise bad("prompt_logprobs", "must be an integer >= 0 or None")

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

    @property
    def all_stop_token_ids(self) -> set[int]:
        """Stop token ids set by the user (EOS is added by the engine unless ``ignore_eos``)."""
        return set(self.stop_token_ids or ())


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
