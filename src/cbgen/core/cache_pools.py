"""Every cache group's block pool and the state slots, allocated together for a request.

A model's cache is one or more *groups* (resolved by the execution plan from the model,
:mod:`cbgen.model.cache_groups`): a group of layers whose keys and values share a shape is one
block pool (:class:`~cbgen.core.block_manager.BlockManager`, each with its own block size), and
layers that keep a fixed-size state per sequence take one slot each from a
:class:`~cbgen.core.slots.SlotPool`.  Today's supported models have exactly one KV group and no
state; then every call here is the single pool's.

Allocation is all or nothing: a request gets blocks in every group and its slot, or nothing changes.
A prefix-cache hit covers the same tokens in every group (the longest run all groups hold, in
whole blocks of each), and the partial-block hit is the single-group case only.  With state slots,
a hit must also end where a state checkpoint was filed (:mod:`cbgen.core.checkpoints`), and the
request's state starts as a copy of it; without checkpoints such models are not served from the
prefix cache.

Pure Python, like the rest of ``core/``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from cbgen.core.block_manager import BlockManager
from cbgen.core.checkpoints import Checkpoints
from cbgen.core.slots import SlotPool
from cbgen.request import Request


class BlockCopy(NamedTuple):
    """A device-side copy the runner performs before the next forward: block ``src`` to ``dst`` of
    cache group ``group`` (copy-on-fork, partial prefix hits)."""

    src: int
    dst: int
    group: int = 0


class StateCopy(NamedTuple):
    """A device-side copy of one sequence's state, slot ``src`` to ``dst`` (copy-on-fork, a
    checkpoint filed or served)."""

    src: int
    dst: int


@dataclass
class PrefixHit:
    """Cached blocks per group covering the request's first ``tokens`` tokens, the partial block
    to copy after them (single-group pools only), and the checkpoint slot holding the state at
    ``tokens`` (models with state layers)."""

    blocks: list[list[int]] = field(default_factory=list)
    tokens: int = 0
    partial: tuple[int, int] | None = None
    state: int | None = None

    @property
    def num_blocks(self) -> int:
        """Group 0's cached blocks."""
        return len(self.blocks[0]) if self.blocks else 0


@dataclass
class ForkCopies:
    """What a fork asks the device to copy: blocks, and the parent's state slot into the child's."""

    blocks: list[BlockCopy] = field(default_factory=list)
    state: tuple[int, int] | None = None


class CachePools:
    """The block pools of the cache groups (group ``i`` is ``pools[i]``) and the state slots."""

    def __init__(
        self,
        pools: Sequence[BlockManager],
        slots: SlotPool | None = None,
        checkpoints: Checkpoints | None = None,
    ) -> None:
        if not pools:
            raise ValueError("a cache needs at least one block pool")
        for i, pool in enumerate(pools):
            if pool.group != i:
                raise ValueError(f"pool {i} keeps block table {pool.group}")
        self.pools = list(pools)
        self.slots = slots
        self.checkpoints = checkpoints if slots is not None else None
        self.stats = pools[0].stats
        self._single = len(pools) == 1 and slots is None
        # The one pool of a single-group cache: the calls made per request and step go straight to it.
        self._only = self.pools[0] if self._single else None
        # Prefix hits cover whole blocks of every group: a multiple of every block size.
        self._hit_unit = math.lcm(*(p.block_size for p in pools))

    # ------------------------------------------------------------------ sizes
    @property
    def block_size(self) -> int:
        """The smallest block size of the groups (a step that crosses one of its boundaries may have
        completed a block of any group)."""
        return min(p.block_size for p in self.pools)

    @property
    def blocks(self) -> list:
        """Group 0's blocks (their refcounts and hashes, for tests and gauges)."""
        return self.pools[0].blocks

    @property
    def num_blocks(self) -> int:
        """Group 0's pool size."""
        return self.pools[0].num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Group 0's free blocks."""
        return self.pools[0].num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Group 0's held blocks."""
        return self.pools[0].num_used_blocks

    @property
    def usage(self) -> float:
        """The fullest group's (or the state slots') fraction in use."""
        used = max(p.usage for p in self.pools)
        if self.slots is not None:
            used = max(used, 1 - self.slots.num_free / self.slots.num_slots)
        return used

    @property
    def enable_prefix_caching(self) -> bool:
        """Whether requests can be served from the prefix cache (with state slots: from checkpoints)."""
        return (self.slots is None or self.checkpoints is not None) and all(
            p.enable_prefix_caching for p in self.pools
        )

    def fits(self, num_tokens: int) -> bool:
        """Whether one request of ``num_tokens`` tokens fits in an empty cache."""
        only = self._only
        if only is not None:
            return only.blocks_needed(num_tokens) <= only.num_blocks
        return all(p.blocks_needed(num_tokens) <= p.num_blocks for p in self.pools)

    def describe_need(self, num_tokens: int) -> str:
        """What ``num_tokens`` tokens need against what the cache has, in words."""
        parts = []
        for p in self.pools:
            if p.blocks_needed(num_tokens) > p.num_blocks:
                parts.append(
                    f"{p.blocks_needed(num_tokens)} KV blocks of {p.block_size} tokens but the cache has only "
                    f"{p.num_blocks}" + (f" in group {p.group}" if len(self.pools) > 1 else "")
                )
        return "; ".join(parts) or f"{num_tokens} tokens, which fit"

    # ------------------------------------------------------------------ prefix cache
    def match_prefix(self, request: Request) -> PrefixHit:
        """The cached prefix every group holds for ``request`` (see the module docstring)."""
        if self._single:
            blocks = self.pools[0].match_prefix(request)
            return PrefixHit([blocks], len(blocks) * self.pools[0].block_size)
        if not self.enable_prefix_caching:
            return PrefixHit([[] for _ in self.pools], 0)
        self._size_tables(request)
        hits = [p.match_prefix(request) for p in self.pools]
        tokens = min(len(h) * p.block_size for h, p in zip(hits, self.pools, strict=True))
        tokens -= tokens % self._hit_unit
        state = None
        if self.checkpoints is not None:
            first = self.pools[0]
            tokens, state = self.checkpoints.find(request.hash_tables[first.group], first.block_size, tokens)
        blocks = [h[: tokens // p.block_size] for h, p in zip(hits, self.pools, strict=True)]
        return PrefixHit(blocks, tokens, state=state)

    def match_partial(self, request: Request, hit: PrefixHit) -> PrefixHit:
        """``hit`` with the partial block after it, where one matches (single-group pools only)."""
        if self._single:
            hit.partial = self.pools[0].match_partial(request, hit.num_blocks)
        return hit

    def completed_hashes(self, request: Request, num_new_tokens: int) -> list[int]:
        """Group 0's prefix hashes of the full blocks ``num_new_tokens`` more tokens complete."""
        if not self.enable_prefix_caching:
            return []
        return self.pools[0].completed_hashes(request, num_new_tokens)

    def cache_computed_blocks(self, request: Request) -> None:
        """Publishes the request's full, computed blocks in every group."""
        if not self.enable_prefix_caching:
            return
        self._size_tables(request)
        for p in self.pools:
            p.cache_computed_blocks(request)

    def reset_prefix_cache(self) -> None:
        """Forgets every published hash in every group (counted once)."""
        for p in self.pools:
            p.forget_published()
        if self.checkpoints is not None:
            self.checkpoints.forget()
        self.stats.prefix_cache_resets += 1

    def checkpoint(self, request: Request, num_new_tokens: int) -> StateCopy | None:
        """The copy that files ``request``'s state as a checkpoint after this step, when its
        ``num_new_tokens`` scheduled tokens end a prompt chunk on the checkpoint grid (see
        :mod:`cbgen.core.checkpoints`); called once the tokens are allocated."""
        ckpt = self.checkpoints
        if ckpt is None or not self.enable_prefix_caching:
            return None
        end = request.num_computed_tokens + num_new_tokens
        if end % ckpt.grid or end > request.num_prompt_tokens or num_new_tokens < 1:
            return None
        first = self.pools[0]
        hashes = first.completed_hashes(request, num_new_tokens)
        if not hashes:
            return None
        slot = ckpt.file(hashes[-1])
        return None if slot is None else StateCopy(request.state_slot, slot)

    # ------------------------------------------------------------------ allocation
    def _size_tables(self, request: Request) -> None:
        while len(request.block_tables) < len(self.pools):
            request.block_tables.append([])
        while len(request.hash_tables) < len(self.pools):
            request.hash_tables.append([])

    def allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Blocks in every group for ``num_computed_tokens + num_new_tokens`` tokens, and a state slot
        if the request has none; ``hit`` (first schedule only) is taken as the computed prefix.
        Returns False, changing nothing, when a pool or the slots are short."""
        only = self._only
        if only is not None:
            if hit is None:
                return only.allocate(request, num_new_tokens)
            return only.allocate(request, num_new_tokens, hit.blocks[0], hit.partial)
        self._size_tables(request)
        cached = hit.blocks if hit is not None else [()] * len(self.pools)
        computed = request.num_computed_tokens + (hit.tokens if hit is not None else 0)
        total = computed + num_new_tokens
        if not all(p.can_reserve(request, total, c) for p, c in zip(self.pools, cached, strict=True)):
            return False
        need_slot = self.slots is not None and request.state_slot is None
        if need_slot and self.slots.num_free == 0:
            return False
        for p, c in zip(self.pools, cached, strict=True):
            p.reserve(request, total, c)
        request.num_computed_tokens = computed
        if need_slot:
            request.state_slot = self.slots.take()
        return True

    def free(self, request: Request) -> None:
        """Releases the request's blocks in every group and its state slot."""
        for p in self.pools:
            if p.group < len(request.block_tables):
                p.free(request)
        if request.state_slot is not None:
            self.slots.give(request.state_slot)
            request.state_slot = None

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Frees the request's blocks past its first ``num_tokens`` tokens, in every group."""
        self._size_tables(request)
        for p in self.pools:
            p.truncate(request, num_tokens)

    def fork(self, parent: Request, child: Request, num_tokens: int | None = None) -> ForkCopies:
        """``child`` shares ``parent``'s first ``num_tokens`` computed tokens in every group (see
        :meth:`BlockManager.fork`) and gets a state slot of its own, a copy of the parent's.  Raises
        ``MemoryError``, changing nothing, when a copy or the slot cannot be had."""
        copies = ForkCopies()
        if self._single:
            pair = self.pools[0].fork(parent, child, num_tokens)
            if pair is not None:
                copies.blocks.append(BlockCopy(*pair))
            return copies
        self._size_tables(parent)
        self._size_tables(child)
        if self.slots is not None and self.slots.num_free == 0:
            raise MemoryError("no free state slot for the fork")
        try:
            for p in self.pools:
                pair = p.fork(parent, child, num_tokens)
                if pair is not None:
                    copies.blocks.append(BlockCopy(pair[0], pair[1], p.group))
        except MemoryError:
            for p in self.pools:
                p.free(child)
            child.num_computed_tokens = 0
            raise
        if self.slots is not None:
            child.state_slot = self.slots.take()
            copies.state = (parent.state_slot, child.state_slot)
        return copies

    def check_invariants(self, requests: Sequence[Request]) -> None:
        """Asserts every pool's refcounts and the slots against the live ``requests`` (tests)."""
        for p in self.pools:
            p.check_invariants([r.block_tables[p.group] for r in requests if p.group < len(r.block_tables)])
        if self.slots is not None:
            self.slots.check_invariants([r.state_slot for r in requests if r.state_slot is not None])
