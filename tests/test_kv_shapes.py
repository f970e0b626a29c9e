"""Models whose layers cache keys and values of their own shapes, through the real engine, held to
``generate()`` by the oracle: latent attention (keys and values of different head sizes), Gemma 4
(per-layer head sizes, K = V layers, KV-shared layers, a window shorter than the prompts), MiMo
(different K/V sizes with sinks and a sliding layer) and JetMoE (tiled KV heads), one tiny model
each (tests/tiny_models.py KV_SHAPE_KINDS), under random budgets, prefix hits, forks and
preemption."""

from __future__ import annotations

import random

import pytest
import torch

from cbgen import LLM, SamplingParams
from cbgen.model.plan import cache_layout
from engine_cases import GREEDY, check_forks, check_preemption, check_random_budgets, one_by_one
from engine_cases import all_free as _all_free
from engine_cases import first_tokens as _tokens
from engine_cases import prompts as _prompts
from oracle import FP32, compare, hf_greedy
from tiny_models import KV_SHAPE_KINDS, make_kv_shape_model

KINDS = sorted(KV_SHAPE_KINDS)
_MODELS: dict[str, torch.nn.Module] = {}


def _model(kind: str) -> torch.nn.Module:
    if kind not in _MODELS:
        _MODELS[kind] = make_kv_shape_model(kind)
    return _MODELS[kind]


def test_the_layouts_are_what_attention_receives():
    """Each model's cache holds the shapes its attention calls get, not the config's head_dim (the
    rope dimension on latent attention), and KV-shared layers own no cache."""
    want = {
        "mla": ({(4, 40, 16): (0, 1, 2)}, ()),
        "gemma4": ({(2, 16, 16): (0, 2), (2, 32, 32): (1,)}, ((3, 2), (4, 1))),
        "mimo": ({(2, 24, 16): (0, 2), (4, 24, 16): (1,)}, ()),
        "jetmoe": ({(4, 16, 16): (0, 1)}, ()),
    }
    for kind in KINDS:
        layout = cache_layout(_model(kind), torch.float32, 8)
        (group,) = layout.kv_groups
        assert (group.shapes, layout.shared) == want[kind], kind
    gemma = cache_layout(_model("gemma4"), torch.float32, 8)
    # Bytes a token: layers 0 and 2 at 2 x (16 + 16), layer 1 at 2 x (32 + 32), 4 bytes each.
    assert gemma.kv_groups[0].bytes_per_block() == 8 * 4 * (2 * 2 * 32 + 2 * 64)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_generate_under_random_budgets(kind):
    """Chunked prefill under random budgets and block sizes, prompts from shorter than a block to
    longer than Gemma 4's and MiMo's window, mixed prefill and decode rows in the steps."""
    check_random_budgets(_model(kind), kind, [3, 9, 40, 70])


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_hits_are_exact(kind):
    """The same prompt twice hits; prompts sharing an aligned and an unaligned prefix hit; a prompt
    shorter than a block works; all exact (a KV-shared layer reads its producer's cached pages)."""
    model = _model(kind)
    llm = LLM(model, max_num_batched_tokens=16, block_size=8)
    base = _prompts([29], seed=2)[0]
    tail = _prompts([6], seed=3)[0]
    prompts = [base, base, base[:16] + tail, base[:19] + tail, tail[:3]]
    refs = [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    got, hits = one_by_one(llm, prompts)
    compare(model, prompts, got, refs, FP32)
    assert hits[0] == 0 and hits[1] >= 24 and hits[2] >= 16 and hits[3] >= 16 and hits[4] == 0, hits
    _all_free(llm)


@pytest.mark.parametrize("kind", KINDS)
def test_n_samples_share_one_prefill(kind):
    """n > 1 forks after one prefill (engine_cases.check_forks)."""
    check_forks(_model(kind))


@pytest.mark.parametrize("kind", KINDS)
def test_preemption_then_resume_is_exact(kind):
    """A pool too small for every sequence preempts; resumed sequences recompute and stay exact."""
    check_preemption(_model(kind))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_latent_attention_through_each_cpu_backend(backend):
    """The C backend attends layers whose key and value sizes differ through the torch reference
    (its kernels take one size); both backends give generate()'s tokens."""
    model = _model("mla")
    prompts = _prompts([5, 27, 50], seed=6)
    refs = [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    llm = LLM(model, max_num_batched_tokens=24, block_size=8, attention_backend=backend)
    assert llm.engine.runner.attn_backend.name == backend
    compare(model, prompts, _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)), refs, FP32)


def test_latent_attention_through_the_triton_backend_goes_to_the_reference():
    """The Triton kernels take one head size: the plan sends latent attention's layers to the torch
    reference, decodes eagerly, says so, and the tokens equal generate() (the interpreter on CPU)."""
    from extras import require_extra

    require_extra("triton")
    model = _model("mla")
    prompts = _prompts([5, 27], seed=8)
    llm = LLM(model, block_size=8, attention_backend="triton", max_num_batched_tokens=24)
    plan = llm.engine.runner.plan
    assert plan.decode_mode == "eager" and "through the torch reference" in plan.attention_why
    refs = [hf_greedy(model, p, 6) for p in prompts]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    compare(model, prompts, _tokens(llm.generate(prompts, params, use_tqdm=False)), refs, FP32)


def test_kimi_linear_latent_attention_beside_state_layers():
    """Kimi-Linear: KDA state layers and a latent-attention layer (keys 32, values 16 in the matrix's
    tiny config), under random budgets, n > 1 and preemption, equal to generate()."""
    from tiny_models import _shrink

    model = _shrink().build_model("kimi_linear")
    layout = cache_layout(model, torch.float32, 8)
    assert not layout.kv_groups[0].uniform_head_sizes and layout.state_groups
    prompts = _prompts([9, 40, 70], seed=9)
    refs = [hf_greedy(model, p, 10) for p in prompts]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm = LLM(model, max_num_batched_tokens=7, block_size=8, max_num_seqs=3)
    compare(model, prompts, _tokens(llm.generate(prompts, params, use_tqdm=False)), refs, FP32)
    out = llm.generate([prompts[1]], SamplingParams(n=3, max_tokens=10, temperature=0.0, ignore_eos=True))
    assert [c.token_ids for c in out[0].outputs] == [refs[1]] * 3
    _all_free(llm)
    check_preemption(model)  # a pool too small for all four: preempted and recomputed, still exact


def test_parity_mode_refuses_latent_attention_with_the_reason():
    with pytest.raises(ValueError, match="keys of head size 40 and values of 16"):
        LLM(_model("mla"), batch_invariant=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["gemma4", "jetmoe"])
def test_parity_mode_is_bitwise_with_per_layer_shapes(kind, dtype):
    """Per-layer head sizes, K = V layers and KV-shared layers (Gemma 4) and tiled heads (JetMoE):
    every generated token's raw logprob equals the trainer's forward bit for bit, through
    preemption, prefix hits and an abort."""
    from test_parity import _workload_prompts, mismatches, run_workload

    model = make_kv_shape_model(kind, dtype=dtype)
    llm = LLM(model, block_size=8, num_blocks=12, max_num_batched_tokens=40, batch_invariant=True)
    prompts = _workload_prompts(random.Random(1), 16, model.config.vocab_size)
    samples = run_workload(llm, prompts[:6], 3) + run_workload(llm, prompts, 4)
    stats = llm.engine.stats
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0 and stats.requests_aborted > 0, stats
    bad, total = mismatches(model, samples)
    assert total >= 100 and bad == 0, (bad, total)


def test_info_shows_the_shapes_and_shared_layers():
    text = LLM(_model("gemma4"), block_size=8).engine.runner.plan.report()  # what `cbgen info` prints
    assert "2 layers (0, 2): 2 KV heads x K 16 / V 16; layer 1: 2 KV heads x K 32 / V 32" in text
    assert "layer 3 reads layer 2's KV; layer 4 reads layer 1's KV" in text
    assert "2688 bytes of KV a token" in LLM(_model("mla"), block_size=8).engine.runner.plan.report()


def test_generation_leaves_the_model_as_it_was():
    """No attention implementation, module or parameter of the user's model changes."""
    model = _model("gemma4")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    impl = model.config._attn_implementation
    LLM(model, block_size=8).generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert model.config._attn_implementation == impl
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
