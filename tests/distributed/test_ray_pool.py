"""EnginePool: two Ray actors give one engine's greedy outputs; an actor that dies mid-run fails
only its own requests, and the pool keeps serving with the other; bad input raises what
``LLM.generate`` raises, before anything runs."""

from __future__ import annotations

import pytest

from extras import require_extra

ray = require_extra("ray")

from cbgen import LLM, SamplingParams  # noqa: E402
from cbgen.distributed import EnginePool  # noqa: E402
from tiny_models import make_model, make_prompts  # noqa: E402

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ray") / "llama"
    make_model("llama", vocab_size=300).save_pretrained(path)
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=150 << 20, log_to_driver=False)
    yield path
    ray.shutdown()


def _reference(path, prompts):
    llm = LLM(str(path), block_size=8, tokenizer=False)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_two_actors_equal_one_engine(model_dir):
    prompts = make_prompts(24, lengths=(3, 40), vocab=300, seed=2)
    pool = EnginePool(2, str(model_dir), num_cpus=1, block_size=8, tokenizer=False)
    try:
        outs = pool.generate(prompts, GREEDY)
    finally:
        pool.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == _reference(model_dir, prompts)
    assert all(o.error is None for o in outs)


def test_a_dying_actor_fails_only_its_requests(model_dir):
    prompts = make_prompts(40, lengths=(3, 40), vocab=300, seed=3)
    ref = _reference(model_dir, prompts)
    pool = EnginePool(2, str(model_dir), num_cpus=1, block_size=8, tokenizer=False, chunk_size=2)
    # The victim dies as its first chunk is handed to it, so it certainly holds requests when it
    # dies; a timer raced the pool on fast machines (a 0.5 s timer found all work already done).
    victim = pool.actors[1]
    pool.actors[1] = _DiesAtFirstDispatch(victim)
    try:
        outs = pool.generate(prompts, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
        failed = [i for i, o in enumerate(outs) if o.error is not None]
        assert failed, "the killed actor held no request (the kill came too late?)"
        assert all(outs[i].outputs[0].finish_reason == "error" and "died" in outs[i].error for i in failed)
        long_ref = _reference_long(model_dir, prompts)
        for i, o in enumerate(outs):
            if i not in failed:
                assert o.outputs[0].token_ids == long_ref[i]
        assert pool.num_alive == 1
        again = pool.generate(prompts[:6], GREEDY)  # the pool keeps serving with the survivor
        assert [o.outputs[0].token_ids for o in again] == ref[:6]
    finally:
        pool.shutdown()


def _prompt_tokens_seen(pool) -> list[int]:
    """Prompt tokens each actor's engine has taken so far."""
    return ray.get([a.__ray_call__.remote(lambda actor: actor.llm.stats.prompt_tokens) for a in pool.actors])


def test_bad_input_raises_what_generate_raises_before_anything_runs(model_dir):
    prompts = make_prompts(4, lengths=(3, 10), vocab=300, seed=4)
    cases = {
        "params length": (prompts[:3], [GREEDY] * 2),
        "out of vocabulary": ([*prompts[:3], [5, 300, 6]], GREEDY),  # the last chunk's prompt
        "string without a tokenizer": ([*prompts[:3], "hello"], GREEDY),
        "not SamplingParams": (prompts, [GREEDY, GREEDY, GREEDY, {"max_tokens": 3}]),
    }
    local = LLM(str(model_dir), block_size=8, tokenizer=False)
    pool = EnginePool(2, str(model_dir), num_cpus=1, block_size=8, tokenizer=False, chunk_size=1)
    try:
        for case, (batch, params) in cases.items():
            with pytest.raises(Exception) as want:
                local.generate(batch, params, use_tqdm=False)
            with pytest.raises(Exception) as got:
                pool.generate(batch, params)
            assert type(got.value) is type(want.value) is ValueError, case
            assert str(got.value) == str(want.value), case
        assert _prompt_tokens_seen(pool) == [0, 0], "a chunk ran before the input was checked"
        assert [o.outputs[0].token_ids for o in pool.generate(prompts, GREEDY)] == _reference(
            model_dir, prompts
        )
    finally:
        pool.shutdown()


class _DiesAtFirstDispatch:
    """An actor handle whose actor is killed when the pool first submits work to it (the submitted
    chunks then fail as the work of a dying actor does)."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self.generate = self  # the pool calls actor.generate.remote(...)

    def remote(self, *args, **kwargs):
        ray.kill(self.handle)
        return self.handle.generate.remote(*args, **kwargs)


def _reference_long(path, prompts):
    llm = LLM(str(path), block_size=8, tokenizer=False)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
