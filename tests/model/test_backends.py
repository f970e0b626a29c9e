"""Attention backend objects (``cbgen.model.backends``): what each device path holds, and the C
decoder step's record layout read from the library."""

from __future__ import annotations

import pytest
import torch

from cbgen import LLM
from cbgen.model.backends import CpuBackend, TorchBackend, backend_choice, make_backend
from cbgen.model.cpu_fast import fused_forward as fused_decode
from cbgen.model.kernels.cpu import decoder as cpu_decoder
from cbgen.model.kernels.cpu import ops as cpu_kernels
from cbgen.model.kernels.reference import paged_ops
from tiny_models import make_model

needs_c = pytest.mark.skipif(
    not cpu_kernels.available(), reason=f"C kernels unavailable: {cpu_kernels.unavailable_reason()}"
)


def test_torch_backend_pads_to_scratch_and_stores_every_slot_when_fixed() -> None:
    backend = make_backend(
        backend_choice("torch", torch.device("cpu"), torch.float32)[0], torch.device("cpu")
    )
    assert isinstance(backend, TorchBackend) and backend.name == "torch"
    assert backend.row_prefill_max == 0 and not backend.paged_decode
    assert backend.pad_slot(123) == 123
    fixed = backend.fixed_shape()
    assert fixed.name == "torch" and fixed.store_kv is paged_ops.store_kv_all_slots
    assert backend.store_kv is paged_ops.store_kv  # the eager backend keeps the filtering store


@needs_c
def test_cpu_backend_holds_the_c_kernels() -> None:
    backend = make_backend(
        backend_choice("auto", torch.device("cpu"), torch.bfloat16)[0], torch.device("cpu")
    )
    assert isinstance(backend, CpuBackend)
    assert backend_choice("auto", torch.device("cpu"), torch.bfloat16)[0] == backend.name == "cpu"
    assert backend.store_kv is cpu_kernels.store_kv
    # The decode kernel with the plan's loops bound (the default: the widest the build has).
    assert backend.decode_kernel.func is cpu_kernels.paged_decode_attention
    assert backend.decode_kernel.keywords == {"impl": cpu_kernels.IMPL_FAST} == backend.decode_direct.keywords
    assert backend.decode_direct.func is cpu_kernels.decode_direct
    assert backend.row_prefill_max == 64 and backend.paged_decode
    assert backend.pad_slot(123) == -1 and backend.fixed_shape() is backend


@needs_c
def test_engine_wires_one_backend_everywhere() -> None:
    llm = LLM(make_model("llama"), block_size=8, attention_backend="cpu")
    runner = llm.engine.runner
    assert runner.backend == "cpu" and isinstance(runner.attn_backend, CpuBackend)
    assert llm.engine.input_builder.row_prefill_max == runner.attn_backend.row_prefill_max
    assert runner.fused is not None and runner.fused.backend is runner.attn_backend


@needs_c
def test_decoder_layout_comes_from_the_library() -> None:
    layout = cpu_decoder.decoder_layout()
    filled = {name for pair in fused_decode._C_PROJ_FIELDS for name in pair}
    filled |= {"POST_NORM", "NEXT_NORM", "K_CACHE", "V_CACHE", "WINDOW"}
    assert set(layout.word_fields) == filled
    assert set(layout.float_fields) == {"POST_EPS", "NEXT_EPS", "SCALE"}
    words = {name: i + 1 for i, name in enumerate(layout.word_fields)}
    floats = {name: 0.5 for name in layout.float_fields}
    w, f = layout.records([words, words], [floats, floats])
    assert w.shape == (2, layout.words) and w.dtype == torch.int64
    assert f.shape == (2, layout.floats) and f.dtype == torch.float32
    assert w[1, layout.word_fields.index("WINDOW")] == words["WINDOW"]
    assert not w[:, len(layout.word_fields) :].any()
    with pytest.raises(ValueError, match="not the library's"):
        layout.records([{**words, "EXTRA": 1}], [floats])
    missing = dict(words)
    del missing["WINDOW"]
    with pytest.raises(ValueError, match="not the library's"):
        layout.records([missing], [floats])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("ctx_len", "q_len"), [(1, 1), (5, 3), (100, 17), (300, 64)])
def test_prefill_chunk_after_context_equals_the_masked_attention(dtype, ctx_len, q_len) -> None:
    """A prefill chunk after earlier context: the split (context, then the chunk causally, merged by
    log-sum-exps) against one masked SDPA in float32."""
    gen = torch.Generator().manual_seed(ctx_len + q_len)
    q = torch.randn(1, 6, q_len, 16, generator=gen).to(dtype)
    k, v = (torch.randn(1, 2, ctx_len + q_len, 16, generator=gen).to(dtype) for _ in range(2))
    out = paged_ops.attend_after_context(q, k, v, ctx_len, 0.25)
    visible = torch.arange(ctx_len + q_len)[None, :] <= torch.arange(ctx_len, ctx_len + q_len)[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=visible, scale=0.25, enable_gqa=True
    )
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_prefill_chunk_after_context_groups_heads_without_copies(monkeypatch) -> None:
    """The CPU flash op gets the context's kv heads as they are (no copy per query head); a torch
    whose op refuses grouped heads gets the copies, and the same result."""
    real = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    calls = []

    def strict(query, key, value, *args, **kwargs):
        calls.append(key.shape[1])
        if key.shape[1] != query.shape[1]:
            raise RuntimeError("expected key heads to match query heads")
        return real(query, key, value, *args, **kwargs)

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, 9, 16, generator=gen)
    k, v = (torch.randn(1, 2, 40, 16, generator=gen) for _ in range(2))
    monkeypatch.setattr(
        torch.ops.aten,
        "_scaled_dot_product_flash_attention_for_cpu",
        lambda query, key, *a, **kw: calls.append(key.shape[1]) or real(query, key, *a, **kw),
    )
    native = paged_ops.attend_after_context(q, k, v, 31, 0.25)
    assert calls == [2, 2]  # this torch's op groups the heads itself: no copies
    calls.clear()
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", strict)
    out = paged_ops.attend_after_context(q, k, v, 31, 0.25)
    assert calls == [2, 6, 6]  # refused once, then the copies
    torch.testing.assert_close(out, native, atol=1e-6, rtol=1e-6)
    visible = torch.arange(40)[None, :] <= torch.arange(31, 40)[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=visible, scale=0.25, enable_gqa=True
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
