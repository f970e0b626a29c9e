"""Per-request limits, worked out in one place: the default ``max_tokens``, a request's work, the KV fit.

The engine, the async front end and the server each need these numbers (the engine to queue a
request, the front end to admit it, the server to refuse it with a 400 before either sees it); if
each layer computed them on its own they would drift apart.  Everything here is arithmetic over three
facts fixed when the engine starts (the context length, the block size, the number of KV blocks), so
it is torch-free and safe to call from any thread.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RequestLimits", "request_work"]


def request_work(n: int, num_prompt_tokens: int, max_tokens: int) -> int:
    """A request's work: the token slots its ``n`` sequences may come to hold, n x (prompt + max_tokens)."""
    return n * (num_prompt_tokens + max_tokens)


@dataclass(frozen=True)
class RequestLimits:
    """The limits one engine puts on a request: ``max_model_len`` tokens of context, and a KV cache of
    ``num_blocks`` blocks of ``block_size`` tokens."""

    max_model_len: int
    block_size: int
    num_blocks: int

    @property
    def kv_tokens(self) -> int:
        """Tokens the whole KV cache holds."""
        return self.num_blocks * self.block_size

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt: one token short of the context, so that one can be generated."""
        return self.max_model_len - 1

    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def fits_kv(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` tokens of one sequence fit the cache at all (with nothing else in it)."""
        return self.blocks_for(num_tokens) <= self.num_blocks

    def context_room(self, num_prompt_tokens: int) -> int:
        """Tokens the context leaves for generation after the prompt."""
        return self.max_model_len - num_prompt_tokens

    def default_max_tokens(
        self, num_prompt_tokens: int, default: int | None = None, cap: int | None = None
    ) -> int:
        """The ``max_tokens`` of a request that names none: ``default`` (None: unbounded), within what
        the context and the KV cache leave after the prompt and ``cap``, and at least 1.

        An unspecified length must never turn into an error, so it also stays within the cache: a
        sequence longer than the cache could only end failed."""
        value = min(self.context_room(num_prompt_tokens), self.kv_tokens - num_prompt_tokens)
        for bound in (default, cap):
            if bound is not None:
                value = min(value, bound)
        return max(value, 1)

    def max_tokens_of(self, num_prompt_tokens: int, requested: int | None) -> int:
        """The ``max_tokens`` a request runs with: :meth:`default_max_tokens` when it names none,
        else what it names, capped at the context's room (generation stops at the context's end)."""
        if requested is None:
            return self.default_max_tokens(num_prompt_tokens)
        return min(requested, self.context_room(num_prompt_tokens))

    def work(self, n: int, num_prompt_tokens: int, requested_max_tokens: int | None) -> int:
        """:func:`request_work` of a request as the engine will run it (see :meth:`max_tokens_of`)."""
        return request_work(n, num_prompt_tokens, self.max_tokens_of(num_prompt_tokens, requested_max_tokens))

    def max_work(self, n: int) -> int:
        """The most work a request of ``n`` sequences can hold: each fills the context."""
        return n * self.max_model_len

    def check_prompt(self, num_prompt_tokens: int) -> None:
        """Raises ``ValueError`` unless a prompt this long leaves room to generate a token and its K/V
        fits the cache (the first sampled token's K/V is only needed if a second one follows)."""
        if num_prompt_tokens > self.max_prompt_tokens:
            raise ValueError(
                f"prompt has {num_prompt_tokens} tokens, longer than the model's context of "
                f"{self.max_model_len} tokens (at least one token must be generated)"
            )
        need = self.blocks_for(num_prompt_tokens)
        if need > self.num_blocks:
            raise ValueError(
                f"prompt needs {need} KV blocks but the cache has only {self.num_blocks}; "
                "raise num_blocks or kv_cache_memory"
            )
