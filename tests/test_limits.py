"""Request limits, worked out once (``cbgen.limits``): the arithmetic, and the engine, the async front
end and the server agreeing on it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import cbgen.limits
from cbgen import LLM, SamplingParams
from cbgen.limits import RequestLimits, request_work
from tiny_models import make_model

# 100 tokens of context, a cache of 6 blocks of 8 tokens (48 tokens).
LIM = RequestLimits(max_model_len=100, block_size=8, num_blocks=6)


def test_the_module_needs_nothing_but_the_standard_library():
    tree = ast.parse(Path(cbgen.limits.__file__).read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "dataclasses"}


def test_kv_fit_counts_whole_blocks():
    assert LIM.kv_tokens == 48
    assert [LIM.blocks_for(n) for n in (0, 1, 8, 9, 48, 49)] == [0, 1, 1, 2, 6, 7]
    assert LIM.fits_kv(48) and not LIM.fits_kv(49)


@pytest.mark.parametrize(
    ("prompt", "default", "cap", "expected"),
    [
        (10, None, None, 38),  # the cache leaves 38 tokens (the context would leave 90)
        (10, 16, None, 16),  # a default below both
        (10, 16, 5, 5),  # the server's cap below everything
        (48, None, None, 1),  # a prompt that fills the cache still generates one token
    ],
)
def test_default_max_tokens_is_what_context_cache_default_and_cap_leave(prompt, default, cap, expected):
    assert LIM.default_max_tokens(prompt, default, cap) == expected


def test_default_max_tokens_within_a_short_context():
    short = RequestLimits(max_model_len=20, block_size=8, num_blocks=6)
    assert short.default_max_tokens(10) == 10 and short.context_room(10) == 10


def test_max_tokens_of_caps_a_requested_length_at_the_context_only():
    assert LIM.max_tokens_of(10, None) == 38
    assert LIM.max_tokens_of(10, 60) == 60  # past the cache: the scheduler fails it if it gets there
    assert LIM.max_tokens_of(10, 500) == 90  # generation stops at the end of the context anyway


def test_work_is_n_times_prompt_plus_max_tokens():
    assert request_work(3, 10, 20) == 90
    assert LIM.work(3, 10, 20) == 90
    assert LIM.work(2, 10, None) == 2 * (10 + 38)
    assert LIM.work(1, 10, 500) == 100
    assert LIM.max_work(4) == 400


def test_check_prompt_names_the_context_and_the_cache():
    LIM.check_prompt(48)
    assert LIM.max_prompt_tokens == 99
    with pytest.raises(ValueError, match="KV blocks"):
        LIM.check_prompt(49)
    big = RequestLimits(max_model_len=100, block_size=8, num_blocks=100)
    big.check_prompt(99)
    with pytest.raises(ValueError, match="longer than the model's context"):
        big.check_prompt(100)


# ---------------------------------------------------------------------------------------------- one rule, three layers
@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(make_model("llama"), block_size=4, num_blocks=4)


def test_the_engine_runs_a_request_with_the_limits_max_tokens(llm):
    engine = llm.engine
    lim = engine.request_limits
    assert (lim.max_model_len, lim.block_size, lim.num_blocks) == (engine.max_model_len, 4, 4)
    unnamed = engine.add_request([5, 6, 7], SamplingParams(max_tokens=None, min_tokens=20, ignore_eos=True))
    long = engine.add_request([5, 6, 7], SamplingParams(max_tokens=10_000, ignore_eos=True))
    assert engine.groups[unnamed].samples[0].max_tokens == lim.max_tokens_of(3, None) == 13
    assert engine.groups[unnamed].samples[0].params.min_tokens == 13
    assert engine.groups[long].samples[0].max_tokens == lim.max_tokens_of(3, 10_000) == lim.context_room(3)
    engine.abort(long)
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    # An unnamed length stops where the cache ends instead of failing there.
    assert outs[unnamed].outputs[0].finish_reason == "length"
    assert len(outs[unnamed].outputs[0].token_ids) == 13


def test_async_admission_counts_the_work_the_engine_will_run(llm):
    from cbgen.async_engine import AsyncEngine

    ae = AsyncEngine(llm)
    try:
        lim = ae.request_limits
        assert lim is llm.engine.request_limits
        for params in (SamplingParams(n=2, max_tokens=None), SamplingParams(n=3, max_tokens=10_000)):
            assert ae.work_of(3, params) == lim.work(params.n, 3, params.max_tokens)
        assert ae.work_of(3, SamplingParams(n=2, max_tokens=5)) == 16
    finally:
        ae.shutdown(timeout=30)


def test_the_server_resolves_max_tokens_with_the_same_rule(llm):
    from cbgen.async_engine import AsyncEngine
    from cbgen.server.errors import APIError
    from cbgen.server.state import ServerLimits, ServerState
    from cbgen.server.translate import resolve_max_tokens

    ae = AsyncEngine(llm)
    try:
        state = ServerState(ae, None, "tiny", ServerLimits(max_tokens_limit=8, max_n=2))
        lim = state.request_limits
        assert lim is llm.engine.request_limits
        assert (
            resolve_max_tokens(state, None, None, 3, "max_tokens") == lim.default_max_tokens(3, None, 8) == 8
        )
        assert resolve_max_tokens(state, None, 4, 3, "max_tokens") == 4
        assert resolve_max_tokens(state, None, None, 12, "max_tokens") == lim.default_max_tokens(12) == 4
        assert state.max_request_work == lim.max_work(2)
        with pytest.raises(APIError, match="KV-cache blocks"):
            resolve_max_tokens(state, 6, None, 12, "max_tokens")  # 18 tokens > 16 in the cache
    finally:
        ae.shutdown(timeout=30)
