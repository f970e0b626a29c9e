"""Fixed-shape decode path: bucketing, graph keys, padding rows, and exactness on CPU (eager and compiled)."""

from __future__ import annotations

import pytest
import torch

from cbgen import LLM, SamplingParams
from cbgen.model.graphs import GraphKey, batch_buckets, bucket_for, width_bucket
from oracle import compare, hf_greedy
from tiny_models import make_model, make_prompts


def test_batch_buckets():
    assert batch_buckets(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(1) == [1]
    assert bucket_for(3, batch_buckets(64)) == 4
    assert bucket_for(17, batch_buckets(64)) == 32
    assert bucket_for(64, batch_buckets(64)) == 64
    with pytest.raises(ValueError):
        bucket_for(65, batch_buckets(64))


def test_width_bucket_and_key_hold_everything_baked_in():
    assert width_bucket(1, 512) == 4
    assert width_bucket(5, 512) == 8
    assert width_bucket(600, 512) == 512
    a = GraphKey(16, 8, 16, torch.float32, "torch")
    # keys differing in any baked value must never alias (transformers#45323: a key without the
    # sequence-length bucket replayed graphs with the wrong length)
    others = [
        GraphKey(32, 8, 16, torch.float32, "torch"),
        GraphKey(16, 16, 16, torch.float32, "torch"),
        GraphKey(16, 8, 32, torch.float32, "torch"),
        GraphKey(16, 8, 16, torch.bfloat16, "torch"),
        GraphKey(16, 8, 16, torch.float32, "triton"),
    ]
    assert all(a != other for other in others)
    # As the graph cache uses them: one entry per key, and a key built again finds its own graph.
    graphs = {key: i for i, key in enumerate([a, *others])}
    assert len(graphs) == 6
    twin = GraphKey(16, 8, 16, torch.float32, "torch")
    assert twin == a and hash(twin) == hash(a) and graphs[twin] == 0


def test_key_uses_length_bucket_for_torch_backend():
    model = make_model("llama")
    llm = LLM(model, block_size=8, decode_mode="static", max_num_seqs=8, attention_backend="torch")
    static = llm.engine.runner.static
    assert static is not None and not static.use_cuda_graphs
    assert static.key_for(3, 2).width == 4 and static.key_for(3, 9).width == 16
    assert static.key_for(3, 2).batch == 4


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_padded_static_decode_is_exact(arch):
    model = make_model(arch)
    prompts = make_prompts(7, lengths=(3, 60))
    refs = [hf_greedy(model, p, 30) for p in prompts]
    llm = LLM(model, block_size=8, decode_mode="static", max_num_seqs=8)
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), use_tqdm=False
    )
    compare(model, prompts, [o.outputs[0].token_ids for o in outs], refs)
    static = llm.engine.runner.static
    # 7 rows pad to the bucket of 8: the padding row wrote only to the scratch block
    assert static.key_for(7, 1).batch == 8
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compiled_decode_matches_eager(arch):
    model = make_model(arch)
    prompts = make_prompts(4, lengths=(5, 40))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    eager = LLM(model, block_size=8).generate(prompts, params, use_tqdm=False)
    compiled_llm = LLM(model, block_size=8, compile=True, max_num_seqs=4)
    compiled = compiled_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in compiled] == [o.outputs[0].token_ids for o in eager]
    assert compiled_llm.engine.runner.compiled
