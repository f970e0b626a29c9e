"""Engine-level exactness cases shared by the per-kind model tests (state layers in
``test_state_models.py``, per-layer KV shapes in ``test_kv_shapes.py``): each runs a model through
the real engine the way a scenario exercises it and holds the tokens to ``generate()`` by the oracle,
or to the same request run another way."""

from __future__ import annotations

import random

import torch

from cbgen import LLM, SamplingParams
from oracle import FP32, compare, hf_greedy

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompts(lengths, seed: int = 0) -> list[list[int]]:
    """Random prompts of ``lengths`` over ids 3..499."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def first_tokens(outputs) -> list[list[int]]:
    """Each request's first sample's tokens."""
    return [o.outputs[0].token_ids for o in outputs]


def all_free(llm: LLM) -> None:
    """Every block (and every state slot, where the model has state) is back in its pool."""
    pools = llm.engine.scheduler.block_manager
    if pools.slots is not None:
        assert pools.slots.num_free == pools.slots.num_slots
    assert all(p.num_used_blocks == 0 for p in pools.pools)


def one_by_one(llm: LLM, batch: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Each prompt generated alone, in order: its greedy tokens and the prefix-cache hit tokens it
    got (what an earlier prompt left in the cache)."""
    got, hits = [], []
    for p in batch:
        before = llm.stats.prefix_cache_hits
        got += first_tokens(llm.generate([p], GREEDY, use_tqdm=False))
        hits.append(llm.stats.prefix_cache_hits - before)
    return got, hits


def check_random_budgets(model, name: str, lengths, seed: int = 1) -> None:
    """Twice: a random token budget and block size, the prompts chunked and mixed with decode rows;
    every sequence equals generate()."""
    rng = random.Random(name)
    batch = prompts(lengths, seed=seed)
    refs = [hf_greedy(model, p, GREEDY.max_tokens) for p in batch]
    for _ in range(2):
        budget, block = rng.choice([7, 16, 33, 100]), rng.choice([4, 8, 16])
        llm = LLM(model, max_num_batched_tokens=budget, block_size=block, max_num_seqs=4)
        compare(model, batch, first_tokens(llm.generate(batch, GREEDY, use_tqdm=False)), refs, FP32)
        all_free(llm)


def check_forks(model) -> None:
    """n > 1 shares one prefill: greedy samples all equal generate(); seeded samples equal the same
    request whose samples each compute the prompt (max_num_seqs=1: no fork)."""
    prompt = prompts([45], seed=4)[0]
    ref = hf_greedy(model, prompt, 10)
    llm = LLM(model, max_num_batched_tokens=32, block_size=8)
    out = llm.generate([prompt], SamplingParams(n=4, max_tokens=10, temperature=0.0, ignore_eos=True))
    assert [c.token_ids for c in out[0].outputs] == [ref] * 4
    seeded = SamplingParams(n=3, max_tokens=10, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    forked = [c.token_ids for c in llm.generate([prompt], seeded, use_tqdm=False)[0].outputs]
    alone = LLM(model, max_num_batched_tokens=32, block_size=8, max_num_seqs=1, enable_prefix_caching=False)
    recomputed = [c.token_ids for c in alone.generate([prompt], seeded, use_tqdm=False)[0].outputs]
    assert forked == recomputed
    assert len({tuple(t) for t in forked}) > 1  # the samples differ: the check compares something
    all_free(llm)


def check_preemption(model) -> None:
    """A pool too small for every sequence preempts; resumed sequences recompute and stay exact."""
    batch = prompts([30, 34, 38, 42], seed=5)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    refs = [hf_greedy(model, p, 20) for p in batch]
    llm = LLM(model, max_num_batched_tokens=64, block_size=8, num_blocks=16, max_num_seqs=4)
    got = first_tokens(llm.generate(batch, params, use_tqdm=False))
    assert llm.stats.preemptions > 0
    compare(model, batch, got, refs, FP32)
    all_free(llm)
