"""The step contract end to end without a real model: a fake backend whose cache is two KV groups of
different head sizes and block sizes plus a per-sequence state, run through the scheduler, the cache
pools, the input builder's backend-neutral step batch and a KV cache built from the layout.

The fake forward writes every query token into both groups' caches at the step batch's slots and
folds it into the row's state; then, for each sampled position, it reads the sequence back through
the row's block table of each group and its state slot, and predicts the next token from what it
read (the stand-in model of ``sched_driver``).  A wrong table, slot, state slot or copy makes the
read-back differ from the sequence (asserted) and the outputs differ from plain decoding.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from run_driver import RunDriver, make_pools
from sched_driver import expected_output, fake_token

from cbgen.core.cache_pools import BlockCopy
from cbgen.model.cache_groups import CacheGroup, CacheLayout
from cbgen.model.input_batch import InputBuilder
from cbgen.model.kv_cache import KVCache, StateCopy
from cbgen.model.step_batch import StepBatch
from cbgen.request import Request, RequestStatus
from cbgen.sampling_params import SamplingParams

CPU = torch.device("cpu")
F32 = torch.float32


def two_group_layout(block_sizes: tuple[int, int], state: bool) -> CacheLayout:
    """Layers 0-1 in group 0 (2 KV heads, K and V 8 wide), layer 2 in group 1 (1 KV head, K 16 and
    V 4 wide), layer 3 reads layer 0's KV; with ``state``, layer 4 keeps [sum, count] per sequence."""
    groups = [
        CacheGroup("kv", (0, 1), F32, num_kv_heads=2, k_head_dim=8, v_head_dim=8, block_size=block_sizes[0]),
        CacheGroup("kv", (2,), F32, num_kv_heads=1, k_head_dim=16, v_head_dim=4, block_size=block_sizes[1]),
    ]
    if state:
        groups.append(CacheGroup("state", (4,), F32, state_shapes=((2,),), name="recurrent0"))
    return CacheLayout(tuple(groups), shared=((3, 0),))


class FakeMetadata:
    """The fake backend's deriver: rows in the scheduler's order, and per group its tables and
    slots as tensors (no decode/prefill split: this backend has one path)."""

    def order(self, scheduled: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        return list(scheduled)

    def build(self, batch: StepBatch, kv_caches: list, to_device) -> dict:
        return {
            "tables": [to_device(t, torch.int64) for t in batch.tables],
            "slots": [to_device(s, torch.int64) for s in batch.slots],
            "state_slots": None if batch.state_slots is None else to_device(batch.state_slots, torch.int64),
            "batch": batch,
        }


class CacheDriver(RunDriver):
    """The run driver with a forward over a real KV cache laid out by ``layout``."""

    def __init__(self, layout: CacheLayout, num_blocks: int, slots: int | None, budget: int, seed: int):
        block_sizes = tuple(g.block_size for g in layout.kv_groups)
        super().__init__(make_pools(num_blocks, block_sizes, slots, True), budget, 4, random.Random(seed))
        self.layout = layout
        self.cache = KVCache(layout, num_blocks, CPU, num_slots=slots or 0)
        self.builder = InputBuilder(
            block_sizes, CPU, num_blocks=num_blocks, metadata=FakeMetadata(), with_state=slots is not None
        )
        self.propose_drafts = slots is None  # a state summarises accepted tokens only: no drafts
        self.forwards = 0

    def forward(self, scheduled, copies: list[BlockCopy]) -> dict[int, list[int]]:
        with torch.inference_mode():  # as the runner's forward: the cache is made in inference mode
            return self._forward(scheduled, copies)

    def _forward(self, scheduled, copies: list[BlockCopy]) -> dict[int, list[int]]:
        self.cache.copy_blocks([*copies, *(StateCopy(*s) for s in self.pending_states)])
        step = self.builder.build(scheduled, self.cache.layers)
        meta, batch = step.meta, step.meta["batch"]
        assert step.num_tokens == batch.num_tokens == sum(n for _, n in scheduled)
        self._write(batch, meta, step.input_ids, step.positions)
        predicted: dict[int, list[int]] = {}
        sample_rows = step.logits_indices.tolist()
        assert len(sample_rows) == len(step.sample_requests)
        for seq, row in zip(step.sample_requests, sample_rows):
            i = int(np.searchsorted(batch.q_starts, row, side="right")) - 1
            history = self._read(batch, meta, i, int(step.positions[row]) + 1)
            predicted.setdefault(id(seq), []).append(fake_token(history, seq.sample_index))
        self.forwards += 1
        return predicted

    def _write(self, batch: StepBatch, meta: dict, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        values = tokens.to(F32)
        for g, group in enumerate(self.layout.kv_groups):
            for layer in group.layers:
                k, v = self.cache.layers[layer]
                flat_k, flat_v = k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])
                flat_k[meta["slots"][g]] = values[:, None, None] * (layer + 1)
                flat_v[meta["slots"][g]] = positions.to(F32)[:, None, None]
        if meta["state_slots"] is not None:
            state = self.cache.states[("recurrent0", 4)]
            for i, (_, n) in enumerate(batch.rows):
                slot = int(meta["state_slots"][i])
                start = int(batch.q_starts[i])
                if batch.ctx_lens[i] == 0:
                    state[slot] = 0  # a sequence (re)starts: its state starts empty
                state[slot, 0] += values[start : start + n].sum()
                state[slot, 1] += n

    def _read(self, batch: StepBatch, meta: dict, row: int, length: int) -> list[int]:
        """The row's first ``length`` tokens, read back from every layer that holds them."""
        r = batch.rows[row][0]
        want = (r.token_ids + r.draft_token_ids)[:length]
        for layer, kv in enumerate(self.cache.layers):
            if kv is None:
                continue
            group = self.layout.kv_group_of()[layer]
            bs = self.layout.kv_groups[group].block_size
            table = meta["tables"][group][row]
            pos = torch.arange(length)
            k, v = kv
            got_k = k[table[pos // bs], pos % bs]  # [length, heads, dim]
            producer = dict(self.layout.shared).get(layer, layer)
            assert torch.equal(
                got_k, torch.tensor(want, dtype=F32)[:, None, None].expand_as(got_k) * (producer + 1)
            )
            assert torch.equal(v[table[pos // bs], pos % bs][:, 0, 0], pos.to(F32))
        if meta["state_slots"] is not None and length == int(batch.seq_lens[row]):
            sum_, count = self.cache.states[("recurrent0", 4)][int(meta["state_slots"][row])].tolist()
            assert (sum_, count) == (float(sum(want)), float(length)), (r.request_id, sum_, count)
        return [int(t) for t in want]


def _run(layout: CacheLayout, slots: int | None, seed: int, num_blocks: int, budget: int) -> CacheDriver:
    d = CacheDriver(layout, num_blocks, slots, budget, seed)
    rng = random.Random(seed)
    shared = [rng.randrange(97) for _ in range(9)]
    specs = {}
    for i in range(rng.randrange(2, 7)):
        prompt = (shared if i % 2 else []) + [rng.randrange(97) for _ in range(rng.randrange(1, 14))]
        max_tokens, n, eos = rng.randrange(1, 12), 2 if rng.random() < 0.3 else 1, rng.random() < 0.5
        d.add(f"r{i}", prompt, max_tokens, n, eos)
        specs[f"r{i}"] = (prompt, max_tokens, eos)
    for _ in range(2000):
        if not d.sched.has_work():
            break
        d.step()
        d.check()
    assert not d.sched.has_work()
    for r in d.all:
        assert r.is_finished
        if r.status is RequestStatus.FINISHED_ERROR:
            assert "KV blocks" in (r.error or ""), r.error
            continue
        prompt, max_tokens, eos = specs[r.group_id]
        assert r.output_token_ids == expected_output(prompt, r.sample_index, max_tokens, eos), r.request_id
    assert all(p.num_used_blocks == 0 for p in d.pools.pools)
    return d


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    block_sizes=st.sampled_from([(4, 8), (8, 2), (4, 4)]),
    state=st.booleans(),
    num_blocks=st.integers(14, 40),
    budget=st.integers(8, 40),
)
def test_two_groups_and_a_state_through_scheduler_pools_and_input_builder(
    seed: int, block_sizes: tuple[int, int], state: bool, num_blocks: int, budget: int
) -> None:
    d = _run(two_group_layout(block_sizes, state), 3 if state else None, seed, num_blocks, budget)
    assert d.forwards > 0


def test_the_contract_workload_reaches_forks_preemption_drafts_and_state_copies() -> None:
    """Not vacuous: small pools make it preempt, n=2 forks copy blocks and states, drafts are both
    accepted and rejected."""
    seen = {"preemptions": 0, "block copies": 0, "state copies": 0, "accepted": 0, "rejected": 0}
    for seed in range(10):
        for state in (False, True):
            d = _run(two_group_layout((4, 8), state), 3 if state else None, seed, 14, 16)
            seen["preemptions"] += d.pools.stats.preemptions
            seen["block copies"] += len(d.copies)
            seen["state copies"] += len(d.state_copies)
            seen["accepted"] += d.accepted_total
            seen["rejected"] += d.rejected_total
    assert all(seen.values()), seen


def test_the_cache_is_laid_out_per_group() -> None:
    layout = two_group_layout((4, 8), True)
    cache = KVCache(layout, 10, CPU, num_slots=3)
    assert cache.layers[0][0].shape == (11, 4, 2, 8) and cache.layers[1][1].shape == (11, 4, 2, 8)
    assert cache.layers[2][0].shape == (11, 8, 1, 16) and cache.layers[2][1].shape == (11, 8, 1, 4)
    assert cache.layers[3] is cache.layers[0] and cache.layers[4] is None
    assert cache.states[("recurrent0", 4)].shape == (4, 2)
    per_block = 2 * 4 * 2 * (8 + 8) * 4 + 1 * 8 * 1 * (16 + 4) * 4
    assert cache.nbytes == 11 * per_block + 4 * 2 * 4
    with torch.inference_mode():
        cache.layers[2][0][3].fill_(1.0)
    cache.copy_blocks([BlockCopy(3, 5, group=1)])
    assert cache.layers[2][0][5].eq(1.0).all() and cache.layers[0][0][5].eq(0).all()


def test_a_row_without_its_blocks_or_state_slot_is_refused_on_the_host() -> None:
    builder = InputBuilder((4, 8), CPU, num_blocks=10, metadata=FakeMetadata(), with_state=True)
    r = Request("a", list(range(1, 10)), SamplingParams(max_tokens=4))
    r.block_tables = [[0, 1, 2], []]
    with pytest.raises(RuntimeError, match="cache group 1"):
        builder.build([(r, 9)], [])
    r.block_tables = [[0, 1, 2], [3, 4]]
    with pytest.raises(RuntimeError, match="state slot"):
        builder.build([(r, 9)], [])
    r.state_slot = 0
    r.block_tables = [[0, 1, 2], [3, 12]]
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        builder.build([(r, 9)], [])
