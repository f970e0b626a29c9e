"""An LLM its caller drops is freed at once, with its engine, KV cache and packed weights.

Why: a reference cycle through the engine keeps all it holds (a KV cache of up to 2 GiB by default
on CPU, packed copies of the weights) until Python's cycle collector happens to run, and large
tensors do not prompt it: a process that built one SmolLM2 engine after another (a sweep, a
notebook, RL code that makes one per round) grew by ~3.7 GB per engine until it was killed."""

from __future__ import annotations

import gc
import weakref

import pytest

from cbgen import LLM, SamplingParams
from tiny_models import make_model, make_prompts, make_wide_model

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
def test_a_dropped_llm_is_freed_without_the_cycle_collector(wide: bool) -> None:
    """Plain reference counting frees it: the engine, a KV cache tensor and the thread governor
    are gone right after ``del``, with the cycle collector off.  The wide model takes the fused CPU
    forward with its packed GEMM weights where the C kernels are built."""
    model = make_wide_model("llama") if wide else make_model("llama")
    prompts = make_prompts(3, lengths=(5, 20), seed=1)
    gc.collect()
    gc.disable()
    try:
        llm = LLM(model, block_size=8, num_blocks=64)
        assert len(llm.generate(prompts, GREEDY, use_tqdm=False)) == 3
        # An abort goes through the engine's on_abort hook into the LLM's outputs.
        rid = llm.add_requests(prompts[:1], SamplingParams(max_tokens=20, ignore_eos=True))[0]
        llm.engine.step()
        llm.engine.abort(rid)
        assert llm.drive_until_empty()[rid].outputs[0].finish_reason == "abort"
        engine = weakref.ref(llm.engine)
        cache = weakref.ref(llm.engine.kv_cache.layers[0][0])
        governor = weakref.ref(llm.engine.threads)
        del llm
        assert engine() is None, "the engine outlived its LLM (a reference cycle)"
        assert cache() is None, "the KV cache outlived its LLM"
        assert governor() is None, "the thread governor outlived its LLM"
    finally:
        gc.enable()


def test_control_handles_taken_at_any_time_see_the_same_engine() -> None:
    """``engine.control`` is made on each access (kept, it would make a cycle): a handle taken
    before a request was added sees it, as does a new one, and both see it end."""
    llm = LLM(make_model("llama"), block_size=8, num_blocks=64)
    early = llm.engine.control
    assert not early.has_runnable_work()
    llm.add_requests(make_prompts(1, lengths=(5, 6), seed=2), GREEDY)
    assert early.has_runnable_work() and llm.engine.control.has_runnable_work()
    assert early.snapshot().num_blocks == llm.engine.control.snapshot().num_blocks == 64
    llm.drive_until_empty()
    assert not early.has_runnable_work() and not llm.engine.control.has_runnable_work()
