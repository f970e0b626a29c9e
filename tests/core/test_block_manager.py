"""BlockManager: refcounts, prefix caching and the LRU, by example and by property."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cbgen.core.block_manager import BlockManager
from cbgen.request import Request
from cbgen.sampling_params import SamplingParams


def req(tokens: list[int], rid: str = "r") -> Request:
    return Request(request_id=rid, prompt_token_ids=tokens, params=SamplingParams())


def compute_all(bm: BlockManager, r: Request) -> None:
    cached = bm.match_prefix(r)
    assert bm.allocate(r, r.num_tokens - len(cached) * bm.block_size, cached)
    r.num_computed_tokens = r.num_tokens
    bm.cache_computed_blocks(r)


def test_prefix_hit_revives_freed_blocks_and_never_covers_whole_prompt():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = req(list(range(12)), "a")
    compute_all(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 8
    b = req(list(range(12)), "b")
    hit = bm.match_prefix(b)
    # 12 tokens = 3 full blocks, but the last token must be recomputed: only 2 blocks may match.
    assert len(hit) == 2
    assert bm.allocate(b, 4, hit)
    assert b.num_computed_tokens == 8
    bm.check_invariants([b.block_ids])


def test_hash_collision_is_caught_by_token_check():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = req([1, 2, 3, 4, 5], "a")
    compute_all(bm, a)
    block = bm.blocks[a.block_ids[0]]
    block.token_ids = (9, 9, 9, 9)  # simulate a colliding hash with other content
    b = req([1, 2, 3, 4, 5], "b")
    assert bm.match_prefix(b) == []


def test_shared_block_refcount_and_lru_eviction_order():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = req([1, 2, 3, 4, 5], "a")
    compute_all(bm, a)
    b = req([1, 2, 3, 4, 9], "b")
    hit = bm.match_prefix(b)
    assert len(hit) == 2
    assert bm.allocate(b, 1, hit)
    assert all(bm.blocks[i].ref_count == 2 for i in hit)
    bm.check_invariants([a.block_ids, b.block_ids])
    bm.free(a)
    bm.free(b)
    bm.check_invariants([])
    # Allocating fresh blocks evicts the never-cached ones first, keeping the shared prefix alive.
    c = req([7, 7, 7], "c")
    assert bm.allocate(c, 3)
    d = req([1, 2, 3, 4, 6], "d")
    assert len(bm.match_prefix(d)) == 2


def test_reset_prefix_cache_forgets_everything():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = req([1, 2, 3, 4, 5], "a")
    compute_all(bm, a)
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.match_prefix(req([1, 2, 3, 4, 5])) == []


def test_allocation_failure_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = req([1, 2, 3, 4, 5, 6], "a")
    assert not bm.allocate(a, 6)
    assert a.block_ids == [] and bm.num_free_blocks == 2


def test_fork_shares_full_blocks_and_copies_partial_tail():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = req(list(range(6)), "a")
    compute_all(bm, a)
    child = req(list(range(6)), "c")
    pair = bm.fork(a, child)
    assert child.block_ids[0] == a.block_ids[0]
    assert pair == (a.block_ids[1], child.block_ids[1])
    assert child.num_computed_tokens == 6
    bm.check_invariants([a.block_ids, child.block_ids])


def test_partial_hit_copies_the_shared_start_of_the_next_block():
    bm = BlockManager(num_blocks=16, block_size=8)
    a = req([*range(8), 50, 51, 52, 60, 61, 62, 63, 64], "a")  # second block: 50 51 52, then its own
    compute_all(bm, a)
    # b's second block is full too (so its hash is known) but differs from a's after 3 tokens.
    b = req([*range(8), 50, 51, 52, 70, 71, 72, 73, 74, 75], "b")
    hit = bm.match_prefix(b)
    assert hit == a.block_ids[:1]
    # 3 tokens found under the indexed length 2, then extended token by token.
    assert bm.match_partial(b, len(hit)) == (a.block_ids[1], 3)
    assert bm.allocate(b, 6, hit, (a.block_ids[1], 3))
    assert b.num_computed_tokens == 8 + 3
    assert (
        b.block_ids[0] == a.block_ids[0] and b.block_ids[1] not in a.block_ids
    )  # a fresh block to copy into
    bm.check_invariants([a.block_ids, b.block_ids])
    # A first block can match too (no full hit; the parent is the root).
    assert bm.match_partial(req([0, 1, 2, 3, 9, 9], "c"), 0) == (a.block_ids[0], 4)
    # No shared first token: nothing.
    assert bm.match_partial(req([5, 1, 2, 3], "d"), 0) is None


def test_partial_hit_never_reaches_the_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = req([1, 2, 3, 4, 5, 6, 7, 8], "a")
    compute_all(bm, a)
    # 7 tokens: one full block, then 3 matching tokens of which the last must be computed.
    b = req([1, 2, 3, 4, 5, 6, 7], "b")
    hit = bm.match_prefix(b)
    assert len(hit) == 1
    assert bm.match_partial(b, 1) == (a.block_ids[1], 2)
    # 5 tokens: the 5th is the last, so no room in the second block.
    assert bm.match_partial(req([1, 2, 3, 4, 5], "c"), 1) is None


def test_partial_hit_checks_tokens_and_parent():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = req([1, 2, 3, 4, 5, 6, 7, 8], "a")
    compute_all(bm, a)
    # Same second-block tokens under another first block: another parent, no match.
    assert bm.match_partial(req([9, 9, 9, 9, 5, 6, 7, 1], "b"), 1) is None
    bm.blocks[a.block_ids[1]].token_ids = (0, 0, 0, 0)  # a colliding index entry with other content
    assert bm.match_partial(req([1, 2, 3, 4, 5, 6, 7, 1], "c"), 1) is None


def test_partial_index_forgets_evicted_and_reset_blocks():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = req([1, 2, 3, 4, 5], "a")
    compute_all(bm, a)
    first = a.block_ids[0]
    bm.free(a)
    assert bm.match_partial(req([1, 2, 9, 9], "b"), 0) == (first, 2)
    other = req([7, 7, 7, 7, 7, 7, 7, 7], "o")
    assert bm.allocate(other, 8)  # takes both blocks: the cached one is evicted
    assert bm.match_partial(req([1, 2, 9, 9], "b"), 0) is None
    bm.free(other)
    bm.check_invariants([])
    c = req([1, 2, 3, 4, 5], "c")
    compute_all(bm, c)
    bm.reset_prefix_cache()
    assert bm.match_partial(req([1, 2, 9, 9], "d"), 0) is None


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "free", "grow", "fork", "reset"]),
            st.lists(st.integers(0, 3), min_size=1, max_size=20),
            st.integers(0, 10),
        ),
        max_size=40,
    )
)
def test_refcounts_match_tables_under_random_operations(ops):
    bm = BlockManager(num_blocks=12, block_size=3)
    live: list[Request] = []
    for kind, tokens, pick in ops:
        if kind == "add":
            r = req(tokens, f"r{len(live)}")
            cached = bm.match_prefix(r)
            partial = bm.match_partial(r, len(cached))
            copied = partial[1] if partial else 0
            if partial is not None:
                assert 0 < copied < r.num_tokens - len(cached) * bm.block_size
                assert bm.blocks[partial[0]].block_hash is not None  # a published block's K/V
            if bm.allocate(r, r.num_tokens - len(cached) * bm.block_size - copied, cached, partial):
                if partial is not None:
                    assert r.block_ids[len(cached)] not in cached  # copied into a fresh block
                r.num_computed_tokens = r.num_tokens
                bm.cache_computed_blocks(r)
                live.append(r)
        elif kind == "free" and live:
            bm.free(live.pop(pick % len(live)))
        elif kind == "grow" and live:
            r = live[pick % len(live)]
            r.append_token(tokens[0])
            if bm.allocate(r, 1):
                r.num_computed_tokens += 1
                bm.cache_computed_blocks(r)
            else:
                r.token_ids.pop()
        elif kind == "fork" and live:
            parent = live[pick % len(live)]
            child = req(parent.prompt_token_ids, "child")
            child.token_ids = list(parent.token_ids)
            try:
                bm.fork(parent, child)
            except MemoryError:
                continue
            live.append(child)
        elif kind == "reset":
            bm.reset_prefix_cache()
        bm.check_invariants([r.block_ids for r in live])
    for r in live:
        bm.free(r)
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks
