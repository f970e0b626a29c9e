"""Models with linear-attention, state-space and convolution layers, through the real engine, held
to ``generate()`` by the oracle: one tiny model per mixer kind (tests/tiny_models.py STATE_KINDS),
under random budgets, prefix hits, forks, preemption, aborts and overlap scheduling."""

from __future__ import annotations

import pytest
import torch

from cbgen import LLM, SamplingParams
from cbgen.model.support import UnsupportedModelError
from engine_cases import GREEDY, check_forks, check_preemption, check_random_budgets, one_by_one
from engine_cases import all_free as _all_free
from engine_cases import first_tokens as _tokens
from engine_cases import prompts as _prompts
from oracle import FP32, compare, hf_greedy
from tiny_models import STATE_KINDS, make_state_model, make_wide_state_model

KINDS = sorted(STATE_KINDS)
_MODELS: dict[str, torch.nn.Module] = {}


def _model(kind: str) -> torch.nn.Module:
    if kind not in _MODELS:
        _MODELS[kind] = make_state_model(kind)
    return _MODELS[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_generate_under_random_budgets(kind):
    """Chunked prefill under random budgets and block sizes, prompts from shorter than a block to
    several mixer chunks, mixed prefill and decode rows in the steps."""
    check_random_budgets(_model(kind), kind, [3, 9, 40, 70, 150])


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_hits_restore_the_state(kind):
    """The same prompt twice hits; prompts sharing a prefix up to a grid point (aligned) or past one
    (unaligned) hit at the grid point; a prompt shorter than a block works; all exact.  The budget
    is one grid step, so every prompt chunk ends on the grid and leaves a checkpoint."""
    model = _model(kind)
    grid = LLM(model, block_size=8).engine.scheduler.block_manager.checkpoints.grid
    llm = LLM(model, max_num_batched_tokens=grid, block_size=8)
    base = _prompts([2 * grid + 5], seed=2)[0]
    tail = _prompts([6], seed=3)[0]
    prompts = [base, base, base[:grid] + tail, base[: grid + 3] + tail, tail[:3]]
    refs = [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    got, hits = one_by_one(llm, prompts)
    compare(model, prompts, got, refs, FP32)
    # The resubmission resumes at the prompt's last grid point; the others at the shared grid point.
    assert hits == [0, 2 * grid, grid, grid, 0], hits
    _all_free(llm)


@pytest.mark.parametrize("kind", KINDS)
def test_n_samples_fork_the_state(kind):
    """n > 1 shares one prefill and copies the state at the fork (engine_cases.check_forks)."""
    check_forks(_model(kind))


@pytest.mark.parametrize("kind", KINDS)
def test_preemption_then_resume_is_exact(kind):
    """A pool too small for every sequence preempts; the resumed ones prefill their prompt and
    replay their generated tokens in decode form, exactly as an unpreempted run."""
    check_preemption(_model(kind))


@pytest.mark.parametrize("kind", ["gdn", "mamba2"])
def test_aborts_free_the_state_and_others_go_on(kind):
    """Aborts mid-prefill and mid-decode free their blocks and slots; the other requests stay exact."""
    model = _model(kind)
    prompts = _prompts([100, 20, 25], seed=6)
    llm = LLM(model, max_num_batched_tokens=32, block_size=8)
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    engine.step()  # the long prompt is mid-prefill, the others started
    assert engine.abort(ids[0]) is not None
    for _ in range(4):
        engine.step()  # the second prompt decodes
    assert engine.abort(ids[1]) is not None
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done[ids[2]] == hf_greedy(model, prompts[2], GREEDY.max_tokens)
    _all_free(llm)


@pytest.mark.parametrize("kind", ["gdn", "hybrid_layer"])
def test_overlap_scheduling_is_exact(kind):
    """Overlap (async) scheduling, n > 1 included: a leader already decoding when its followers fork
    sends them to compute the prompt themselves, and every sample stays exact."""
    model = _model(kind)
    prompts = _prompts([12, 50, 80], seed=8)
    refs = [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    llm = LLM(model, max_num_batched_tokens=40, block_size=8, async_scheduling=True)
    got = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    compare(model, prompts, got, refs, FP32)
    params = SamplingParams(n=3, max_tokens=8, temperature=0.0, ignore_eos=True)
    out = llm.generate([prompts[1]], params, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [refs[1][:8]] * 3
    _all_free(llm)


def test_generation_leaves_the_model_as_it_was():
    """The engine reaches the mixers through a cache object only: the model's own forward gives the
    same logits after generation, and no module holds state the engine left."""
    model = _model("gdn")
    ids = torch.tensor([_prompts([20], seed=9)[0]])
    with torch.no_grad():
        before = model(ids).logits
    attrs = {name: set(vars(m)) for name, m in model.named_modules()}
    LLM(model, block_size=8).generate(_prompts([30, 70], seed=10), GREEDY, use_tqdm=False)
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(before, after)
    assert {name: set(vars(m)) for name, m in model.named_modules()} == attrs


def test_parity_mode_is_refused_with_the_reason():
    with pytest.raises(UnsupportedModelError, match="recurrent form"):
        LLM(_model("gdn"), batch_invariant=True)


def test_info_shows_the_state_groups():
    llm = LLM(_model("gdn"), block_size=8)
    layout = llm.engine.runner.plan.cache
    text = layout.describe()
    assert "state conv0" in text and "state recurrent0" in text and "multiples of 64" in text
    report = llm.engine.runner.plan.report()  # what `cbgen info` prints
    assert "MiB of state a sequence" in report and "state recurrent0" in report
    pools = llm.engine.scheduler.block_manager
    # Slots for running sequences and as many checkpoints, charged to the cache's memory.
    assert llm.engine.kv_cache.num_slots == pools.slots.num_slots + pools.checkpoints.capacity
    per_slot = layout.bytes_per_slot()
    assert llm.engine.kv_cache.nbytes >= (llm.engine.kv_cache.num_slots + 1) * per_slot


def test_a_wide_hybrid_runs_its_projections_packed_and_exact():
    """Projections over the packing threshold run the plan's packed GEMMs in the module forward (on
    the engine's thread only); greedy tokens still equal generate() through chunked prefill, a
    prefix hit and n > 1, and the model's own forward is untouched on this thread afterwards."""
    model = make_wide_state_model()
    llm = LLM(model, max_num_batched_tokens=64, block_size=16)
    runner = llm.engine.runner
    assert runner.state_linears is not None and runner.plan.gemms.packs
    assert len(runner._projections) >= 8  # every decoder projection and the LM head
    prompts = _prompts([20, 100, 150], seed=11)
    prompts.append([*prompts[2][:128], 7, 8, 9])  # a hit at the checkpoint at 128
    refs = [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    got = _tokens(llm.generate(prompts[:3], GREEDY, use_tqdm=False))
    before = llm.stats.prefix_cache_hits
    got += _tokens(llm.generate(prompts[3:], GREEDY, use_tqdm=False))
    assert llm.stats.prefix_cache_hits - before == 128
    compare(model, prompts, got, refs, FP32)
    forked = llm.generate([prompts[1]], SamplingParams(n=3, max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [c.token_ids for c in forked[0].outputs] == [refs[1][:8]] * 3
    assert all("forward" not in vars(m) for m in runner._projections)
