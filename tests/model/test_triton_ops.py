"""Triton kernels vs the torch reference, on CPU through Triton's interpreter (the CUDA side is
``test_triton_cuda.py``).

``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` before anything imports triton unless
``CBGEN_TEST_CUDA=1``; these tests then skip by name, since compiled kernels cannot take CPU
tensors.  Shapes stay small: the interpreter executes every program in Python.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from paged_cases import (
    CHUNKS,
    LENS,
    NUM_BLOCKS,
    assert_close,
    build_step,
    check_decode,
    make_case,
    make_varlen_case,
    rel_err,
    step_caches,
    step_reference,
)

from cbgen import LLM, SamplingParams
from cbgen.model.kernels.reference import paged_ops, varlen
from cbgen.model.kernels.triton import ops as triton_ops
from cbgen.model.kernels.triton import prefill as triton_prefill
from extras import require_extra
from oracle import compare, hf_greedy
from tiny_models import make_model, make_prompts

require_extra("triton")  # cbgen's Triton modules import without it; the kernels need it

pytestmark = pytest.mark.skipif(
    not triton_ops._interpreting(), reason="compiled Triton (CBGEN_TEST_CUDA=1) cannot take CPU tensors"
)


def _check_decode(*args, num_splits: int | None = None, **kwargs) -> None:
    check_decode(triton_ops.triton_paged_decode_attention, *args, num_splits=num_splits, **kwargs)


def test_available_under_interpreter() -> None:
    assert triton_ops.HAS_TRITON
    assert triton_ops.available("cpu")
    assert triton_ops.available(torch.device("cpu"))


# ------------------------------------------------------------------------------------------------
# store_kv
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("num_kv_heads", [1, 3])
def test_store_kv_matches_reference(dtype: torch.dtype, block_size: int, num_kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(block_size * 10 + num_kv_heads)
    head_dim, num_tokens = 32, 11
    # key/value as strided views into a fused projection, as a model would hand them over.
    fused = torch.randn(num_tokens, 2 * num_kv_heads, head_dim + 8, generator=gen).to(dtype)
    key, value = fused[:, :num_kv_heads, :head_dim], fused[:, num_kv_heads:, 8:]
    slots = torch.randperm(NUM_BLOCKS * block_size, generator=gen)[:num_tokens]
    slots[[2, 5, 10]] = -1
    caches = [
        torch.randn(NUM_BLOCKS, block_size, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2)
    ]
    ref_k, ref_v = (c.clone() for c in caches)
    out_k, out_v = (c.clone() for c in caches)

    paged_ops.store_kv(key, value, ref_k, ref_v, slots)
    triton_ops.triton_store_kv(key, value, out_k, out_v, slots)

    assert torch.equal(out_k, ref_k)
    assert torch.equal(out_v, ref_v)


def test_store_kv_casts_and_handles_empty() -> None:
    gen = torch.Generator().manual_seed(7)
    key = torch.randn(5, 2, 16, generator=gen)
    value = torch.randn(5, 2, 16, generator=gen)
    slots = torch.tensor([3, -1, 17, 8, 0], dtype=torch.int32)
    ref_k, ref_v = (
        torch.zeros(4, 8, 2, 16, dtype=torch.bfloat16),
        torch.zeros(4, 8, 2, 16, dtype=torch.bfloat16),
    )
    out_k, out_v = ref_k.clone(), ref_v.clone()

    paged_ops.store_kv(key, value, ref_k, ref_v, slots.long())
    triton_ops.triton_store_kv(key, value, out_k, out_v, slots)
    assert torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v)

    triton_ops.triton_store_kv(key[:0], value[:0], out_k, out_v, slots[:0])
    assert torch.equal(out_k, ref_k)


def test_store_kv_all_padding_writes_nothing() -> None:
    key = torch.randn(4, 2, 16)
    cache_k, cache_v = torch.zeros(2, 8, 2, 16), torch.zeros(2, 8, 2, 16)
    triton_ops.triton_store_kv(key, key, cache_k, cache_v, torch.full((4,), -1))
    assert not cache_k.any() and not cache_v.any()


# ------------------------------------------------------------------------------------------------
# decode attention
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(2, 2, 16), (4, 2, 32), (8, 2, 64), (4, 1, 128)]
)
def test_decode_matches_reference(
    dtype: torch.dtype, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    _check_decode(LENS, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=head_dim + block_size)


@pytest.mark.parametrize("sliding_window", [1, 5, 16, 33, 100])
def test_decode_sliding_window(sliding_window: int) -> None:
    _check_decode(LENS, 4, 2, 32, 8, torch.float32, seed=sliding_window, sliding_window=sliding_window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [0.5, 30.0])
def test_decode_softcap(dtype: torch.dtype, softcap: float) -> None:
    # A cap of 0.5 drives most scores into tanh saturation; 30 is the Gemma-2-style mild cap.
    _check_decode(LENS, 4, 1, 32, 16, dtype, seed=3, softcap=softcap)


@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_decode_split_k(num_splits: int) -> None:
    # 7 splits over short rows leaves some splits empty; the merge must ignore them.
    _check_decode(LENS, 4, 2, 16, 8, torch.float32, seed=num_splits, num_splits=num_splits)


def test_decode_split_k_with_window_softcap_bf16() -> None:
    _check_decode(LENS, 8, 2, 32, 16, torch.bfloat16, seed=11, sliding_window=20, softcap=5.0, num_splits=3)


def test_decode_fp16() -> None:
    _check_decode(LENS, 4, 2, 64, 16, torch.float16, seed=5)


def test_decode_block_size_32() -> None:
    _check_decode([1, 31, 32, 33, 65], 4, 2, 32, 32, torch.float32, seed=9)


def test_decode_strided_query_and_max_seq_len() -> None:
    lens = [5, 16, 23]
    _, k_cache, v_cache, table, clean, seq_lens = make_case(2, lens, 4, 2, 32, 8, torch.float32)
    # A query sliced out of a fused qkv projection: non-contiguous batch and head strides.
    fused = torch.randn(len(lens), 8, 32, generator=torch.Generator().manual_seed(1))
    query = fused[:, ::2]
    out = triton_ops.triton_paged_decode_attention(
        query, k_cache, v_cache, table, seq_lens, 0.2, max_seq_len=max(lens)
    )
    expected = paged_ops.paged_decode_attention(
        query, k_cache, v_cache, clean, seq_lens, 0.2, max_seq_len=max(lens)
    )
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_decode_all_padding_and_empty_batch() -> None:
    query, k_cache, v_cache, table, _, _ = make_case(4, [8, 8], 2, 1, 16, 8, torch.float32)
    seq_lens = torch.zeros(2, dtype=torch.int32)
    for splits in (1, 2):
        out = triton_ops.triton_paged_decode_attention(
            query, k_cache, v_cache, table, seq_lens, 0.25, num_splits=splits
        )
        assert torch.equal(out, torch.zeros_like(out))

    empty = triton_ops.triton_paged_decode_attention(
        query[:0], k_cache, v_cache, table[:0], seq_lens[:0], 0.25
    )
    assert empty.shape == (0, 2, 16)


def test_decode_rejects_bad_gqa() -> None:
    query, k_cache, v_cache, table, _, seq_lens = make_case(0, [4], 3, 2, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        triton_ops.triton_paged_decode_attention(query, k_cache, v_cache, table, seq_lens, 0.25)


# ------------------------------------------------------------------------------------------------
# varlen prefill
# ------------------------------------------------------------------------------------------------


def _check_prefill(
    chunks, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0, sliding_window=None, softcap=None
) -> None:
    """The varlen prefill kernel on a case with a poisoned block-table tail against the float32
    reference (every row: a prefill chunk has no padding rows)."""
    query, k_cache, v_cache, table, clean, cu, lens = make_varlen_case(
        seed, chunks, num_heads, num_kv_heads, head_dim, block_size, dtype
    )
    scale = head_dim**-0.5
    out = triton_prefill.triton_varlen_prefill_attention(
        query,
        k_cache,
        v_cache,
        table,
        cu,
        lens,
        scale,
        sliding_window,
        softcap,
        max_q_len=max(q for q, _ in chunks),
    )
    want = varlen.varlen_prefill_attention(
        query.float(), k_cache.float(), v_cache.float(), clean, cu, lens, scale, sliding_window, softcap
    )
    assert out.shape == query.shape and out.dtype == dtype
    assert_close(out.float(), want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(2, 2, 16), (6, 2, 32), (4, 1, 24)])
def test_prefill_matches_reference(dtype, num_heads, num_kv_heads, head_dim) -> None:
    """Mixed chunks (no context and after it, lengths off the block and across query tiles), MHA,
    GQA with a group of 3 (padded to 4) and MQA with a head size that is not a power of two."""
    _check_prefill(CHUNKS, num_heads, num_kv_heads, head_dim, 8, dtype, seed=head_dim)


@pytest.mark.parametrize(("sliding_window", "softcap"), [(1, None), (6, None), (20, 5.0), (None, 0.5)])
def test_prefill_window_and_softcap(sliding_window, softcap) -> None:
    # A window of 6 over 16-token query tiles leaves whole key tiles invisible to some rows.
    _check_prefill(CHUNKS, 4, 2, 16, 8, torch.float32, seed=7, sliding_window=sliding_window, softcap=softcap)


def test_prefill_fp16_tensor_core_branch_and_block_16() -> None:
    _check_prefill([(20, 0), (3, 29)], 8, 2, 32, 16, torch.float16, seed=4, sliding_window=11)


def test_prefill_writes_into_a_strided_out_and_reads_a_strided_query() -> None:
    chunks = [(6, 0), (9, 13)]
    query, k_cache, v_cache, table, clean, cu, lens = make_varlen_case(5, chunks, 4, 2, 16, 8, torch.float32)
    wide = torch.zeros(15, 8, 16)  # rows of a [T, 2H, D] buffer: row stride 2H*D
    strided_q = torch.randn(15, 8, 16)[:, ::2]
    strided_q.copy_(query)
    out = triton_prefill.triton_varlen_prefill_attention(
        strided_q, k_cache, v_cache, table, cu, lens, 0.25, max_q_len=9, out=wide[:, :4]
    )
    assert out.data_ptr() == wide.data_ptr() and not wide[:, 4:].any()
    want = varlen.varlen_prefill_attention(query, k_cache, v_cache, clean, cu, lens, 0.25)
    torch.testing.assert_close(wide[:, :4], want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="out"):
        triton_prefill.triton_varlen_prefill_attention(
            query, k_cache, v_cache, table, cu, lens, 0.25, max_q_len=9, out=wide[:, :3]
        )
    with pytest.raises(ValueError, match="seq_lens_k"):
        triton_prefill.triton_varlen_prefill_attention(
            query, k_cache, v_cache, table, cu, lens[:1], 0.25, max_q_len=9
        )


def test_triton_backend_attends_a_step_in_one_launch(monkeypatch) -> None:
    """``TritonBackend.prefill`` hands every chunk of a built step to one kernel launch."""
    from cbgen.model.attention import paged_attention_forward
    from cbgen.model.backends import TritonBackend

    launches = []
    original = triton_prefill.triton_varlen_prefill_attention

    def spy(*args, **kwargs):
        launches.append(kwargs["max_q_len"])
        return original(*args, **kwargs)

    monkeypatch.setattr(triton_prefill, "triton_varlen_prefill_attention", spy)
    backend = TritonBackend()
    batch = build_step([(5, 0), (18, 9), (3, 30)], decodes=[4], seed=3)
    meta = batch.meta
    k_cache, v_cache = step_caches(1, torch.float32)
    meta.kv_caches, meta.backend = [(k_cache, v_cache)], backend
    gen = torch.Generator().manual_seed(2)
    query = torch.randn(1, batch.num_tokens, 4, 16, generator=gen).transpose(1, 2)
    key, value = (torch.randn(1, batch.num_tokens, 2, 16, generator=gen).transpose(1, 2) for _ in range(2))
    out, _ = paged_attention_forward(
        SimpleNamespace(layer_idx=0), query, key, value, None, scaling=0.25, sliding_window=7, cbgen_meta=meta
    )
    assert launches == [18]
    q = query[0].transpose(0, 1)
    assert_close(out[0], step_reference(batch, q, k_cache, v_cache, 7, None), torch.float32)


# ------------------------------------------------------------------------------------------------
# branches that depend on the device
# ------------------------------------------------------------------------------------------------


def test_fp16_takes_the_tensor_core_branch_under_the_interpreter(monkeypatch, decode_launches) -> None:
    """The 16-bit ``tl.dot`` branch (``NATIVE_DOT``) runs on CPU in float16; bfloat16 keeps the
    float32 dots there (see the next test), float32 always."""
    seen = decode_launches
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        _check_decode(LENS, 8, 2, 32, 16, dtype, seed=21)
    assert [native for _, native in seen] == [True, False, False]
    _check_decode(LENS, 8, 2, 64, 16, torch.float16, seed=22, sliding_window=20, softcap=5.0, num_splits=3)
    assert seen[-1] == (3, True)


def test_interpreter_dot_on_bfloat16_is_still_wrong() -> None:
    """Why bfloat16 stays off the ``tl.dot`` branch under the interpreter: Triton 3.9's interpreter
    multiplies bfloat16 tiles wrongly.  If this starts failing, Triton fixed it and
    ``triton_ops._native_dot`` can let bfloat16 in."""
    import triton
    import triton.language as tl

    @triton.jit
    def dot(a_ptr, b_ptr, c_ptr):
        o = tl.arange(0, 16)
        tile = o[:, None] * 16 + o[None, :]
        tl.store(c_ptr + tile, tl.dot(tl.load(a_ptr + tile), tl.load(b_ptr + tile)))

    gen = torch.Generator().manual_seed(0)
    results = {}
    for dtype in (torch.float16, torch.bfloat16):
        a, b = (torch.randn(16, 16, generator=gen).to(dtype) for _ in range(2))
        c = torch.empty(16, 16)
        dot[(1,)](a, b, c)
        results[dtype] = rel_err(c, a.float() @ b.float())
    assert results[torch.float16] < 1e-6 and results[torch.bfloat16] > 1.0


def test_automatic_split_k_choice(monkeypatch) -> None:
    """The split count ``_choose_splits`` gives a CUDA device (its arithmetic, with the SM count of
    an H100-class part stubbed in), and a kernel run at that count under the interpreter."""
    monkeypatch.setattr(triton_ops, "_interpreting", lambda: False)
    monkeypatch.setattr(triton_ops, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    # 8 programs for 264 wanted, 4096 tokens worth 16 splits of 256: 16.
    assert triton_ops._choose_splits(1, 8, 4096, cuda) == 16
    assert triton_ops._choose_splits(1, 8, 100_000, cuda) == 32  # capped
    assert triton_ops._choose_splits(256, 8, 4096, cuda) == 1  # enough programs already
    assert triton_ops._choose_splits(1, 8, 300, cuda) == 1  # too short to split
    assert triton_ops._choose_splits(1, 8, 4096, torch.device("cpu")) == 1
    monkeypatch.undo()
    # Most of the 16 splits of these short rows are empty: the merge must ignore them.
    _check_decode([70, 0, 17], 4, 2, 16, 8, torch.float32, seed=16, num_splits=16)


@pytest.mark.parametrize(
    ("arch", "decode_mode"), [("llama", "eager"), ("gemma2", "static")], ids=["eager-llama", "static-gemma2"]
)
def test_engine_with_triton_backend_matches_generate(
    arch: str, decode_mode: str, monkeypatch, decode_launches
) -> None:
    """The whole engine on ``attention_backend="triton"`` under the interpreter: greedy tokens equal
    ``generate()`` (gemma2: sliding window and soft-cap in the kernel), eager and through the
    padded fixed-shape decode path (padding rows store nowhere and read nothing), and every step's
    raw logprob equals a plain forward's to 1e-4 (tokens alone miss small errors in a short run)."""
    seen = decode_launches
    model = make_model(arch)
    # Short prompts: under the interpreter the KV store costs one Python-run program per token.
    prompts = make_prompts(3, lengths=(4, 30))
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    llm = LLM(model, block_size=8, attention_backend="triton", decode_mode=decode_mode, max_num_seqs=4)
    assert llm.engine.runner.backend == "triton"
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    compare(model, prompts, [o.token_ids for o in outs], [hf_greedy(model, p, 5) for p in prompts])
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
        want = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(
            torch.tensor(out.raw_logprobs, dtype=torch.float64), want, rtol=0, atol=1e-4
        )
    layers = model.config.num_hidden_layers
    assert len(seen) >= 4 * layers  # every decode step of every layer went through the kernel
