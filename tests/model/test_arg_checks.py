"""Every native entry point refuses arguments that do not match the cache geometry, before it
touches memory: wrong shapes, dtypes and strides raise ``ValueError``, and block ids, slots and
lengths outside the cache raise (C) or are never dereferenced (Triton).  Under AddressSanitizer
(``make test-asan``) an out-of-bounds access in the C kernels fails these tests instead of
returning zeros."""

from __future__ import annotations

import pytest
import torch
from paged_cases import make_case

from cbgen.model.kernels.cpu import amx as cpu_amx
from cbgen.model.kernels.cpu import decoder as cpu_decoder
from cbgen.model.kernels.cpu import ops as cpu_kernels
from cbgen.model.kernels.flash import ops as flash_ops
from cbgen.model.kernels.triton import ops as triton_ops

native_c = pytest.mark.native("c")

F32 = torch.float32


def _case():
    query, k_cache, v_cache, _, table, lens = make_case(7, [3, 17, 9], 4, 2, 16, 8, F32)
    return query, k_cache, v_cache, table, lens


# ------------------------------------------------------------------ C paged decode and store
@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "query": a["query"][:, :, :8].contiguous()}, "query"),
        (lambda a: {**a, "query": a["query"][:, :3].contiguous()}, "query"),  # 3 heads over 2 kv heads
        (lambda a: {**a, "query": a["query"].to(torch.bfloat16)}, "float32 or bfloat16"),
        (lambda a: {**a, "block_table": a["block_table"].long()}, "block_table"),
        (lambda a: {**a, "block_table": a["block_table"][:2]}, "block_table"),
        (lambda a: {**a, "seq_lens": a["seq_lens"][:2]}, "seq_lens"),
        (lambda a: {**a, "v_cache": a["v_cache"][:, :4].contiguous()}, "v_cache"),
    ],
)
@native_c
def test_c_decode_refuses_mismatched_arguments(change, message):
    query, k_cache, v_cache, table, lens = _case()
    args = dict(query=query, k_cache=k_cache, v_cache=v_cache, block_table=table, seq_lens=lens)
    with pytest.raises(ValueError, match=message):
        cpu_kernels.decode_direct(**change(args), scale=0.25, window=0, softcap=0.0)


@pytest.mark.parametrize("portable", [False, True])
@native_c
def test_c_decode_refuses_block_ids_and_lengths_outside_the_cache(portable):
    query, k_cache, v_cache, table, lens = _case()
    bad = table.clone()
    bad[1, 1] = k_cache.shape[0]  # one past the last block
    with pytest.raises(ValueError, match="outside the cache"):
        cpu_kernels.decode_direct(query, k_cache, v_cache, bad, lens, 0.25, 0, 0.0, portable)
    bad[1, 1] = -3
    with pytest.raises(ValueError, match="outside the cache"):
        cpu_kernels.decode_direct(query, k_cache, v_cache, bad, lens, 0.25, 0, 0.0, portable)
    too_long = lens.clone()
    too_long[0] = table.shape[1] * k_cache.shape[1] + 1  # past the end of its table row
    with pytest.raises(ValueError, match="outside the cache"):
        cpu_kernels.decode_direct(query, k_cache, v_cache, table, too_long, 0.25, 0, 0.0, portable)
    ok = cpu_kernels.decode_direct(query, k_cache, v_cache, table, lens, 0.25, 0, 0.0, portable)
    assert torch.isfinite(ok).all()


@native_c
def test_c_store_refuses_a_key_with_fewer_heads_than_the_cache():
    """A tensor-parallel rank's key has its local heads; a cache sized for all of them must not be
    filled by reading past the end of the key (issue #16)."""
    k_cache = torch.zeros(4, 8, 2, 16)
    v_cache = torch.zeros_like(k_cache)
    key = value = torch.randn(5, 1, 16)
    slots = torch.arange(5)
    with pytest.raises(ValueError, match="key"):
        cpu_kernels.store_kv(key, value, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="key"):
        cpu_kernels.store_direct(key.view(5, 16), value.view(5, 16), k_cache, v_cache, slots)


@native_c
def test_c_store_refuses_slots_outside_the_cache_and_writes_nothing():
    k_cache = torch.zeros(4, 8, 2, 16)
    v_cache = torch.zeros_like(k_cache)
    key = value = torch.randn(3, 2, 16)
    for bad in ([0, 1, 32], [0, -2, 3]):
        with pytest.raises(ValueError, match="outside the cache"):
            cpu_kernels.store_kv(key, value, k_cache, v_cache, torch.tensor(bad))
        assert not k_cache.any() and not v_cache.any()
    with pytest.raises(ValueError, match=r"key: expected \[4, 2, 16\]"):  # 4 slots for 3 rows
        cpu_kernels.store_direct(key.view(3, 32), value.view(3, 32), k_cache, v_cache, torch.arange(4))
    with pytest.raises(ValueError, match="slot_mapping"):
        cpu_kernels.store_direct(key.view(3, 32), value.view(3, 32), k_cache, v_cache, torch.arange(3.0))
    with pytest.raises(ValueError, match="dtype"):
        cpu_kernels.store_direct(
            key.view(3, 32).double(), value.view(3, 32), k_cache, v_cache, torch.arange(3)
        )


# ------------------------------------------------------------------ C fused ops
@native_c
def test_fused_ops_refuse_mismatched_shapes():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="out"):
        cpu_kernels.add_rmsnorm(x, None, torch.ones(32), 1e-6, torch.empty(3, 32))
    with pytest.raises(ValueError, match="weight"):
        cpu_kernels.add_rmsnorm(x, None, torch.ones(16), 1e-6, torch.empty(4, 32))
    with pytest.raises(ValueError, match="delta"):
        cpu_kernels.add_rmsnorm(x, torch.randn(4, 16), torch.ones(32), 1e-6, torch.empty(4, 32))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_kernels.add_rmsnorm(x.double(), None, torch.ones(32), 1e-6, torch.empty(4, 32))
    q, k = torch.randn(4, 64), torch.randn(4, 32)
    with pytest.raises(ValueError, match="cos"):
        cpu_kernels.rope_(q, k, torch.randn(3, 16), torch.randn(4, 16), 16)
    with pytest.raises(ValueError, match="even"):
        cpu_kernels.rope_(q, k, torch.randn(4, 15), torch.randn(4, 15), 15)
    with pytest.raises(ValueError, match="up"):
        cpu_kernels.silu_mul(torch.randn(4, 8), torch.randn(4, 4), torch.empty(4, 8))
    with pytest.raises(ValueError, match="logits"):
        cpu_kernels.greedy_rows(torch.randn(4, 8)[:, ::2])


@native_c
def test_amx_entry_points_refuse_mismatched_shapes():
    weight = torch.randn(64, 64).to(torch.bfloat16)
    packed = cpu_amx.amx_pack(weight)
    with pytest.raises(ValueError, match="width"):
        cpu_amx.amx_linear(torch.randn(4, 32).to(torch.bfloat16), packed, None)
    with pytest.raises(ValueError, match="bias"):
        cpu_amx.amx_linear(
            torch.randn(4, 64).to(torch.bfloat16), packed, torch.zeros(32, dtype=torch.bfloat16)
        )


@native_c
def test_decoder_step_refuses_mismatched_arguments():
    layout = cpu_decoder.decoder_layout()
    hidden = torch.randn(2, 64).to(torch.bfloat16)
    args = dict(
        gemm="panel",
        words=torch.zeros(1, layout.words + 1, dtype=torch.int64),
        floats=torch.zeros(1, layout.floats),
        first_norm=(torch.ones(64, dtype=torch.bfloat16), 1e-6),
        hidden=hidden,
        cos=torch.zeros(2, 16, dtype=torch.bfloat16),
        sin=torch.zeros(2, 16, dtype=torch.bfloat16),
        table=torch.zeros(2, 1, dtype=torch.int32),
        seq_lens=torch.ones(2, dtype=torch.int32),
        slots=torch.zeros(2, dtype=torch.int64),
    )
    dims = dict(heads=4, kv_heads=2, head_dim=16, intermediate=64, block_size=8, num_blocks=4)
    with pytest.raises(ValueError, match="words"):
        cpu_decoder.decoder_step(**args, **dims)
    args["words"] = torch.zeros(1, layout.words, dtype=torch.int64)
    with pytest.raises(ValueError, match="gemm"):
        cpu_decoder.decoder_step(**{**args, "gemm": "onednn_packed"}, **dims)
    with pytest.raises(ValueError, match="cos"):
        cpu_decoder.decoder_step(**{**args, "cos": torch.zeros(3, 16, dtype=torch.bfloat16)}, **dims)
    with pytest.raises(ValueError, match="cos"):  # float32 tables for bf16 activations
        cpu_decoder.decoder_step(**{**args, "cos": torch.zeros(2, 16)}, **dims)
    with pytest.raises(ValueError, match="slots"):
        cpu_decoder.decoder_step(**{**args, "slots": torch.zeros(2, dtype=torch.int32)}, **dims)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_decoder.decoder_step(**{**args, "hidden": hidden.half()}, **dims)
    for bad in (torch.zeros(len(cpu_decoder.STAGES)), torch.zeros(3, dtype=torch.float64)):
        with pytest.raises(ValueError, match="stage_seconds"):
            cpu_decoder.decoder_step(**args, **dims, stage_seconds=bad)


# ------------------------------------------------------------------ Triton (interpreter) and flash
@pytest.mark.skipif(not triton_ops.HAS_TRITON, reason="triton is not installed")
def test_triton_launchers_refuse_mismatched_arguments_and_never_follow_bad_ids():
    query, k_cache, v_cache, table, lens = _case()
    with pytest.raises(ValueError, match="query"):
        triton_ops.triton_paged_decode_attention(query[:, :, :8], k_cache, v_cache, table, lens, 0.25)
    with pytest.raises(ValueError, match="block_table"):
        triton_ops.triton_paged_decode_attention(query, k_cache, v_cache, table[:2], lens, 0.25)
    with pytest.raises(ValueError, match="key"):
        triton_ops.triton_store_kv(
            torch.randn(3, 1, 16), torch.randn(3, 1, 16), k_cache, v_cache, torch.arange(3)
        )
    # Ids and slots outside the cache are masked inside the kernels: nothing outside is touched.
    bad = table.clone()
    bad[1, 1] = 1 << 30
    out = triton_ops.triton_paged_decode_attention(query, k_cache, v_cache, bad, lens, 0.25)
    assert out.shape == query.shape
    before = k_cache.clone()
    key = torch.randn(2, 2, 16)
    triton_ops.triton_store_kv(key, key, k_cache, v_cache, torch.tensor([k_cache.shape[0] * 8, -1]))
    assert torch.equal(k_cache, before)


def test_flash_adapter_refuses_mismatched_arguments():
    query, k_cache, v_cache, table, lens = _case()
    with pytest.raises(ValueError, match="query"):
        flash_ops.paged_decode_attention(query[:, :3], k_cache, v_cache, table, lens, 0.25)
    with pytest.raises(ValueError, match="seq_lens"):
        flash_ops.paged_decode_attention(query, k_cache, v_cache, table, lens[:1], 0.25)
