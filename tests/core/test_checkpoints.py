"""State checkpoints (core/checkpoints.py) and the state layers' chunk rule (Scheduler.span): property
tests over random prompts, budgets and grids, and the checkpoint index on its own."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cbgen.core.block_manager import BlockManager
from cbgen.core.cache_pools import CachePools, StateCopy
from cbgen.core.checkpoints import Checkpoints
from cbgen.core.scheduler import Scheduler
from cbgen.core.slots import SlotPool
from cbgen.request import Request
from cbgen.sampling_params import SamplingParams


def _scheduler(align: int | None, block: int, budget: int, caching: bool, slots: int = 4) -> Scheduler:
    grid = max(align or 1, block) if align else 0
    ckpt = Checkpoints(slots, slots, grid) if align and caching else None
    pools = CachePools([BlockManager(256, block, caching)], SlotPool(slots), ckpt)
    return Scheduler(pools, budget, slots, prefill_align=align)


@settings(max_examples=200, deadline=None)
@given(
    prompt=st.integers(1, 300),
    outputs=st.integers(0, 20),
    start_chunks=st.integers(0, 5),
    budget=st.integers(1, 200),
    align=st.sampled_from([0, 1, 16, 64]),
    caching=st.booleans(),
)
def test_span_keeps_chunks_on_the_grid(prompt, outputs, start_chunks, budget, align, caching):
    """Prompt chunks that do not finish the prompt end on the align grid (0: none, the whole prompt);
    tokens past the prompt go one at a time; every call makes progress; with checkpoints a chunk
    never crosses the prompt's last grid point before its end."""
    sched = _scheduler(align, 16, budget, caching)
    r = Request("r", list(range(3, 3 + prompt)), SamplingParams(max_tokens=50))
    r.token_ids += [5] * outputs
    start = 0
    while start < r.num_tokens:
        n = sched.span(r, start, budget)
        assert n >= 1, (start, budget)
        end = start + n
        if start < prompt:
            assert end <= prompt
            if end < prompt:
                assert align and end % align == 0, (start, end, align)
            if align and caching:
                last = (prompt - 1) // 16 // max(1, align // 16) * max(align, 16)
                assert not start < last < end, (start, end, last)
            # Past the budget only by less than one aligned chunk (a prompt must not wait forever).
            if n > budget:
                assert (align and n <= align) or (not align and end == prompt)
        else:
            assert n == 1
        start = end
    assert sched.span(r, r.num_tokens, budget) == 0


def test_without_state_the_budget_alone_chunks():
    sched = _scheduler(None, 16, 10, caching=True)
    r = Request("r", list(range(3, 103)), SamplingParams())
    assert sched.span(r, 0, 10) == 10 and sched.span(r, 95, 10) == 5


def test_checkpoints_file_find_and_reuse_slots():
    ckpt = Checkpoints(first=8, capacity=2, grid=16)
    hashes = [101, 102, 103, 104]  # blocks of 8 tokens
    assert ckpt.file(102) == 8  # the state after 16 tokens
    assert ckpt.find(hashes, 8, 32) == (0, None)  # not in the step that files it
    ckpt.new_step()
    assert ckpt.find(hashes, 8, 31) == (16, 8)  # 31 tokens: the grid point below is 16
    assert ckpt.file(102) is None  # already filed
    assert ckpt.file(104) == 9
    ckpt.new_step()
    assert ckpt.find(hashes, 8, 32) == (32, 9)  # the longest one
    # Full: the least recently used (102, found before 104) makes room.
    assert ckpt.find(hashes, 8, 16) == (16, 8)
    assert ckpt.file(999) == 9  # 104 was used least recently now
    ckpt.new_step()
    assert ckpt.find(hashes, 8, 32) == (16, 8)
    ckpt.forget()
    assert len(ckpt) == 0 and ckpt.find(hashes, 8, 32) == (0, None)


def test_a_hit_copies_the_checkpoint_into_the_new_slot():
    """Through the scheduler: a prompt files a checkpoint after its chunk on the grid; the same
    prompt later starts at that point with a copy of it before its first forward."""
    sched = _scheduler(16, 8, budget=16, caching=True)
    prompt = list(range(3, 3 + 40))
    a = Request("a", prompt, SamplingParams(max_tokens=1))
    sched.add(a)
    filed = []
    while a.num_computed_tokens < len(prompt):
        out = sched.schedule()
        filed += out.checkpoints
        for r, n in out.scheduled:
            r.num_computed_tokens += n
        sched.block_manager.cache_computed_blocks(a)
    sched.running.remove(a)  # a ends (its sampled token is not part of this test)
    sched.block_manager.free(a)
    # Chunks end at 16 and 32 (the last grid point before 40): one checkpoint each.
    assert len(filed) == 2 and filed[0].src == filed[1].src and filed[0].dst != filed[1].dst
    b = Request("b", prompt, SamplingParams(max_tokens=1))
    sched.add(b)
    out = sched.schedule()
    assert out.scheduled == [(b, 8)] and b.num_computed_tokens == 32
    assert StateCopy(filed[-1].dst, b.state_slot) in out.copies
