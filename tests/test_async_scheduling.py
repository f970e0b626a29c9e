"""Overlap (async) scheduling: step N+1 is launched before step N's tokens are read back.

On CPU nothing actually overlaps, but the bookkeeping is the same as on CUDA: pending tokens that
are not in ``token_ids`` yet, inputs patched from the previous step's device tokens, stop checks
one step late, and tokens sampled past a stop dropped.  The oracle is the synchronous engine (and ``generate()``).
"""

from __future__ import annotations

import pytest
import torch

from cbgen import LLM, SamplingParams
from cbgen.core.cache_pools import BlockCopy
from oracle import compare, hf_greedy
from tiny_models import make_model, make_prompts

GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama():
    return make_model("llama")


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_greedy_matches_generate_with_preemption_and_chunks(arch):
    model = make_model(arch)
    prompts = make_prompts(10, lengths=(3, 70))
    refs = [hf_greedy(model, p, 30) for p in prompts]
    llm = LLM(model, block_size=8, num_blocks=30, max_num_batched_tokens=32, async_scheduling=True)
    assert llm.engine.async_scheduling
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.stats.preemptions > 0
    compare(model, prompts, [o.outputs[0].token_ids for o in outs], refs)
    assert llm.engine.block_manager.num_used_blocks == 0


def _mixed_params(i: int, vocab: int = 512) -> SamplingParams:
    kinds = [
        dict(temperature=0.0, max_tokens=5 + i % 17),
        dict(temperature=0.9, top_p=0.9, seed=i, max_tokens=25, stop_token_ids=list(range(20, 60))),
        dict(
            temperature=1.0, top_k=20, seed=i, max_tokens=20, min_tokens=4, stop_token_ids=list(range(3, 40))
        ),
        dict(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.4, seed=i, max_tokens=18),
        dict(temperature=0.7, n=3, seed=i, max_tokens=12, logprobs=3, stop_token_ids=list(range(60, 100))),
        dict(temperature=0.0, max_tokens=9, prompt_logprobs=2, logprobs=2),
        dict(temperature=1.0, seed=i, max_tokens=16, logits_processor_args={"bad_words": [[5], [6, 7]]}),
    ]
    return SamplingParams(**kinds[i % len(kinds)])


def test_mixed_workload_identical_to_synchronous(llama):
    """Seeded sampling, stops, min_tokens, penalties, n>1, logprobs and prompt logprobs: every field of
    every output equals the synchronous engine's, so no token past a stop is ever emitted."""
    prompts = make_prompts(28, lengths=(2, 60), seed=3)
    params = [_mixed_params(i) for i in range(len(prompts))]
    results = {}
    for mode in (False, True):
        llm = LLM(llama, block_size=8, num_blocks=60, max_num_batched_tokens=48, async_scheduling=mode)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[mode] = (outs, llm.stats)
        assert llm.engine.block_manager.num_used_blocks == 0
    sync, asyn = results[False][0], results[True][0]
    stopped = 0
    for a, b in zip(sync, asyn):
        assert [d and sorted(d) for d in a.prompt_logprobs or []] == [
            d and sorted(d) for d in b.prompt_logprobs or []
        ]
        for ca, cb in zip(a.outputs, b.outputs):
            assert cb.token_ids == ca.token_ids
            assert cb.finish_reason == ca.finish_reason and cb.stop_reason == ca.stop_reason
            # Batches differ by the rows sampled past a stop, which moves matmul rounding a little.
            assert cb.token_logprobs == pytest.approx(ca.token_logprobs, abs=1e-4)
            assert cb.raw_logprobs == pytest.approx(ca.raw_logprobs, abs=1e-4)
            assert [sorted(d) for d in cb.top_logprobs or []] == [sorted(d) for d in ca.top_logprobs or []]
            assert all(t >= 0 for t in cb.token_ids)
            stopped += cb.finish_reason == "stop"
    assert stopped >= 5  # the stop-token kinds did stop early, so the lag was exercised
    # Tokens sampled after a stop were computed but never counted as generated.
    assert results[True][1].generated_tokens == results[False][1].generated_tokens


def test_steps_really_defer_and_stream_has_no_placeholders(llama):
    llm = LLM(llama, block_size=8, async_scheduling=True)
    engine = llm.engine
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=list(range(3, 60)))
    ids = [engine.add_request(p, params, stream=True) for p in make_prompts(6, seed=5)]
    seen: dict[str, list[int]] = {i: [] for i in ids}
    finished: dict[str, list[int]] = {}
    deferred_steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            delta = out.outputs[0].token_ids
            assert all(t >= 0 for t in delta)
            seen[out.request_id].extend(delta)
            if out.finished:
                finished[out.request_id] = seen[out.request_id]
        deferred_steps += engine.in_flight is not None
    assert deferred_steps > 0
    assert set(finished) == set(ids)
    for tokens in finished.values():
        stops = [t for t in tokens if 3 <= t < 60]
        # at most one stop token, and only as the last token
        assert len(stops) <= 1 and (not stops or tokens[-1] == stops[0])
    assert engine.block_manager.num_used_blocks == 0


def test_abort_while_a_token_is_in_flight(llama):
    llm = LLM(llama, block_size=8, async_scheduling=True)
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in make_prompts(4, seed=9)]
    for _ in range(4):
        engine.step()
    victim = engine.groups[ids[1]].samples[0]
    assert victim.pending  # its newest token is still on the device
    out = engine.abort(ids[1])
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert len(out.outputs[0].token_ids) == victim.num_output_tokens and all(
        t >= 0 for t in out.outputs[0].token_ids
    )
    rest = {}
    while engine.has_unfinished():
        rest.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(rest) == {ids[0], ids[2], ids[3]}
    assert all(len(o.outputs[0].token_ids) == 30 for o in rest.values())
    assert engine.block_manager.num_used_blocks == 0


def test_greedy_n_samples_fork_from_one_prefill(llama):
    prompts = make_prompts(3, lengths=(5, 40), seed=11)
    refs = [hf_greedy(llama, p, 20) for p in prompts]
    llm = LLM(llama, block_size=8, async_scheduling=True)
    outs = llm.generate(
        prompts, SamplingParams(n=4, max_tokens=20, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    for out, ref in zip(outs, refs):
        assert all(c.token_ids == ref for c in out.outputs)
    assert llm.stats.prompt_tokens_computed == sum(len(p) for p in prompts)


def test_weight_update_between_rounds_with_tokens_in_flight():
    model = make_model("llama", seed=4)
    prompts = make_prompts(5, seed=2)
    llm = LLM(model, block_size=8, async_scheduling=True)
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    for _ in range(3):
        engine.step()
    assert engine.in_flight is not None
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    refs = [hf_greedy(model, p, 30) for p in prompts]
    # Non-streamed requests restart under the new weights: each output comes from one version.
    compare(model, prompts, [outs[i].outputs[0].token_ids for i in ids], refs)
    assert all(outs[i].weight_version == engine.weights.version for i in ids)


def test_next_step_is_built_before_this_one_samples(llama):
    """The order that lets the CPU work overlap the device: launch forward N, apply N-1, schedule and
    build N+1, then sample N; N+1's inputs come from N's device tokens."""
    llm = LLM(llama, block_size=8, async_scheduling=True)
    engine = llm.engine
    for p in make_prompts(4, seed=13):
        engine.add_request(p, GREEDY)
    sampler, build = engine.sampler, engine.input_builder.build
    seen, counts = [], {"build": 0, "sample": 0}

    def count_builds(*args, **kwargs):
        counts["build"] += 1
        return build(*args, **kwargs)

    def spy(logits, requests):
        # Step N's own build plus step N+1's, before N samples.
        seen.append(counts["build"] >= counts["sample"] + 2)
        counts["sample"] += 1
        return sampler(logits, requests)

    engine.input_builder.build = count_builds
    engine.sampler = spy
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    assert all(len(o.outputs[0].token_ids) == 30 for o in outs)
    # Every step that sampled while more work remained had the next batch ready first.
    assert sum(seen) >= 25 and seen[-1] is False


# ---------------------------------------------------------------------------------------------- the step as a value
def _run_outputs(engine, drive) -> list[list[tuple]]:
    """Per step: (request id, token ids per sample, finish reasons) of every output."""
    steps = []
    while engine.has_unfinished():
        steps.append(
            [
                (o.request_id, [c.token_ids for c in o.outputs], [c.finish_reason for c in o.outputs])
                for o in drive()
            ]
        )
    return steps


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_in_flight_value_is_all_a_step_carries(llama, async_scheduling):
    """Driving ``_step`` by hand, passing each result's ``in_flight`` to the next call and never
    setting the engine's attribute, gives exactly what ``step()`` gives."""
    stops = SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=list(range(3, 40)))
    forks = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    prompts = make_prompts(5, lengths=(3, 30), seed=21)
    engines = []
    for _ in range(2):
        engine = LLM(llama, block_size=8, num_blocks=24, async_scheduling=async_scheduling).engine
        for i, p in enumerate(prompts):
            engine.add_request(p, forks if i % 2 else stops, request_id=f"r{i}", stream=i == 0)
        engines.append(engine)
    by_step, by_value = engines
    carried = {"in_flight": None}

    def by_hand():
        result = by_value._step(carried["in_flight"])
        assert by_value.in_flight is None  # nothing was left on the engine
        carried["in_flight"] = result.in_flight
        return result.outputs

    assert _run_outputs(by_value, by_hand) == _run_outputs(by_step, by_step.step)
    assert by_value.block_manager.num_used_blocks == 0


def _record_copies_and_forwards(engine) -> list[tuple]:
    events: list[tuple] = []
    copy, execute = engine.kv_cache.copy_blocks, engine.runner.execute

    def copy_blocks(pairs):
        if pairs:
            events.append(("copy", list(pairs)))
        return copy(pairs)

    def forward(batch):
        events.append(("forward",))
        return execute(batch)

    engine.kv_cache.copy_blocks = copy_blocks
    engine.runner.execute = forward
    return events


def test_fork_copies_travel_on_the_next_plan_with_overlap(llama):
    prompt = list(range(10, 22))  # 12 tokens in blocks of 8: the tail block is partial, so forks copy it
    llm = LLM(llama, block_size=8, async_scheduling=True)
    engine = llm.engine
    rid = engine.add_request(prompt, SamplingParams(n=3, max_tokens=6, temperature=0.0, ignore_eos=True))
    events = _record_copies_and_forwards(engine)
    outs = []
    while not (engine.in_flight and engine.in_flight.next and engine.in_flight.next.copies):
        outs += engine.step()
    group = engine.groups[rid]
    leader, followers = group.samples[0], group.samples[1:]
    carried = engine.in_flight.next.copies
    # Each follower's copy of the leader's partial tail block; nothing performed them yet.
    assert carried == [BlockCopy(leader.block_ids[1], f.block_ids[1]) for f in followers]
    assert all(e[0] == "forward" for e in events)
    events.clear()
    outs += engine.step()
    assert events[:2] == [("copy", carried), ("forward",)]  # the launch that carries them, first
    while engine.has_unfinished():
        outs += engine.step()
    (out,) = [o for o in outs if o.finished]
    assert [c.token_ids for c in out.outputs] == [hf_greedy(llama, prompt, 6)] * 3


def test_fork_copies_of_a_synchronous_step_are_done_before_the_next_forward(llama):
    prompt = list(range(10, 22))
    llm = LLM(llama, block_size=8, async_scheduling=False)
    engine = llm.engine
    rid = engine.add_request(prompt, SamplingParams(n=3, max_tokens=6, temperature=0.0, ignore_eos=True))
    events = _record_copies_and_forwards(engine)
    result = engine._step(None)  # prefill, sample, apply: the followers fork
    group = engine.groups[rid]
    leader, followers = group.samples[0], group.samples[1:]
    assert result.in_flight is None and result.plan.copies == []
    assert events == [
        ("forward",),
        ("copy", [BlockCopy(leader.block_ids[1], f.block_ids[1]) for f in followers]),
    ]


def test_a_partial_prefix_hit_copy_is_carried_by_the_plan_that_admits_it(llama):
    llm = LLM(llama, block_size=8, async_scheduling=False)
    engine = llm.engine
    first = list(range(10, 26))  # two full blocks, published once computed
    llm.generate([first], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    second = [*first[:12], 90, 91, 92, 93]  # its second block starts with 4 tokens of the first's
    rid = engine.add_request(second, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    events = _record_copies_and_forwards(engine)
    result = engine._step(None)
    request = engine.groups[rid].samples[0]
    ((src, dst, group),) = result.plan.copies
    assert dst == request.block_ids[1] and src != dst and group == 0
    assert events[:2] == [("copy", [BlockCopy(src, dst)]), ("forward",)]
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    assert outs[rid].outputs[0].token_ids == hf_greedy(llama, second, 4)
