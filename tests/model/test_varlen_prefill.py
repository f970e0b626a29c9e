"""Varlen prefill: the input builder's description of a step's prefill chunks, the torch reference of
the varlen contract against a float64 oracle, the torch strategy (one SDPA call per chunk) and the CPU
backend's decode-kernel rows against the reference, and the fused CPU path's attention against the
transformers path's."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from paged_cases import (
    CHUNKS,
    STEP_BLOCKS,
    STEP_CHUNKS,
    assert_close,
    build_step,
    make_varlen_case,
    naive_varlen,
    step_caches,
    step_reference,
)

from cbgen import SamplingParams
from cbgen.model.attention import paged_attention_forward
from cbgen.model.backends import CpuBackend, TorchBackend
from cbgen.model.input_batch import InputBuilder, ModelInput
from cbgen.model.kernels.cpu import ops as cpu_kernels
from cbgen.model.kernels.reference import paged_ops, varlen
from cbgen.request import Request

needs_c = pytest.mark.skipif(
    not cpu_kernels.available(), reason=f"C kernels unavailable: {cpu_kernels.unavailable_reason()}"
)


def test_builder_describes_the_chunks_in_varlen_form() -> None:
    batch = build_step(STEP_CHUNKS, decodes=[3, 20], row_prefill_max=64)
    meta, info = batch.meta, batch.meta.varlen
    # Chunks attended as decode rows first (in scheduler order), then the others.
    order = [(r.request_id, n) for r, n in batch.scheduled]
    assert order == [
        ("d0", 1),
        ("d1", 1),
        ("p0", 5),
        ("p2", 12),
        ("p4", 2),
        ("p5", 33),
        ("p1", 70),
        ("p3", 100),
    ]
    chunks = [(n, r.num_computed_tokens) for r, n in batch.scheduled[2:]]
    q_lens = [q for q, _ in chunks]
    k_lens = [q + c for q, c in chunks]
    assert info.cu_seqlens_q.tolist() == [0, *np.cumsum(q_lens).tolist()]
    assert info.cu_seqlens_k.tolist() == [0, *np.cumsum(k_lens).tolist()]
    assert info.seq_lens_k.tolist() == k_lens
    assert (info.max_q_len, info.max_k_len, info.num_tokens) == (100, 100, sum(q_lens))
    for t in (info.cu_seqlens_q, info.cu_seqlens_k, info.seq_lens_k, info.block_table):
        assert t.dtype == torch.int32 and t.is_contiguous()
    for row, (r, n) in enumerate(batch.scheduled[2:]):
        used = -(-(r.num_computed_tokens + n) // 8)
        assert info.block_table[row, :used].tolist() == r.block_ids[:used]
        assert not info.block_table[row, used:].any()
    assert [(s.q_start, s.q_len, s.ctx_len, s.as_rows) for s in meta.prefills] == [
        (2 + sum(q_lens[:i]), q, c, q <= 64) for i, (q, c) in enumerate(chunks)
    ]
    # The row chunks' rows: one per query token over its chunk's blocks, its position + 1 long.
    assert (meta.row_prefill_chunks, meta.row_prefill_tokens) == (4, 5 + 12 + 2 + 33)
    lens = meta.row_prefill_lens.tolist()
    assert lens == [c + j + 1 for q, c in chunks[:4] for j in range(q)]
    assert meta.row_prefill_max_len == max(lens)
    row = 0
    for r, n in batch.scheduled[2:6]:
        used = -(-(r.num_computed_tokens + n) // 8)
        assert all(meta.row_prefill_table[row + j, :used].tolist() == r.block_ids[:used] for j in range(n))
        row += n
    positions = batch.positions.tolist()
    assert positions[2:7] == list(range(5)) and positions[7:19] == list(range(40, 52))


def test_builder_without_rows_keeps_the_scheduled_order() -> None:
    batch = build_step(STEP_CHUNKS, decodes=[4])
    assert [r.request_id for r, _ in batch.scheduled] == ["d0", *(f"p{i}" for i in range(len(STEP_CHUNKS)))]
    assert batch.meta.row_prefill_chunks == 0 and batch.meta.row_prefill_table is None
    assert not any(s.as_rows for s in batch.meta.prefills)
    assert batch.meta.varlen.block_table.shape == (len(STEP_CHUNKS), -(-100 // 8))
    decode_only = build_step([], decodes=[4, 9])
    assert decode_only.meta.varlen is None and not decode_only.meta.prefills


def test_builder_rejects_a_context_block_outside_the_cache() -> None:
    r = Request("r", list(range(1, 30)), SamplingParams(max_tokens=4))
    r.num_computed_tokens = 20
    r.block_ids = [STEP_BLOCKS + 5, 1, 2, 3]  # only the context reads the bad block
    builder = InputBuilder(8, torch.device("cpu"), num_blocks=STEP_BLOCKS)
    with pytest.raises(RuntimeError, match="block outside the KV cache"):
        builder.build([(r, 9)], kv_caches=[])


@pytest.mark.parametrize(("sliding_window", "softcap"), [(None, None), (7, None), (None, 5.0), (20, 30.0)])
def test_reference_matches_the_float64_oracle(sliding_window, softcap) -> None:
    query, k_cache, v_cache, _, clean, cu, lens = make_varlen_case(3, CHUNKS, 6, 2, 16, 8, torch.float32)
    out = varlen.varlen_prefill_attention(
        query, k_cache, v_cache, clean, cu, lens, 0.25, sliding_window, softcap
    )
    want = naive_varlen(query, k_cache, v_cache, clean, CHUNKS, 0.25, sliding_window, softcap)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_check_varlen_names_the_bad_argument() -> None:
    query, k_cache, v_cache, table, _, cu, lens = make_varlen_case(0, CHUNKS, 4, 2, 16, 8, torch.float32)
    check = varlen.check_varlen
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        check(query, k_cache, v_cache, table, cu[:-1], lens)
    with pytest.raises(ValueError, match="seq_lens_k"):
        check(query, k_cache, v_cache, table, cu, lens.long())
    with pytest.raises(ValueError, match="block_table"):
        check(query, k_cache, v_cache, table[:, None], cu, lens)
    with pytest.raises(ValueError, match="query"):
        check(query[:, :3], k_cache, v_cache, table, cu, lens)


def _run_layer(batch: ModelInput, backend, dtype, window, softcap, seed: int = 1, heads: int = 6):
    """One layer of paged attention through ``backend`` on random q/k/v in transformers' layout;
    returns ``(out [T, H, D], q, k_cache, v_cache)``."""
    meta = batch.meta
    k_cache, v_cache = step_caches(seed, dtype)
    meta.kv_caches, meta.backend = [(k_cache, v_cache)], backend
    gen = torch.Generator().manual_seed(seed + 7)
    tokens = batch.num_tokens
    # [1, H, T, D] views of token-major storage, as transformers hands them over.
    query = torch.randn(1, tokens, heads, 16, generator=gen).to(dtype).transpose(1, 2)
    key, value = (torch.randn(1, tokens, 2, 16, generator=gen).to(dtype).transpose(1, 2) for _ in range(2))
    module = SimpleNamespace(layer_idx=0)
    out, _ = paged_attention_forward(
        module, query, key, value, None, scaling=0.25, sliding_window=window, softcap=softcap, cbgen_meta=meta
    )
    return out[0], query[0].transpose(0, 1), k_cache, v_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (6, None), (None, 20.0)])
@pytest.mark.parametrize("backend_name", ["torch", pytest.param("cpu", marks=needs_c)])
def test_backend_prefill_matches_the_reference(backend_name, dtype, window, softcap) -> None:
    """A step of decode rows, short chunks (decode rows on the CPU) and long ones, with and without
    context: every row against the reference."""
    backend = TorchBackend() if backend_name == "torch" else CpuBackend()
    batch = build_step(STEP_CHUNKS, decodes=[3, 20], row_prefill_max=backend.row_prefill_max, seed=5)
    out, q, k_cache, v_cache = _run_layer(batch, backend, dtype, window, softcap)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    assert_close(out.float(), step_reference(batch, q, k_cache, v_cache, window, softcap), dtype)


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (9, None), (None, 5.0), (9, 5.0)])
@pytest.mark.parametrize("with_context", [False, True])
def test_torch_loop_matches_the_reference(window, softcap, with_context) -> None:
    """The torch strategy on every chunk of a step, from the fresh K/V without context and from the
    cache after it (NaN in block 0, where table padding points)."""
    chunks = STEP_CHUNKS if with_context else [(q, 0) for q, _ in STEP_CHUNKS]
    batch = build_step(chunks, decodes=[], seed=2)
    meta = batch.meta
    k_cache, v_cache = step_caches(4, torch.float32)
    gen = torch.Generator().manual_seed(9)
    tokens = batch.num_tokens
    q = torch.randn(tokens, 6, 16, generator=gen)
    k, v = torch.randn(tokens, 2, 16, generator=gen), torch.randn(tokens, 2, 16, generator=gen)
    paged_ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.full_like(q, float("nan"))
    table = meta.varlen.block_table
    varlen.attend_loop(meta.prefills, q, k, v, k_cache, v_cache, table, 0.25, window, softcap, out)
    assert_close(out, step_reference(batch, q, k_cache, v_cache, window, softcap), torch.float32)


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 6])
def test_fused_path_attention_equals_the_transformers_path(dtype, window) -> None:
    """``CpuBackend.attend_projections`` (the fused forward's entry, on strided projection rows)
    against ``paged_attention_forward`` (transformers' layout) on the same step and inputs."""
    backend = CpuBackend()
    batch = build_step(STEP_CHUNKS, decodes=[3, 20], row_prefill_max=backend.row_prefill_max, seed=8)
    meta, tokens = batch.meta, batch.num_tokens
    gen = torch.Generator().manual_seed(3)
    fused = torch.randn(tokens, (6 + 2 + 2) * 16, generator=gen).to(dtype)  # one qkv GEMM's output
    q, k, v = fused[:, :96], fused[:, 96:128], fused[:, 128:]
    caches = step_caches(2, dtype)
    meta.kv_caches, meta.backend = [tuple(c.clone() for c in caches)], backend
    out = backend.attend_projections(meta, 0, q, k, v, 16, 0.25, window or 0)
    meta.kv_caches = [tuple(c.clone() for c in caches)]
    meta.derived.clear()
    heads_first = [t.view(tokens, -1, 16).transpose(0, 1)[None] for t in (q, k, v)]
    want, _ = paged_attention_forward(
        SimpleNamespace(layer_idx=0), *heads_first, None, scaling=0.25, sliding_window=window, cbgen_meta=meta
    )
    torch.testing.assert_close(out, want[0], atol=1e-6, rtol=1e-6)
    assert_close(
        out.float(), step_reference(batch, q.view(tokens, 6, 16), *meta.kv_caches[0], window, None), dtype
    )


@needs_c
def test_cpu_rows_read_the_query_in_place(monkeypatch) -> None:
    """The C row call gets the fused path's strided query rows as they are (no copy) and writes its
    rows of the output directly."""
    backend = CpuBackend()
    batch = build_step([(5, 0), (9, 30)], decodes=[], row_prefill_max=64)
    seen = []
    original = backend.decode_direct

    def spy(query, *args, out=None):
        seen.append((query, out))
        return original(query, *args, out=out)

    monkeypatch.setattr(backend, "decode_direct", spy)
    meta, tokens = batch.meta, batch.num_tokens
    meta.kv_caches = [step_caches(0, torch.float32)]
    fused = torch.randn(tokens, 10 * 16)
    q, k, v = fused[:, :96], fused[:, 96:128], fused[:, 128:]
    out = backend.attend_projections(meta, 0, q, k, v, 16, 0.25, 0)
    ((query, target),) = seen
    assert query.data_ptr() == q.data_ptr() and query.stride(0) == fused.stride(0)
    assert target.data_ptr() == out.data_ptr() and target.shape == (14, 6, 16)
