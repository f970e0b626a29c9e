"""KV block pool: refcounted blocks, prefix caching over full blocks, and an LRU of cached free blocks.

Pure Python (no torch) so it can be property-tested without a model.  A block's *content* lives
on the device; here we only track who holds which block and which full blocks can be reused.

Prefix caching: every full block of a sequence gets a chained hash
``h_i = hash((h_{i-1}, tokens of block i))``, whose root ``h_{-1}`` is the request's ``prefix_salt``
(None for most models; see :class:`cbgen.request.Request`).  A block is only published under its hash once all
its tokens have been computed.  A lookup also compares the stored tokens, so a hash collision can
never serve the wrong K/V.  Freed blocks keep their hash and sit in an LRU free list until they
are reused, so a later request with the same prefix can revive them.

Partial hits: prompts that share a prefix which ends inside a block (a chat template's system
prompt, then each user's question) would each recompute the shared part of that block, up to
``block_size - 1`` tokens a prompt.  So the block after a request's full hits may be *copied* from a
published block with the same parent whose tokens start the same way: the request takes a fresh
block, the scheduler asks the runner to copy the source's K/V into it before the next forward (as
copy-on-fork does), and the matching tokens count as computed.  Published blocks are indexed by
their parent and first ``m`` tokens for ``m`` in :data:`PARTIAL_LENGTHS` (a handful of entries a
block, not one per length); a lookup takes the longest indexed length that matches and extends it
token by token against that block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from cbgen.core.stats import EngineStats
from cbgen.request import Request

# Prefix lengths under which a published block is indexed for partial hits (those below the block size).
PARTIAL_LENGTHS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass
class Block:
    """One KV block: who holds it (``ref_count``) and, when full and computed, its prefix hash (and
    its parent's, the key of partial hits)."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    parent_hash: int | None = None


@dataclass
class BlockManager:
    """Allocates the KV blocks of one cache group to sequences; see the module docstring for the
    caching scheme.  ``group``: which of a request's block tables (``Request.block_tables``) and
    hash tables it keeps (:class:`cbgen.core.cache_pools.CachePools` holds one per group)."""

    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    blocks: list[Block] = field(init=False)
    stats: EngineStats = field(default_factory=EngineStats)  # shared with the scheduler and engine
    group: int = 0

    def __post_init__(self) -> None:
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        # Free blocks in eviction order: the front is reused first.  Never-used blocks start at the
        # front; freed blocks go to the back, so cached content lives as long as possible.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(self.num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._partial: dict[int, int] = {}  # hash((parent hash, first m tokens)) -> block id
        lengths = {m for m in PARTIAL_LENGTHS if m < self.block_size} | {self.block_size - 1}
        self._lengths = sorted(m for m in lengths if m > 0)  # none for one-token blocks

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any sequence (cached-but-free blocks count as free)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences."""
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ prefix cache
    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        """Extends and returns the request's chained hashes for its first ``num_full_blocks`` blocks."""
        hashes = request.hash_tables[self.group]
        tokens = request.token_ids
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else request.prefix_salt
            hashes.append(hash((parent, tuple(tokens[i * bs : (i + 1) * bs]))))
        return hashes

    def match_prefix(self, request: Request) -> list[int]:
        """Cached block ids for the longest computed prefix of ``request``.

        Never covers the whole sequence: the last token is always recomputed, because the step that
        computes it is the one that produces the logits to sample from.  Nothing is served to a
        request that still needs prompt logprobs: they come from the prompt's logits, which the
        cache does not keep (computing them costs the same forward as computing the prompt).
        """
        if not self.enable_prefix_caching or _needs_prompt_logits(request):
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        bs = self.block_size
        hit: list[int] = []
        for i in range(max_blocks):
            block_id = self._cached.get(hashes[i])
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tuple(request.token_ids[i * bs : (i + 1) * bs]):
                break
            hit.append(block_id)
        return hit

    def match_partial(self, request: Request, num_full_blocks: int) -> tuple[int, int] | None:
        """A published block to copy as the request's block after its ``num_full_blocks`` cached ones:
        ``(block id, tokens)`` with the longest run of matching tokens found (see the module
        docstring), never reaching the request's last token; None when nothing matches."""
        if not self.enable_prefix_caching or not self._partial or _needs_prompt_logits(request):
            return None
        bs = self.block_size
        start = num_full_blocks * bs
        room = min(bs, request.num_tokens - 1 - start)
        if room < 1:
            return None
        parent = (
            self._block_hashes(request, num_full_blocks)[num_full_blocks - 1]
            if num_full_blocks
            else request.prefix_salt
        )
        want = tuple(request.token_ids[start : start + room])
        for m in reversed(self._lengths):
            if m > room:
                continue
            block_id = self._partial.get(hash((parent, want[:m])))
            if block_id is None:
                continue
            block = self.blocks[block_id]
            if block.parent_hash != parent or block.token_ids[:m] != want[:m]:
                continue  # a hash collision, or a block published again under another prefix
            n = m
            while n < room and block.token_ids[n] == want[n]:
                n += 1
            return block_id, n
        return None

    def completed_hashes(self, request: Request, num_new_tokens: int) -> list[int]:
        """Prefix hashes of the full blocks that computing ``num_new_tokens`` more tokens of
        ``request`` completes (and so publishes after the step); none without prefix caching."""
        if not self.enable_prefix_caching or _needs_prompt_logits(request):
            return []
        start = request.num_computed_tokens // self.block_size
        # Draft positions are not tokens yet: only blocks of known tokens have a hash.
        end = min(request.num_computed_tokens + num_new_tokens, len(request.token_ids)) // self.block_size
        return self._block_hashes(request, end)[start:end]

    def cache_computed_blocks(self, request: Request) -> None:
        """Publishes the request's full, computed blocks under their prefix hash."""
        if not self.enable_prefix_caching:
            return
        table = request.block_tables[self.group]
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        hashes = self._block_hashes(request, num_full)
        bs = self.block_size
        for i in range(num_full):
            block = self.blocks[table[i]]
            if block.block_hash is not None:
                continue
            if hashes[i] in self._cached:
                continue  # an identical block is already published; keep ours private
            block.block_hash = hashes[i]
            block.token_ids = tuple(request.token_ids[i * bs : (i + 1) * bs])
            block.parent_hash = hashes[i - 1] if i else request.prefix_salt
            self._cached[hashes[i]] = block.block_id
            for m in self._lengths:
                self._partial[hash((block.parent_hash, block.token_ids[:m]))] = block.block_id

    def reset_prefix_cache(self) -> None:
        """Forgets every published hash (e.g. after a weight update): nothing can be matched again."""
        self.forget_published()
        self.stats.prefix_cache_resets += 1

    def forget_published(self) -> None:
        """:meth:`reset_prefix_cache` without counting it (a multi-group reset counts once)."""
        for block_id in self._cached.values():
            block = self.blocks[block_id]
            block.block_hash = None
            block.token_ids = ()
            block.parent_hash = None
        self._cached.clear()
        self._partial.clear()

    # ------------------------------------------------------------------ allocation
    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached content
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            for m in self._lengths:
                key = hash((block.parent_hash, block.token_ids[:m]))
                if self._partial.get(key) == block_id:
                    del self._partial[key]
            block.block_hash = None
            block.token_ids = ()
            block.parent_hash = None
        block.ref_count = 1
        return block_id

    def _hold(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def can_allocate(self, num_blocks: int, reusing: Sequence[int] = ()) -> bool:
        """Whether ``num_blocks`` new blocks fit, after reviving the cached free blocks in ``reusing``."""
        revived = sum(1 for b in reusing if self.blocks[b].ref_count == 0)
        return num_blocks <= len(self._free) - revived

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        cached_blocks: Sequence[int] = (),
        partial: tuple[int, int] | None = None,
    ) -> bool:
        """Gives ``request`` blocks for ``num_computed_tokens + num_new_tokens`` tokens.

        ``cached_blocks`` (from :meth:`match_prefix`, first schedule only) are taken as the computed
        prefix, and ``partial`` (from :meth:`match_partial`) as that many more computed tokens in the
        next block, a fresh one the caller must fill by copying the source block into it.  Returns
        False, changing nothing, when the pool is short.
        """
        table = request.block_tables[self.group]
        if not cached_blocks and partial is None:  # every running request, every step: the short way
            need = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size) - len(table)
            if need <= 0:
                return True
            if need > len(self._free):
                return False
            for _ in range(need):
                table.append(self._take_free_block())
            return True
        computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        computed += partial[1] if partial is not None else 0
        if not self.can_reserve(request, computed + num_new_tokens, cached_blocks):
            return False
        self.reserve(request, computed + num_new_tokens, cached_blocks)
        request.num_computed_tokens = computed
        return True

    def _need(self, request: Request, num_tokens: int, cached_blocks: Sequence[int]) -> int:
        have = len(request.block_tables[self.group]) + len(cached_blocks)
        return max(self.blocks_needed(num_tokens) - have, 0)

    def can_reserve(self, request: Request, num_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Whether :meth:`reserve` would find the blocks it needs."""
        return self.can_allocate(self._need(request, num_tokens, cached_blocks), cached_blocks)

    def reserve(self, request: Request, num_tokens: int, cached_blocks: Sequence[int] = ()) -> None:
        """Appends ``cached_blocks`` (held) and fresh blocks to the request's table until it holds
        ``num_tokens`` tokens; ``num_computed_tokens`` is the caller's (see :meth:`allocate`).  Check
        :meth:`can_reserve` first."""
        need = self._need(request, num_tokens, cached_blocks)
        table = request.block_tables[self.group]
        for block_id in cached_blocks:
            self._hold(block_id)
        table.extend(cached_blocks)
        for _ in range(need):
            table.append(self._take_free_block())

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Frees the request's blocks past the first ``num_tokens`` tokens (positions computed for
        drafts that were not accepted; nothing published is among them)."""
        table = request.block_tables[self.group]
        keep = self.blocks_needed(num_tokens)
        if len(table) > keep:
            self.release(table[keep:])
            del table[keep:]

    def free(self, request: Request) -> None:
        """Releases the request's blocks.  The tail goes to the LRU first, so shared prefix blocks,
        which are more likely to be reused, are evicted last."""
        self.release(request.block_tables[self.group])
        request.block_tables[self.group] = []

    def release(self, block_ids: list[int]) -> None:
        """Drops one reference to each of ``block_ids``, the last ones first (see :meth:`free`)."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self._free[block_id] = None

    def fork(self, parent: Request, child: Request, num_tokens: int | None = None) -> tuple[int, int] | None:
        """Makes ``child`` share ``parent``'s first ``num_tokens`` computed tokens (default: all of
        them) — the prompt of n>1 samples.

        Full blocks are shared by refcount.  A partly filled last block will be written differently by
        each sample, so the child gets a private copy: the returned ``(src, dst)`` pair is a device-side
        block copy the runner must perform before the next forward.  Returns None when no copy is needed.
        Raises ``MemoryError`` if the copy cannot be allocated (the caller recomputes instead).
        """
        g = self.group
        assert not child.block_tables[g]
        shared = parent.num_computed_tokens if num_tokens is None else num_tokens
        assert shared <= parent.num_computed_tokens
        num_full = shared // self.block_size
        partial = shared % self.block_size != 0
        if partial and not self._free:
            raise MemoryError("no free block for copy-on-fork")
        source = parent.block_tables[g]
        for block_id in source[:num_full]:
            self._hold(block_id)
        child.block_tables[g] = list(source[:num_full])
        child.hash_tables[g] = list(parent.hash_tables[g][:num_full])
        child.num_computed_tokens = shared
        if not partial:
            return None
        dst = self._take_free_block()
        child.block_tables[g].append(dst)
        return source[num_full], dst

    def check_invariants(self, tables: list[list[int]]) -> None:
        """Asserts refcounts equal table membership and free + used == total (used by tests)."""
        counts = [0] * self.num_blocks
        for table in tables:
            for block_id in table:
                counts[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == counts[block.block_id], (block, counts[block.block_id])
            assert (block.ref_count == 0) == (block.block_id in self._free), block
        assert self.num_free_blocks + self.num_used_blocks == self.num_blocks
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash
        for block_id in self._partial.values():
            assert self.blocks[block_id].block_hash is not None, block_id


def _needs_prompt_logits(request: Request) -> bool:
    return request.prompt_logprobs is not None and len(request.prompt_logprobs) < request.num_prompt_tokens
