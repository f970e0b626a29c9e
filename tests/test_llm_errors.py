"""Bad input gets a ValueError naming the problem; the engine keeps serving everyone else."""

from __future__ import annotations

import pytest

from cbgen import LLM, SamplingParams
from tiny_models import make_model, make_prompts


@pytest.fixture(scope="module")
def llm():
    return LLM(make_model("llama"), block_size=8, num_blocks=64)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "empty"),
        ([5] * 600, SamplingParams(), "longer than the model's context"),
        ([5, 512, 7], SamplingParams(), "outside the vocabulary"),
        ([5, -1, 7], SamplingParams(), "outside the vocabulary"),
    ],
)
def test_bad_prompt_rejected_while_others_finish(llm, prompt, params, message):
    good = llm.add_requests(make_prompts(2), SamplingParams(max_tokens=5, temperature=0))
    with pytest.raises(ValueError, match=message):
        llm.add_requests([prompt], params)
    done = llm.drive_until_empty()
    assert set(done) == set(good)
    assert all(len(done[g].outputs[0].token_ids) == 5 for g in good)
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_generate_rejects_whole_batch_before_running(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, 6], [99999]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.groups


def test_prompt_larger_than_cache_is_rejected():
    small = LLM(make_model("llama"), block_size=4, num_blocks=4)
    with pytest.raises(ValueError, match="KV blocks"):
        small.generate([list(range(3, 40))], SamplingParams(max_tokens=2), use_tqdm=False)


def test_request_outgrowing_cache_fails_with_reason_not_hang():
    small = LLM(make_model("llama"), block_size=4, num_blocks=4)
    outs = small.generate(
        [[5, 6, 7], [8, 9]], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), use_tqdm=False
    )
    for out in outs:
        assert out.finished
        # alone, each needs 11 blocks > 4: it must fail with a reason rather than loop forever
        assert out.outputs[0].finish_reason == "error"
        assert "KV blocks" in out.error
    assert small.engine.block_manager.num_used_blocks == 0


def test_vllm_prompt_dicts_are_taken_and_checked(llm):
    """vLLM's ``{"prompt_token_ids": ids}`` (and ``{"prompt": text}`` with a tokenizer) run like the
    plain forms; other keys and malformed dicts are refused by name, before anything runs."""
    ids = make_prompts(2)
    params = SamplingParams(max_tokens=4, temperature=0)
    plain = llm.generate(ids, params, use_tqdm=False)
    as_dicts = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in as_dicts] == [o.outputs[0].token_ids for o in plain]
    one = llm.generate({"prompt_token_ids": ids[0]}, params, use_tqdm=False)
    assert len(one) == 1 and one[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    for bad, message in [
        ({"prompt_token_ids": ids[0], "multi_modal_data": {}}, "multi_modal_data"),
        ({}, "exactly one"),
        ({"prompt": "hi", "prompt_token_ids": ids[0]}, "exactly one"),
        ({"prompt": 5}, "must be a string"),
        ({"prompt": "hi"}, "need a tokenizer"),  # this LLM has none
        ({"prompt_token_ids": [5, "x"]}, "not an integer"),
    ]:
        with pytest.raises(ValueError, match=message):
            llm.generate([ids[1], bad], params, use_tqdm=False)
    assert not llm.engine.groups
