"""Sampling through the whole engine: seeds, n>1 shared prefill, logprob definitions, stop handling."""

from __future__ import annotations

import math

import pytest
import torch

from cbgen import LLM, SamplingParams
from oracle import hf_greedy
from tiny_models import make_model, make_prompts


@pytest.fixture(scope="module")
def model():
    return make_model("qwen3", seed=1)


def raw_reference(model, prompt: list[int], completion: list[int]) -> list[float]:
    """log_softmax of a plain fp32 forward over prompt + completion, at each completion token."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(completion)]


def test_seeded_request_independent_of_batch_and_preemption(model):
    prompt = make_prompts(1, lengths=(20, 20), seed=9)[0]
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = LLM(model, block_size=8).generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids

    others = make_prompts(31, lengths=(3, 60), seed=4)
    mixed = [
        SamplingParams(
            max_tokens=16 + i % 9,
            temperature=[0.0, 0.7, 1.3][i % 3],
            top_k=[-1, 5, 50][i % 3],
            min_p=[0.0, 0.05][i % 2],
            ignore_eos=True,
        )
        for i in range(31)
    ]
    outs = LLM(model, block_size=8).generate(
        [*others[:13], prompt, *others[13:]], [*mixed[:13], seeded, *mixed[13:]], use_tqdm=False
    )
    assert outs[13].outputs[0].token_ids == alone

    small = LLM(model, block_size=4, num_blocks=40)
    outs = small.generate([*others[:8], prompt], [*mixed[:8], seeded], use_tqdm=False)
    assert small.stats.preemptions > 0
    assert outs[-1].outputs[0].token_ids == alone


def test_n_samples_share_one_prefill(model):
    prompt = make_prompts(1, lengths=(45, 45), seed=2)[0]  # 45 = 5 full blocks of 8 + a partial one
    llm = LLM(model, block_size=8)
    out = llm.generate(
        [prompt], SamplingParams(n=8, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(out.outputs) == 8 and [c.index for c in out.outputs] == list(range(8))
    assert llm.stats.prompt_tokens_computed == len(prompt), "the prompt must be computed once, not 8 times"
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "samples with different indices must differ"
    # Each fork's tokens follow the model: its raw logprobs equal a plain forward of its own sequence.
    for c in out.outputs:
        ref = raw_reference(model, prompt, c.token_ids)
        assert max(abs(a - b) for a, b in zip(c.raw_logprobs, ref)) < 1e-4

    greedy = LLM(model, block_size=8).generate(
        [prompt], SamplingParams(n=8, max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0]
    ref = hf_greedy(model, prompt, 12)
    assert all(c.token_ids == ref for c in greedy.outputs)
    assert all(lp == 0.0 for c in greedy.outputs for lp in c.token_logprobs)


def test_raw_logprobs_match_plain_forward_and_kept_mass_relation(model):
    prompts = make_prompts(6, lengths=(5, 50), seed=3)
    params = [
        SamplingParams(max_tokens=16, temperature=1.0, top_k=20, seed=i, ignore_eos=True, logprobs=3)
        if i % 2
        else SamplingParams(max_tokens=16, temperature=1.0, top_p=0.8, min_p=0.02, seed=i, ignore_eos=True)
        for i in range(6)
    ]
    outs = LLM(model, block_size=8).generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        assert len(c.token_logprobs) == len(c.raw_logprobs) == len(c.log_kept_mass) == len(c.token_ids) == 16
        ref = raw_reference(model, prompt, c.token_ids)
        assert max(abs(a - b) for a, b in zip(c.raw_logprobs, ref)) < 1e-4
        # temperature 1, truncation only: processed = raw - log(kept mass)
        for lp, raw, kept in zip(c.token_logprobs, c.raw_logprobs, c.log_kept_mass):
            assert abs(lp - (raw - kept)) < 1e-5
            assert kept <= 1e-6 and lp <= 1e-6
        if out.outputs[0].top_logprobs is not None:
            assert all(len(d) <= 3 for d in c.top_logprobs)
            assert all(tok in d or len(d) == 3 for tok, d in zip(c.token_ids, c.top_logprobs))


def test_processed_logprob_with_temperature_and_penalty(model):
    prompt = make_prompts(1, lengths=(12, 12), seed=5)[0]
    params = SamplingParams(
        max_tokens=6, temperature=0.7, top_k=10, presence_penalty=0.5, seed=3, ignore_eos=True
    )
    c = LLM(model, block_size=8).generate([prompt], params, use_tqdm=False)[0].outputs[0]
    seq = list(prompt)
    for tok, lp in zip(c.token_ids, c.token_logprobs):
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0, -1].double()
        out_so_far = set(seq[len(prompt) :])
        for t in out_so_far:
            logits[t] -= 0.5
        logits /= 0.7
        kth = logits.topk(10).values[-1]
        logits[logits < kth] = -math.inf
        ref = torch.log_softmax(logits, -1)[tok]
        assert abs(lp - float(ref)) < 1e-4
        seq.append(tok)


def test_prompt_logprobs(model):
    prompt = make_prompts(1, lengths=(30, 30), seed=6)[0]
    out = LLM(model, block_size=8, max_num_batched_tokens=8).generate(
        [prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2), use_tqdm=False
    )[0]
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), -1)
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert abs(entry[prompt[i]] - float(logp[i - 1, prompt[i]])) < 1e-4
        assert len(entry) <= 3


def test_min_tokens_suppresses_eos_and_stop_token_ids(model):
    prompts = make_prompts(4, lengths=(5, 20), seed=8)
    bias_eos = {2: 100.0, 7: 100.0}  # make EOS (2) and token 7 overwhelmingly likely
    stopped = LLM(model, block_size=8).generate(
        prompts,
        SamplingParams(max_tokens=10, temperature=0, logit_bias=bias_eos, stop_token_ids=[7]),
        use_tqdm=False,
    )
    assert all(len(o.outputs[0].token_ids) == 1 and o.outputs[0].finish_reason == "stop" for o in stopped)
    held = LLM(model, block_size=8).generate(
        prompts,
        SamplingParams(max_tokens=10, min_tokens=5, temperature=0, logit_bias=bias_eos, stop_token_ids=[7]),
        use_tqdm=False,
    )
    for o in held:
        toks = o.outputs[0].token_ids
        assert len(toks) == 6 and 2 not in toks[:5] and 7 not in toks[:5]
        assert toks[5] in (2, 7) and o.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
    ],
)
def test_bad_parameters_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_model_dependent_parameter_checks(model):
    llm = LLM(model, block_size=8, max_logprobs=5)
    prompt = [[5, 6, 7]]
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate(prompt, SamplingParams(logprobs=6), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(prompt, SamplingParams(logit_bias={512: 1.0}), use_tqdm=False)
    assert llm.generate(prompt, SamplingParams(logprobs=5, max_tokens=2), use_tqdm=False)[0].finished


def test_builtin_logits_processors_and_unknown_name(model):
    llm = LLM(model, block_size=8)
    prompts = make_prompts(3, lengths=(5, 20), seed=12)
    allowed = [11, 22, 33]
    outs = llm.generate(
        prompts,
        SamplingParams(
            max_tokens=6, temperature=1.0, seed=0, logits_processor_args={"allowed_token_ids": allowed}
        ),
        use_tqdm=False,
    )
    assert all(t in allowed for o in outs for t in o.outputs[0].token_ids)
    greedy = llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
    first = greedy.outputs[0].token_ids[0]
    banned = llm.generate(
        prompts[:1],
        SamplingParams(max_tokens=4, temperature=0, logits_processor_args={"bad_words": [[first]]}),
        use_tqdm=False,
    )[0]
    assert first not in banned.outputs[0].token_ids
    with pytest.raises(ValueError, match="unknown processor"):
        llm.generate(prompts[:1], SamplingParams(logits_processor_args={"nope": 1}), use_tqdm=False)
