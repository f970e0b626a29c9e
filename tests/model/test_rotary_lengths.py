"""Rotary types whose frequencies depend on the sequence length (longrope, dynamic NTK,
``cbgen.model.rotary``): every request equals ``generate()`` on it alone however the batch is made
up (decoding past the switch, prompts on both sides of it, chunked prefill, prefix-cache hits,
preemption), on the module forward and the fused one, and the module's own buffer updates are not
weight changes.  (Before: once a sequence passed ``original_max_position_embeddings`` the engine
counted the longrope module's buffer flip as a weight change, restarted every request, and the
restarted short prefill flipped it back, forever.)"""

from __future__ import annotations

import copy

import pytest
import torch

from cbgen import LLM, SamplingParams
from cbgen.model import facts as facts_module
from cbgen.model.rotary import length_rotary
from cbgen.model.support import UnsupportedModelError
from tiny_models import make_model, make_prompts, make_wide_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ORIGINAL = 32  # original_max_position_embeddings of the test models


def _longrope(head_dim: int) -> dict:
    half = head_dim // 2
    return {
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0 + 0.05 * i for i in range(half)],
            "long_factor": [1.5 + 0.4 * i for i in range(half)],
        },
        "original_max_position_embeddings": ORIGINAL,
        "max_position_embeddings": 512,
    }


def phi3_longrope() -> torch.nn.Module:
    """A Phi-3-mini-128k-style model (longrope) whose switch is at 32 tokens."""
    return make_model("phi3", **_longrope(16))


def llama_longrope_wide() -> torch.nn.Module:
    return make_wide_model("llama", **_longrope(64))


def llama_dynamic() -> torch.nn.Module:
    """Dynamic NTK past ``max_position_embeddings`` (32); engines built on it pass ``max_model_len``."""
    return make_model(
        "llama", rope_scaling={"type": "dynamic", "factor": 2.0}, max_position_embeddings=ORIGINAL
    )


def _generate_alone(fresh: torch.nn.Module, prompt: list[int], max_new: int) -> list[int]:
    """``generate()`` on a copy of the model as loaded: a dynamic rotary module keeps the largest set
    it has grown to, so each reference starts from the module's initial state."""
    model = copy.deepcopy(fresh)
    model.generation_config.eos_token_id = None  # as ignore_eos: EOS may be drawn and does not stop
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt) :].tolist()


def _prompts(vocab: int) -> list[list[int]]:
    """Prompts on both sides of the switch, and one that decodes across it."""
    return make_prompts(6, (6, 45), vocab=vocab, seed=11) + make_prompts(1, (28, 28), vocab=vocab, seed=12)


@pytest.mark.parametrize(
    "build",
    [phi3_longrope, llama_longrope_wide, llama_dynamic],
    ids=["phi3-longrope-module", "llama-longrope-fused", "llama-dynamic"],
)
def test_requests_equal_generate_alone_across_the_switch(build) -> None:
    model = build()
    fresh = copy.deepcopy(model)
    # Small budgets: prompts are chunked, and a short request's decode rows share steps with a long
    # prompt's chunks (one forward whose longest position is past the switch).
    llm = LLM(model, seed=0, max_num_batched_tokens=24, block_size=8, max_model_len=256)
    assert llm.engine.length_rotary is not None
    prompts = _prompts(model.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    crossed = 0
    for prompt, out in zip(prompts, outs, strict=True):
        got = out.outputs[0].token_ids
        assert got == _generate_alone(fresh, prompt, 12), f"prompt of {len(prompt)} tokens"
        crossed += len(prompt) <= ORIGINAL < len(prompt) + len(got)
    assert crossed >= 2
    assert llm.weight_version == 0
    assert llm.engine.stats.prefix_cache_resets == 0


def test_prefix_hits_do_not_mix_frequency_sets() -> None:
    """A long prompt that starts with a short one's tokens: the short one's cached blocks hold K/V
    under the short set, the long one needs the long set for the same positions, so it must not
    take them (the prefix-cache salt); a second short prompt does take them."""
    model = phi3_longrope()
    fresh = copy.deepcopy(model)
    llm = LLM(model, seed=0, block_size=8)
    short = make_prompts(1, (20, 20), vocab=model.config.vocab_size, seed=3)[0]
    long = short + make_prompts(1, (24, 24), vocab=model.config.vocab_size, seed=4)[0]
    other_short = [*short, 7, 8, 9]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for prompt in (short, long, other_short):
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == _generate_alone(fresh, prompt, 6)
        if prompt is long:
            assert out.num_cached_tokens == 0
        if prompt is other_short:
            assert out.num_cached_tokens >= 16


def test_preemption_recomputes_the_same_sets() -> None:
    """A cache too small for every request at once: preempted requests are recomputed in one
    prefill of prompt + generated tokens, whose tokens must get the sets they had."""
    model = phi3_longrope()
    fresh = copy.deepcopy(model)
    llm = LLM(model, seed=0, block_size=8, num_blocks=14, max_num_batched_tokens=64)
    prompts = make_prompts(4, (20, 30), vocab=model.config.vocab_size, seed=21)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats.preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == _generate_alone(fresh, prompt, 16)


def test_the_modules_buffer_writes_are_not_weight_changes() -> None:
    """The longrope module rewrites its non-persistent ``inv_freq`` on every forward: not a weight
    change.  A persistent buffer or a parameter written in place still is."""
    model = phi3_longrope()
    llm = LLM(model, seed=0)
    rotary = model.model.rotary_emb
    with torch.no_grad():
        model(torch.randint(3, 500, (1, ORIGINAL + 5)))  # the module switches its buffer to the long set
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.weight_version == 0
    rotary.register_buffer("learned_scale", torch.ones(1), persistent=True)
    llm.notify_weights_updated()  # a new buffer is found when the module set is re-read
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    version = llm.weight_version
    with torch.no_grad():
        rotary.learned_scale.add_(1.0)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.weight_version == version + 1


def test_the_engine_leaves_the_rotary_module_alone() -> None:
    """Its buffer, its state and its forward: the engine never calls the module's length update."""
    model = llama_dynamic()
    rotary = model.model.rotary_emb
    before = (rotary.inv_freq.clone(), rotary.max_seq_len_cached, rotary.attention_scaling)
    llm = LLM(model, seed=0, max_model_len=256)
    llm.generate(_prompts(model.config.vocab_size), SamplingParams(max_tokens=12), use_tqdm=False)
    assert torch.equal(rotary.inv_freq, before[0])
    assert (rotary.max_seq_len_cached, rotary.attention_scaling) == before[1:]
    assert "forward" not in rotary.__dict__


def test_the_start_check_compares_against_the_module(monkeypatch) -> None:
    """The check at engine start computes the tables at the switch and past it and compares them
    with the module's own forward; a per-token computation that disagrees refuses the model."""
    rotary = length_rotary(phi3_longrope())
    assert rotary is not None and rotary.check(torch.float32) is None

    def off_by_one(model: torch.nn.Module):
        found = length_rotary(model)
        found.threshold += 1  # the long set from one token later than the module switches
        return found

    assert "other cos/sin" in off_by_one(phi3_longrope()).check(torch.float32)
    monkeypatch.setattr(facts_module, "length_rotary", off_by_one)
    with pytest.raises(UnsupportedModelError, match="other cos/sin"):
        LLM(phi3_longrope(), seed=0)


def test_parity_mode_is_capped_at_the_switch() -> None:
    """The trainer's forward picks one set for a whole padded batch; parity holds only below the switch."""
    llm = LLM(phi3_longrope(), seed=0, batch_invariant=True)
    assert llm.engine.max_model_len == ORIGINAL
    with pytest.raises(ValueError, match="max_model_len <= 32"):
        LLM(phi3_longrope(), seed=0, batch_invariant=True, max_model_len=64)
