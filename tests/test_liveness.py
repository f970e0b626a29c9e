"""Every request ends, within a bound, with the synchronous engine's outputs: the reproducers of
issue #15 as regression tests (tiny Llama, vocab 300, 2 layers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cbgen import LLM, SamplingParams
from oracle import hf_greedy
from tiny_models import make_model

G = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def m():
    return make_model("llama", vocab_size=300, hidden_size=64, max_position_embeddings=256)


def _drive(llm: LLM, max_steps: int) -> dict:
    outs = {}
    for _ in range(max_steps):
        if not llm.engine.has_unfinished():
            return outs
        outs.update({o.request_id: o for o in llm.engine.step() if o.finished})
    raise AssertionError(f"still unfinished after {max_steps} steps")


def _tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_group_larger_than_max_num_seqs_runs_in_waves(m, async_scheduling):
    llm = LLM(m, max_num_seqs=32, async_scheduling=async_scheduling)
    group = llm.engine.add_request(
        [5, 6, 7], SamplingParams(n=64, max_tokens=4, temperature=0.0, ignore_eos=True)
    )
    behind = llm.engine.add_request([8, 9], G)
    outs = _drive(llm, 200)
    ref = hf_greedy(m, [5, 6, 7], 4)
    assert [c.token_ids for c in outs[group].outputs] == [ref] * 64
    assert outs[behind].outputs[0].token_ids == hf_greedy(m, [8, 9], 4)
    # Waves share the prompt's cached blocks: the 3-token prompt is computed far fewer than 64 times.
    assert llm.stats.prompt_tokens_computed < 3 * 64
    assert llm.engine.block_manager.num_used_blocks == 0


def test_request_that_outgrows_the_cache_fails_without_prefix_caching(m):
    llm = LLM(m, num_blocks=4, block_size=8, max_num_batched_tokens=16, enable_prefix_caching=False)
    rid = llm.engine.add_request(
        list(range(10, 20)), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    )
    outs = _drive(llm, 100)
    c = outs[rid].outputs[0]
    assert c.finish_reason == "error" and "KV blocks" in outs[rid].error
    assert len(c.token_ids) == 32 - 10 + 1  # every token whose K/V fitted, plus the one sampled from it
    assert llm.engine.block_manager.num_used_blocks == 0


def _sync_vs_async(model, prompts, params, **kwargs):
    results = []
    for mode in (False, True):
        llm = LLM(model, async_scheduling=mode, **kwargs)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.block_manager.num_used_blocks == 0
        results.append(outs)
    sync, asyn = results
    for a, b in zip(sync, asyn):
        for ca, cb in zip(a.outputs, b.outputs):
            assert (cb.token_ids, cb.finish_reason) == (ca.token_ids, ca.finish_reason)
            assert cb.raw_logprobs == pytest.approx(ca.raw_logprobs, abs=1e-4)
    return sync


def test_async_when_every_running_request_is_preempted(m):
    params = [SamplingParams(max_tokens=3, temperature=0.0), SamplingParams(max_tokens=2, temperature=0.0)]
    _sync_vs_async(
        m,
        [[21], [27, 19, 26]],
        params,
        num_blocks=6,
        block_size=1,
        max_num_batched_tokens=2,
        enable_prefix_caching=False,
    )


def test_async_when_a_leader_is_preempted_before_its_fork(m):
    params = [
        SamplingParams(max_tokens=2, temperature=0.0),
        SamplingParams(n=3, max_tokens=2, temperature=0.0),
    ]
    outs = _sync_vs_async(
        m, [[7, 23], [19, 12]], params, num_blocks=4, block_size=1, max_num_batched_tokens=4
    )
    assert [c.token_ids for c in outs[1].outputs] == [hf_greedy(m, [19, 12], 2)] * 3


def test_async_error_finish_keeps_the_same_tokens(m):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outs = _sync_vs_async(
        m, [list(range(10, 20))], [params], num_blocks=4, block_size=8, enable_prefix_caching=False
    )
    assert outs[0].outputs[0].finish_reason == "error"


def test_prompt_logprobs_after_a_prefix_cache_hit(m):
    llm = LLM(m, block_size=8)
    prompt = list(range(10, 50))
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0)
    first = llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # cached now
    second = llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    assert len(first) == len(second) == 40 and first[0] is None and second[0] is None
    with torch.no_grad():
        logp = torch.log_softmax(m(torch.tensor([prompt])).logits[0].double(), -1)
    for pos in range(1, 40):
        assert list(second[pos]) == [prompt[pos]]
        assert second[pos][prompt[pos]] == pytest.approx(float(logp[pos - 1, prompt[pos]]), abs=1e-4)


def test_weight_change_restarts_a_group_whose_sample_already_finished():
    model = make_model("llama", vocab_size=300, seed=3)
    llm = LLM(model, max_num_batched_tokens=1)
    engine = llm.engine
    rid = engine.add_request(
        [11, 12, 13], SamplingParams(n=2, max_tokens=6, temperature=0.0, ignore_eos=True)
    )
    group = engine.groups[rid]
    # Sample 1 is held back until sample 0 finished, so the change lands between them.
    while not group.samples[0].is_finished:
        engine.step()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(-1.0)
    outs = _drive(llm, 500)
    ref = hf_greedy(model, [11, 12, 13], 6)
    assert [c.token_ids for c in outs[rid].outputs] == [ref, ref]
    assert outs[rid].weight_version == engine.weights.version == 1


def test_torch_backend_isolates_a_nan_in_a_padding_block(m):
    llm = LLM(m, attention_backend="torch", block_size=4, enable_prefix_caching=False)
    short, long = [5, 6], list(range(20, 50))
    ref = llm.generate([short, long], G, use_tqdm=False)
    # Block 0 held the first round's K/V and is free now; the second round takes never-used blocks
    # first, so only the padding of the block table (zeros) points at it.
    assert llm.engine.block_manager.blocks[0].ref_count == 0
    with torch.inference_mode():
        for cache in llm.engine.kv_cache.layers[0]:
            cache[0].fill_(float("nan"))
    got = llm.generate([short, long], G, use_tqdm=False)
    assert _tokens(got) == _tokens(ref)


# ---------------------------------------------------------------------- validation (item 9)
def test_stop_strings_need_a_tokenizer(m):
    llm = LLM(m)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=3, stop=["x"]), use_tqdm=False)


def test_numpy_integer_token_ids_are_accepted(m):
    llm = LLM(m)
    out = llm.generate([np.array([5, 6, 7], dtype=np.int64)], G, use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(m, [5, 6, 7], 4)
    out = llm.generate([[np.int32(5), np.int64(6), 7]], G, use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(m, [5, 6, 7], 4)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"logit_bias": {5.7: 1.0}},
        {"logit_bias": {True: 1.0}},
        {"logit_bias": {5: float("nan")}},
        {"logit_bias": {5: float("inf")}},
        {"max_tokens": True},
        {"seed": True},
        {"stop_token_ids": [True]},
        {"stop_token_ids": [3.0]},
    ],
)
def test_non_integer_and_non_finite_parameters_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_prompt_that_exactly_fills_the_cache_runs_with_max_tokens_1(m):
    llm = LLM(m, num_blocks=2, block_size=4)
    out = llm.generate([list(range(10, 18))], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(m, list(range(10, 18)), 1)


def test_two_dimensional_prompt_tensor_is_refused(m):
    llm = LLM(m)
    with pytest.raises(ValueError, match="1-D"):
        llm.generate([torch.tensor([[5, 6], [7, 8]])], G, use_tqdm=False)


def test_one_sample_of_a_group_can_be_aborted(m):
    llm = LLM(m)
    engine = llm.engine
    rid = engine.add_request([5, 6, 7], SamplingParams(n=3, max_tokens=6, temperature=0.0, ignore_eos=True))
    engine.step()
    assert engine.abort(f"{rid}#1") is None  # the group goes on
    outs = _drive(llm, 50)
    assert [c.finish_reason for c in outs[rid].outputs] == ["length", "abort", "length"]
    assert len(outs[rid].outputs[0].token_ids) == 6
    assert engine.block_manager.num_used_blocks == 0


def test_weight_change_after_a_sample_was_aborted_keeps_one_version_per_output():
    """Found by the fuzz soak: a sample aborted under the old weights kept its old tokens in a group
    restarted under the new ones, and the output's weight_version claimed the new version for both."""
    model = make_model("llama", vocab_size=300, seed=5)
    llm = LLM(model, block_size=1, max_num_seqs=1, max_num_batched_tokens=22, enable_prefix_caching=False)
    engine = llm.engine
    rid = engine.add_request([91, 41], SamplingParams(n=3, max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.abort(f"{rid}#0")
    engine.step()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(0.5)
    outs = _drive(llm, 200)
    ref = hf_greedy(model, [91, 41], 4)
    out = outs[rid]
    assert out.weight_version == 1
    assert [c.finish_reason for c in out.outputs] == ["abort", "length", "length"]
    assert [c.token_ids for c in out.outputs] == [[], ref, ref]
