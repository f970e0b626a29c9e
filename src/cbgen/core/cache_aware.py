"""Cache-aware admission: a prompt does not compute, in the same step, a block another request
completes in that step.

Admitted together, prompts that share a prefix would each compute the shared blocks: the prefix
cache only serves blocks published after the step that computed them.  So a waiting prompt that has
computed nothing and whose next block past its cached prefix is one a request scheduled in this step
completes waits one step, and then finds that block cached (64 chat prompts sharing system prompts:
prefix hits 96 -> 4,976 of 6,810 tokens).  It only ever waits for a block that a step in progress
computes, so with nothing else scheduled it is never held back, and once that step publishes the
block the prompt's next uncached block lies further on: the wait is bounded by the other request's
progress through the shared blocks.  If the block is not published after all (its request was
preempted or failed), the prompt computes it itself the step after, unless another request computes
it in that step.

Not to be confused with :mod:`cbgen.core.admission`, which bounds the requests and token slots the
front end lets in; this decides, within one step, which waiting prompts the scheduler admits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cbgen.request import Request

if TYPE_CHECKING:
    from cbgen.core.cache_pools import CachePools


class ComputingBlocks:
    """The prefix hashes of the full blocks this step completes, grown as prompts are admitted."""

    def __init__(self, block_manager: CachePools, scheduled: list[tuple[Request, int]]) -> None:
        self._bm = block_manager
        self._scheduled = scheduled
        # Hashed on first use only: every running row's hashes on every decode step cost ~0.1 ms,
        # and most steps have nothing waiting.
        self._hashes: set[int] | None = None

    def _computing(self) -> set[int]:
        if self._hashes is None:
            bm = self._bm
            self._hashes = {h for r, n in self._scheduled for h in bm.completed_hashes(r, n)}
        return self._hashes

    def holds_back(self, request: Request, num_cached_blocks: int) -> bool:
        """Whether the waiting ``request`` should wait one step: it has computed nothing and its
        first block past its ``num_cached_blocks`` cached ones is one this step completes.  Call it
        after :meth:`CachePools.match_prefix`, which hashes the blocks it looked at."""
        if request.num_computed_tokens:
            return False
        computing = self._computing()
        return bool(computing) and next_block_hash(request, num_cached_blocks) in computing

    def add(self, request: Request, num_new_tokens: int) -> None:
        """Records the blocks an admitted request completes with its first ``num_new_tokens``."""
        self._computing().update(self._bm.completed_hashes(request, num_new_tokens))


def next_block_hash(request: Request, num_cached_blocks: int) -> int | None:
    """The prefix hash of the request's first block past its cached prefix (None: not a full block,
    or not hashed because the prefix cache does not serve this request)."""
    hashes = request.block_hashes
    return hashes[num_cached_blocks] if num_cached_blocks < len(hashes) else None
