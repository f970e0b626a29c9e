"""``LLM.drive_until_empty`` returns every request of the driver API by id, aborted ones included:
an abort made before the call or from ``on_step`` comes back as the output ``engine.abort`` returned
(the tokens generated so far, ``finish_reason == "abort"``), once."""

from __future__ import annotations

import pytest

from cbgen import LLM, SamplingParams
from tiny_models import make_model, make_prompts

LONG = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return make_model("llama")


def _llm(model) -> LLM:
    return LLM(model, block_size=8, num_blocks=128)


def test_aborted_requests_come_back_with_their_partial_output(model):
    prompts = make_prompts(4, lengths=(5, 20), seed=3)
    whole = [o.outputs[0].token_ids for o in _llm(model).generate(prompts, LONG, use_tqdm=False)]
    llm = _llm(model)
    ids = llm.add_requests(prompts, LONG)
    for _ in range(4):
        llm.engine.step()
    before = llm.engine.abort(ids[1])  # between steps, before the drive
    during = {}

    def on_step(step: int, stats) -> None:
        if ids[2] not in during and step >= 9:
            during[ids[2]] = llm.engine.abort(ids[2])  # from inside the drive

    done = llm.drive_until_empty(on_step=on_step)
    assert set(done) == set(ids)
    for rid, returned in ((ids[1], before), (ids[2], during[ids[2]])):
        out = done[rid].outputs[0]
        assert done[rid].finished and out.finish_reason == "abort"
        assert out.token_ids == returned.outputs[0].token_ids
        assert 0 < len(out.token_ids) < LONG.max_tokens  # a partial output, not an empty one
        assert out.token_ids == whole[ids.index(rid)][: len(out.token_ids)]
    for i in (0, 3):
        out = done[ids[i]].outputs[0]
        assert out.finish_reason == "length" and out.token_ids == whole[i]
    assert llm.drive_until_empty() == {}  # each output is handed out once


def test_group_and_sample_aborts_of_n_gt_1(model):
    prompts = make_prompts(2, lengths=(6, 12), seed=4)
    params = SamplingParams(n=2, max_tokens=20, temperature=1.0, seed=7, ignore_eos=True)
    llm = _llm(model)
    group, other = llm.add_requests(prompts, params)
    for _ in range(3):
        llm.engine.step()
    llm.engine.abort(group)  # the whole group
    assert llm.engine.abort(f"{other}#1") is None  # one sample: the group's output comes at its end
    done = llm.drive_until_empty()
    assert [c.finish_reason for c in done[group].outputs] == ["abort", "abort"]
    assert [c.finish_reason for c in done[other].outputs] == ["length", "abort"]
    assert all(0 < len(c.token_ids) < params.max_tokens for c in done[group].outputs)


def test_an_aborted_streamed_request_is_left_to_its_stream(model):
    llm = _llm(model)
    rid = llm.engine.add_request(make_prompts(1, lengths=(8, 8), seed=5)[0], LONG, stream=True)
    llm.engine.step()
    assert llm.engine.abort(rid).finished
    (kept,) = llm.add_requests(make_prompts(1, lengths=(8, 8), seed=6), LONG)
    assert set(llm.drive_until_empty()) == {kept}


def test_an_unknown_or_finished_id_adds_nothing(model):
    llm = _llm(model)
    (rid,) = llm.add_requests(make_prompts(1, lengths=(8, 8), seed=7), LONG)
    assert set(llm.drive_until_empty()) == {rid}
    assert llm.engine.abort(rid) is None and llm.engine.abort("nope") is None
    assert llm.drive_until_empty() == {}
