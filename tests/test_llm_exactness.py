"""Invariant 2: fp32 greedy output equals ``model.generate()`` token for token, on every supported
architecture and under chunking, preemption, prefix-cache hits and repeated rounds."""

from __future__ import annotations

import pytest
import torch

from cbgen import LLM, SamplingParams
from oracle import compare, hf_greedy
from tiny_models import ARCHS, make_model, make_prompts

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama():
    model = make_model("llama")
    prompts = make_prompts(12)
    refs = [hf_greedy(model, p, 40) for p in prompts]
    return model, prompts, refs


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_matches_generate(arch):
    model = make_model(arch)
    prompts = make_prompts(12, lengths=(3, 90))
    refs = [hf_greedy(model, p, 40) for p in prompts]
    llm = LLM(model, block_size=8)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.request_id for o in outs] == sorted(
        {o.request_id for o in outs}, key=lambda r: int(r.split("-")[1])
    )
    got = [o.outputs[0].token_ids for o in outs]
    assert all(len(g) == 40 for g in got)
    compare(model, prompts, got, refs)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def test_chunked_prefill(llama):
    model, prompts, refs = llama
    llm = LLM(model, max_num_batched_tokens=16, block_size=8)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    compare(model, prompts, [o.outputs[0].token_ids for o in outs], refs)
    # 90-token prompts with a 16-token budget can only have been computed in chunks.
    assert llm.stats.steps >= sum(len(p) for p in prompts) // 16


def test_preemption_recompute(llama):
    model, prompts, refs = llama
    llm = LLM(model, num_blocks=24, block_size=8)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.stats.preemptions > 0
    compare(model, prompts, [o.outputs[0].token_ids for o in outs], refs)
    assert llm.engine.block_manager.num_free_blocks == 24


def shared_prefix_prompts(llama, length: int) -> tuple:
    """The model, six prompts that start with the same ``length`` tokens, and their references."""
    model, prompts, _ = llama
    prefixed = [prompts[-1][:length] + p[:20] for p in prompts[:6]]
    return model, prefixed, [hf_greedy(model, p, 40) for p in prefixed]


def test_prefix_cache_hits(llama):
    model, prefixed, refs = shared_prefix_prompts(llama, 64)
    llm = LLM(model, block_size=8)
    first = llm.generate(prefixed[:1], GREEDY, use_tqdm=False)
    outs = llm.generate(prefixed, GREEDY, use_tqdm=False)
    # the 64 shared tokens are 8 full blocks; each later prompt hits them.
    assert llm.stats.prefix_cache_hits >= 6 * 64
    assert outs[0].num_cached_tokens >= 64
    compare(model, prefixed[:1] + prefixed, [o.outputs[0].token_ids for o in first + outs], refs[:1] + refs)


def test_partial_block_prefix_hits(llama):
    """A shared prefix that ends inside a block (8 full blocks + 5 tokens): later prompts copy the
    5 tokens' K/V from the first prompt's block instead of computing them, and still match."""
    model, prefixed, refs = shared_prefix_prompts(llama, 69)
    llm = LLM(model, block_size=8)
    first = llm.generate(prefixed[:1], GREEDY, use_tqdm=False)
    computed = llm.stats.prompt_tokens_computed
    outs = llm.generate(prefixed[1:], GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [69] * 5
    assert llm.stats.prompt_tokens_computed - computed == sum(len(p) - 69 for p in prefixed[1:])
    got = [o.outputs[0].token_ids for o in first + outs]
    compare(model, prefixed, got, refs)


def test_three_rounds_on_one_engine(llama):
    model, prompts, refs = llama
    llm = LLM(model, block_size=8, max_num_batched_tokens=64)
    for _ in range(3):
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        compare(model, prompts, [o.outputs[0].token_ids for o in outs], refs)
        assert not llm.engine.groups
        assert llm.engine.block_manager.num_used_blocks == 0


def test_driver_api_reusable(llama):
    model, prompts, refs = llama
    llm = LLM(model, block_size=8)
    seen_steps = []
    for _ in range(2):
        ids = llm.add_requests(prompts[:4], GREEDY)
        done = llm.drive_until_empty(on_step=lambda i, s: seen_steps.append((i, s.num_seqs)))
        assert set(done) == set(ids)
        compare(model, prompts[:4], [done[i].outputs[0].token_ids for i in ids], refs[:4])
    assert seen_steps and all(n > 0 for _, n in seen_steps)
    assert [i for i, _ in seen_steps] == list(range(1, len(seen_steps) + 1))


def test_model_left_as_it_was(llama):
    model, prompts, _ = llama
    impl = model.config._attn_implementation
    config_before = model.config.to_dict()
    model.train()
    llm = LLM(model, block_size=8)
    llm.generate(prompts[:3], GREEDY, use_tqdm=False)
    assert model.training and all(m.training for m in model.modules())
    assert model.config._attn_implementation == impl
    assert model.config.to_dict() == config_before
    model.eval()


def test_training_loss_bitwise_unchanged_and_optimizer_step_identical():
    def run(generate: bool) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        model = make_model("qwen3", seed=3)
        model.train()
        batch = torch.tensor(make_prompts(2, lengths=(24, 24), seed=5))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss1 = model(batch, labels=batch).loss
        if generate:
            rng = torch.get_rng_state()
            llm = LLM(model, block_size=8)
            llm.generate(make_prompts(3), SamplingParams(max_tokens=8, temperature=0.8), use_tqdm=False)
            assert torch.equal(rng, torch.get_rng_state()), "generation consumed the global RNG"

        loss2 = model(batch, labels=batch).loss
        loss2.backward()
        if generate:
            llm.generate(make_prompts(2), GREEDY, use_tqdm=False)
        opt.step()
        return loss1.detach(), loss2.detach(), [p.detach().clone() for p in model.parameters()]

    torch.manual_seed(0)
    base1, base2, base_w = run(False)
    torch.manual_seed(0)
    gen1, gen2, gen_w = run(True)
    assert torch.equal(base1, gen1) and torch.equal(base2, gen2) and torch.equal(gen1, gen2)
    assert all(torch.equal(a, b) for a, b in zip(base_w, gen_w))
