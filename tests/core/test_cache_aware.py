"""Cache-aware admission (:mod:`cbgen.core.cache_aware`): the rule on its own against a token-level
oracle, and driven through the scheduler (``sched_driver``): a prompt only waits while another
request in the same step completes its next uncached block, never twice for the same block once
that block is published, and every request still ends within the liveness bound.
"""

from __future__ import annotations

import random
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st
from sched_driver import Driver, expected_output

from cbgen.core import scheduler as scheduler_module
from cbgen.core.block_manager import BlockManager
from cbgen.core.cache_aware import ComputingBlocks
from cbgen.request import Request
from cbgen.sampling_params import SamplingParams


def make_request(rid: str, prompt: list[int], needs_prompt_logits: bool = False) -> Request:
    r = Request(request_id=rid, prompt_token_ids=prompt, params=SamplingParams(max_tokens=4))
    if needs_prompt_logits:
        r.prompt_logprobs = []  # still to be computed: the prefix cache neither serves nor takes it
    return r


def completes(r: Request, num_new: int, c: Request, k: int, block_size: int) -> bool:
    """Whether computing ``num_new`` more tokens of ``r`` completes a block equal to ``c``'s block
    ``k``, prefix included (the oracle: tokens, not hashes)."""
    if r.prompt_logprobs is not None:
        return False
    lo, hi = r.num_computed_tokens, r.num_computed_tokens + num_new
    end = (k + 1) * block_size
    return lo // block_size <= k < hi // block_size and r.token_ids[:end] == c.token_ids[:end]


def test_prompts_sharing_a_prefix_wait_one_step_to_find_it_cached():
    """Prompts that share two full blocks arrive together: the first computes them, the others wait
    one step and then find them cached (a prompt without that prefix is admitted at once), so the
    shared blocks are computed once; outputs are unchanged."""
    d = Driver(num_blocks=64, block_size=4, budget=64, max_seqs=8)
    shared = [7, 8, 9, 10, 11, 12, 13, 14]
    prompts = {
        "a": [*shared, 1, 2, 3],
        "b": [*shared, 4, 5],
        "c": [50, 51, 52, 53, 54, 55],
        "e": [*shared, 6],
    }
    (a,), (b,), _, (e,) = (d.add(rid, prompt, 3) for rid, prompt in prompts.items())
    out, _ = d.step()
    assert [(r.group_id, n) for r, n in out.scheduled] == [("a", 11), ("c", 6)]
    out, _ = d.step()
    # b and e computed only what follows the cached 8 tokens
    assert [(r.group_id, n) for r, n in out.scheduled] == [("a", 1), ("c", 1), ("b", 2), ("e", 1)]
    assert b.num_cached_tokens == e.num_cached_tokens == 8
    d.drain()
    for r in (a, b, e):
        prompt = prompts[r.group_id]
        assert r.output_token_ids == expected_output(prompt, 0, 3, eos=False)


@st.composite
def admission_steps(draw):
    """A pool with some published prompts, the requests a step already schedules (with their chunks),
    and the waiting prompts offered to admission, all drawn from a few shared prefixes."""
    block_size = draw(st.sampled_from([1, 2, 4]))
    prefixes = draw(st.lists(st.lists(st.integers(0, 2), max_size=12), min_size=1, max_size=3))

    def prompt() -> list[int]:
        return draw(st.sampled_from(prefixes)) + draw(st.lists(st.integers(0, 2), min_size=1, max_size=6))

    published = [prompt() for _ in range(draw(st.integers(0, 2)))]
    scheduled = []
    for _ in range(draw(st.integers(0, 4))):
        p = prompt()
        computed = draw(st.integers(0, len(p) - 1))
        scheduled.append((p, computed, draw(st.integers(1, len(p) - computed)), draw(st.booleans())))
    waiting = [
        (p, draw(st.integers(1, len(p))), draw(st.booleans()), draw(st.integers(0, 9)) == 0)
        for p in (prompt() for _ in range(draw(st.integers(1, 5))))
    ]
    return block_size, published, scheduled, waiting


@settings(max_examples=300, deadline=None)
@given(case=admission_steps())
def test_a_prompt_is_held_back_exactly_when_a_request_of_this_step_completes_its_next_block(case):
    """The rule on its own: a waiting prompt that has computed nothing is held back if and only if a
    request scheduled in this step (one admitted before it included) completes a block equal to its
    first uncached one; with nothing scheduled nothing is held back."""
    block_size, published, scheduled, waiting = case
    bm = BlockManager(num_blocks=500, block_size=block_size)
    for i, p in enumerate(published):
        r = make_request(f"p{i}", p)
        assert bm.allocate(r, len(p))
        r.num_computed_tokens = len(p)
        bm.cache_computed_blocks(r)
    step = []
    for i, (p, computed, n, logits) in enumerate(scheduled):
        r = make_request(f"s{i}", p, needs_prompt_logits=logits and computed == 0)
        r.num_computed_tokens = computed
        step.append((r, n))
    computing = ComputingBlocks(bm, list(step))
    for i, (p, chunk, logits, resumed) in enumerate(waiting):
        c = make_request(f"w{i}", p, needs_prompt_logits=logits)
        k = len(bm.match_prefix(c))
        c.num_computed_tokens = 1 if resumed else 0  # not a fresh prompt: never held back
        want = (
            not resumed
            and not logits
            and (k + 1) * block_size <= c.num_tokens - 1  # a full block, not the one with the last token
            and any(completes(r, n, c, k, block_size) for r, n in step)
        )
        assert computing.holds_back(c, k) == want
        assert step or not want
        if not want:  # admitted: its first chunk, after its cached prefix, completes blocks too
            c.num_computed_tokens = k * block_size
            n = min(chunk, c.num_tokens - c.num_computed_tokens)
            computing.add(c, n)
            step.append((c, n))


def test_a_prompt_is_never_held_back_when_nothing_else_is_scheduled():
    bm = BlockManager(num_blocks=16, block_size=2)
    r = make_request("a", [1, 2, 3, 4, 5])
    assert not ComputingBlocks(bm, []).holds_back(r, len(bm.match_prefix(r)))


@settings(max_examples=150, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(1, 16),
    max_seqs=st.integers(2, 8),
    prefixes=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=16), min_size=1, max_size=3),
    ops=st.lists(st.tuples(st.sampled_from(["add", "add", "step"]), st.integers(0, 10**6)), max_size=40),
)
def test_held_back_prompts_wait_only_for_blocks_in_progress_and_never_twice_for_one(
    block_size, budget, max_seqs, prefixes, ops
):
    """Driven through the scheduler with a pool that never evicts a published block: every hold is
    witnessed by another request of the same step completing that block, a prompt is never held back
    twice for the same block (so at most once per full block of its prompt), outputs are unchanged
    and the driver holds every request to the liveness bound."""
    rng = random.Random(0)
    adds = []
    for kind, x in ops:
        if kind == "add":
            prompt = prefixes[x % len(prefixes)] + [rng.randrange(4) for _ in range(x % 5)]
            adds.append((prompt, 1 + x % 6, 1 + (x // 6) % 2))
    # Every allocation of the run comes from never-used blocks: nothing published is evicted.
    num_blocks = sum(n * (-(-(len(p) + m) // block_size) + 1) for p, m, n in adds) + 1
    d = Driver(num_blocks, block_size, budget, max_seqs)
    holds: dict[str, list[int]] = {}  # request id -> the blocks it was held back for, in order

    class Recording(ComputingBlocks):
        def holds_back(self, request: Request, num_cached_blocks: int) -> bool:
            held = super().holds_back(request, num_cached_blocks)
            if held:
                witnesses = [
                    r
                    for r, n in self._scheduled
                    if r is not request and completes(r, n, request, num_cached_blocks, block_size)
                ]
                assert witnesses, f"{request.request_id} held back with no request completing its block"
                holds.setdefault(request.request_id, []).append(num_cached_blocks)
            return held

    expected = {}
    with mock.patch.object(scheduler_module, "ComputingBlocks", Recording):
        added = iter(adds)
        for kind, _ in ops:
            if kind == "add":
                prompt, max_tokens, n = next(added)
                for s in d.add(f"r{len(d.all)}", prompt, max_tokens, n=n):
                    expected[s.request_id] = expected_output(prompt, s.sample_index, max_tokens, eos=False)
            else:
                d.step()
                d.check()
        d.drain()
    for rid, blocks in holds.items():
        assert len(blocks) == len(set(blocks)), f"{rid} held back twice for one block: {blocks}"
    assert d.sched.stats.preemptions == 0
    for r in d.all:
        assert r.output_token_ids == expected[r.request_id]
    assert d.bm.num_free_blocks == d.bm.num_blocks
