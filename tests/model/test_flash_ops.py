"""The flash_attn backend, on CPU, against a fake ``flash_attn`` written from flash-attn 2's documented
semantics (flash-attn itself needs a GPU; the real kernel is checked by benchmarks/kernel_check.py).

The fakes (``flash_fakes``) check the argument contract of the real ``flash_attn_with_kvcache`` (shapes, int32 metadata,
strides, page-size multiple) and computes what its docstring specifies: paged gather through
``block_table``, ``cache_seqlens``, bottom-right-aligned causal mask, ``window_size``, ``softcap``,
``softmax_scale``, zeros for rows whose mask is empty.  Only the first ``cdiv(len, page)`` entries of
a block-table row are dereferenced, as in the kernel, so poisoned tails stay untouched.  The prefill's
``flash_attn_varlen_func`` (``FakeFlashVarlen``) is checked the same way.
"""

from __future__ import annotations

import sys

import pytest
import torch
from flash_fakes import FakeFlash, install
from paged_cases import (
    CHUNKS,
    LENS,
    assert_close,
    build_step,
    check_decode,
    make_case,
    make_varlen_case,
    step_caches,
    step_reference,
)

from cbgen.model.attention import LayerAttention
from cbgen.model.backends import backend_choice
from cbgen.model.kernels.flash import ops as flash_ops
from cbgen.model.kernels.reference import paged_ops, varlen


@pytest.fixture
def fake_flash(monkeypatch):
    """Installs the fakes as ``flash_attn`` (version 2.8.3; see ``flash_fakes.install``)."""

    def install_fake(page_multiple: int = 256, version: str = "2.8.3", varlen="paged") -> FakeFlash:
        return install(monkeypatch, page_multiple, version, varlen)

    return install_fake


def _check_decode(
    fake: FakeFlash,
    lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> None:
    k_cache, table, seq_lens, scale = check_decode(
        flash_ops.paged_decode_attention,
        lens,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        seed=seed,
        sliding_window=sliding_window,
        softcap=softcap,
        max_seq_len=max(lens),
    )

    call = fake.calls[-1]
    assert call["q"].shape == (len(lens), 1, num_heads, head_dim)
    assert call["causal"] is True
    assert call["window_size"] == ((-1, -1) if sliding_window is None else (sliding_window - 1, 0))
    assert call["softcap"] == (0.0 if softcap is None else softcap)
    assert call["softmax_scale"] == scale
    assert call["k_cache"] is k_cache  # read in place, no copy or relayout
    assert torch.equal(call["cache_seqlens"], seq_lens) and torch.equal(call["block_table"], table)


def test_module_imports_without_flash_attn() -> None:
    """flash-attn cannot be installed here: the module imports and says so."""
    if "flash_attn" in sys.modules:
        pytest.skip("a flash_attn module is importable here")
    assert not flash_ops.HAS_FLASH_ATTN
    assert not flash_ops.graph_capturable()
    query, k_cache, v_cache, table, _, seq_lens = make_case(0, [3], 2, 1, 8, 8, torch.float32)
    with pytest.raises(RuntimeError, match="flash-attn"):
        flash_ops.paged_decode_attention(query, k_cache, v_cache, table, seq_lens, 1.0)
    reason = flash_ops.unavailable_reason(torch.device("cuda"), torch.bfloat16, 256, 128)
    assert reason is not None and "not usable" in reason
    assert not flash_ops.varlen_available()
    query, k_cache, v_cache, table, _, cu, _ = make_varlen_case(0, [(3, 2)], 2, 1, 8, 8, torch.float32)
    with pytest.raises(RuntimeError, match="flash_attn_varlen_func"):
        flash_ops.varlen_prefill_attention(
            query, k_cache, v_cache, table, cu, cu, 1.0, max_q_len=3, max_k_len=5
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(4, 4, 32), (8, 2, 64), (6, 1, 24)],  # MHA, GQA, MQA with a non-power-of-two head size
)
def test_decode_matches_reference(fake_flash, dtype, num_heads, num_kv_heads, head_dim) -> None:
    fake = fake_flash(page_multiple=8)
    _check_decode(fake, LENS, num_heads, num_kv_heads, head_dim, 8, dtype, seed=num_heads + head_dim)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("sliding_window", [None, 1, 5, 16, 64, 1000])
def test_sliding_window_maps_to_left_edge(fake_flash, block_size, sliding_window) -> None:
    fake = fake_flash(page_multiple=8)
    _check_decode(fake, LENS, 8, 2, 32, block_size, torch.float32, sliding_window=sliding_window)


@pytest.mark.parametrize("softcap", [5.0, 50.0])
@pytest.mark.parametrize("sliding_window", [None, 24])
def test_softcap(fake_flash, softcap, sliding_window) -> None:
    fake = fake_flash(page_multiple=8)
    _check_decode(
        fake, LENS, 4, 2, 16, 16, torch.bfloat16, seed=3, sliding_window=sliding_window, softcap=softcap
    )


def test_real_page_size_256(fake_flash) -> None:
    """flash-attn 2's only paged block sizes are multiples of 256: lengths crossing a page."""
    fake = fake_flash()  # the real constraint
    _check_decode(fake, [1, 255, 256, 257, 0, 600], 8, 2, 64, 256, torch.bfloat16, sliding_window=300)
    with pytest.raises(AssertionError, match="256"):
        _check_decode(fake, [5], 8, 2, 64, 16, torch.bfloat16)


def test_metadata_is_cast_and_query_views_are_accepted(fake_flash) -> None:
    """int64 metadata is cast to int32 for flash; a strided query view (as attention passes it) is fine;
    a query in another dtype than the cache is cast to it and the result cast back."""
    fake = fake_flash(page_multiple=8)
    query, k_cache, v_cache, table, clean, seq_lens = make_case(5, LENS, 8, 2, 32, 8, torch.bfloat16)
    # A row-strided view, as q[:num_decode] of the packed [T, H, D] batch can be.
    packed = torch.randn(len(LENS), 2, 8, 32).to(torch.bfloat16)
    packed[:, 0] = query
    view = packed[:, 0]
    assert not view.is_contiguous()
    out = flash_ops.paged_decode_attention(view, k_cache, v_cache, table.long(), seq_lens.long(), 0.2)
    call = fake.calls[-1]
    assert call["cache_seqlens"].dtype == torch.int32 and call["block_table"].dtype == torch.int32
    expected = paged_ops.paged_decode_attention(query, k_cache, v_cache, clean, seq_lens, 0.2)
    live = seq_lens > 0
    assert_close(out[live], expected[live], torch.bfloat16)

    out32 = flash_ops.paged_decode_attention(query.float(), k_cache, v_cache, table, seq_lens, 0.2)
    assert out32.dtype == torch.float32 and fake.calls[-1]["q"].dtype == torch.bfloat16
    assert torch.equal(out32, out.float())

    empty = flash_ops.paged_decode_attention(query[:0], k_cache, v_cache, table[:0], seq_lens[:0], 0.2)
    assert empty.shape == (0, 8, 32)


def test_int32_metadata_is_passed_through(fake_flash) -> None:
    """The engine's int32 buffers reach flash as the same tensors (nothing to launch under a graph)."""
    fake = fake_flash(page_multiple=8)
    query, k_cache, v_cache, table, _, seq_lens = make_case(1, [4, 9], 4, 2, 16, 8, torch.float16)
    flash_ops.paged_decode_attention(query, k_cache, v_cache, table, seq_lens, 0.25)
    call = fake.calls[-1]
    assert call["cache_seqlens"] is seq_lens and call["block_table"] is table


def test_window_mapping_examples() -> None:
    assert flash_ops._window(None) == (-1, -1)
    assert flash_ops._window(1) == (0, 0)  # only the newest token
    assert flash_ops._window(4096) == (4095, 0)
    with pytest.raises(ValueError):
        flash_ops._window(0)


def test_versions(fake_flash) -> None:
    fake_flash(version="2.8.3.post1+cu12torch2.7cxx11abiTRUE")
    assert flash_ops.HAS_FLASH_ATTN and flash_ops.graph_capturable()
    fake_flash(version="2.8.4")  # main after flash-attn PR #2711: .item() in paged fwd_kvcache
    assert flash_ops.HAS_FLASH_ATTN and not flash_ops.graph_capturable()
    fake_flash(version="2.5.9")  # no softcap argument yet
    assert not flash_ops.HAS_FLASH_ATTN
    assert "2.5.9" in flash_ops.unavailable_reason(torch.device("cuda"), torch.bfloat16)


# ------------------------------------------------------------------------------------------------
# Backend choice and wiring
# ------------------------------------------------------------------------------------------------


def test_explicit_flash_without_flash_attn_raises() -> None:
    if "flash_attn" in sys.modules:
        pytest.skip("a flash_attn module is importable here")
    for device in (torch.device("cpu"), torch.device("cuda")):
        with pytest.raises(ValueError, match=r"flash_attn.*not usable"):
            backend_choice("flash_attn", device, torch.bfloat16, block_size=256, head_dim=128)


def test_auto_on_cpu_is_unchanged(fake_flash) -> None:
    cpu = torch.device("cpu")
    before = backend_choice("auto", cpu, torch.bfloat16)[0]
    fake_flash()
    assert before in ("cpu", "torch")
    assert backend_choice("auto", cpu, torch.bfloat16, block_size=256, head_dim=64)[0] == before
    assert backend_choice("auto", cpu, torch.float16)[0] == "torch"
    with pytest.raises(ValueError, match="CUDA device"):
        backend_choice("flash_attn", cpu, torch.bfloat16, block_size=256, head_dim=64)


def test_choice_on_cuda(fake_flash, monkeypatch) -> None:
    """With a (fake) sm90 GPU: auto prefers flash only when everything suits it, explicit requests
    that cannot work raise with the reason."""
    from cbgen.model.kernels.triton import ops as triton_ops

    fake_flash()
    monkeypatch.setattr(flash_ops, "_compute_capability", lambda device: (9, 0))
    monkeypatch.setattr(triton_ops, "HAS_TRITON", True)
    cuda, bf16 = torch.device("cuda"), torch.bfloat16

    assert backend_choice("auto", cuda, bf16, block_size=256, head_dim=128)[0] == "flash_attn"
    assert backend_choice("auto", cuda, torch.float16, block_size=512, head_dim=64)[0] == "flash_attn"
    # Anything unsuitable falls back to triton.
    assert backend_choice("auto", cuda, bf16, block_size=16, head_dim=128)[0] == "triton"
    assert backend_choice("auto", cuda, torch.float32, block_size=256, head_dim=128)[0] == "triton"
    assert backend_choice("auto", cuda, bf16, block_size=256, head_dim=512)[0] == "triton"
    assert backend_choice("auto", cuda, bf16, block_size=256, head_dim=100)[0] == "triton"
    assert backend_choice("auto", cuda, bf16)[0] == "triton"  # sizes unknown: not considered
    monkeypatch.setattr(triton_ops, "HAS_TRITON", False)
    assert backend_choice("auto", cuda, bf16, block_size=16, head_dim=128)[0] == "torch"
    monkeypatch.setattr(triton_ops, "HAS_TRITON", True)

    assert backend_choice("flash_attn", cuda, bf16, block_size=256, head_dim=128)[0] == "flash_attn"
    assert backend_choice("flash_attn", cuda, bf16)[0] == "flash_attn"  # the runner checks the cache
    with pytest.raises(ValueError, match=r"multiple of 256.*16"):
        backend_choice("flash_attn", cuda, bf16, block_size=16, head_dim=128)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        backend_choice("flash_attn", cuda, torch.float32, block_size=256)
    with pytest.raises(ValueError, match="head_dim"):
        backend_choice("flash_attn", cuda, bf16, block_size=256, head_dim=320)

    monkeypatch.setattr(flash_ops, "_compute_capability", lambda device: (7, 5))
    with pytest.raises(ValueError, match="sm80"):
        backend_choice("flash_attn", cuda, bf16, block_size=256, head_dim=128)
    assert backend_choice("auto", cuda, bf16, block_size=256, head_dim=128)[0] == "triton"
    monkeypatch.setattr(flash_ops, "_compute_capability", lambda device: (8, 0))

    # A flash-attn whose paged decode syncs with the host: never picked by auto (graphs would break).
    fake_flash(version="2.8.4")
    monkeypatch.setattr(flash_ops, "_compute_capability", lambda device: (8, 0))
    assert backend_choice("auto", cuda, bf16, block_size=256, head_dim=128)[0] == "triton"
    assert backend_choice("flash_attn", cuda, bf16, block_size=256, head_dim=128)[0] == "flash_attn"


def test_runner_checks_cache_geometry(fake_flash, monkeypatch) -> None:
    """An explicit request whose sizes backend_choice did not see is checked against the KV cache."""
    from cbgen import LLM
    from tiny_models import make_model

    fake_flash()
    monkeypatch.setattr(
        flash_ops, "unavailable_reason", lambda device, dtype, block_size=None, head_dim=None: None
    )
    with pytest.raises(ValueError, match="multiple of 256"):
        LLM(make_model("llama"), block_size=8, attention_backend="flash_attn")


@pytest.mark.parametrize(("arch", "decode_mode"), [("llama", "eager"), ("gemma2", "static")])
def test_engine_with_fake_flash_matches_torch(fake_flash, monkeypatch, arch, decode_mode) -> None:
    """End to end through attention.py with the fake standing in for flash on CPU: same greedy tokens
    as the torch backend.  gemma2 brings a sliding window and soft-capping; ``decode_mode="static"``
    runs the padded fixed-shape decode path (padding rows: slot -1, seq_len 0)."""
    from cbgen import LLM, SamplingParams
    from tiny_models import make_model, make_prompts

    fake = fake_flash(page_multiple=8)
    # CPU stands in for CUDA: skip the device checks, keep the geometry checks.
    monkeypatch.setattr(
        flash_ops, "unavailable_reason", lambda device, dtype, block_size=None, head_dim=None: None
    )
    model = make_model(arch)
    prompts = make_prompts(5, lengths=(3, 40))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runs = {}
    for backend in ("flash_attn", "torch"):
        llm = LLM(model, block_size=8, attention_backend=backend, decode_mode=decode_mode, max_num_seqs=8)
        runner = llm.engine.runner
        assert runner.backend == backend
        if backend == "flash_attn":
            assert runner.decode_fn is flash_ops.paged_decode_attention
            assert (runner.static is None) == (decode_mode == "eager")
        runs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert fake.calls, "decode never reached flash_attn_with_kvcache"
    assert fake.varlen.calls, "prefill never reached flash_attn_varlen_func"
    assert runs["flash_attn"] == runs["torch"]


# ------------------------------------------------------------------------------------------------
# Varlen prefill
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("sliding_window", "softcap"), [(None, None), (6, None), (None, 5.0), (20, 30.0)])
def test_varlen_prefill_matches_reference(fake_flash, dtype, sliding_window, softcap) -> None:
    fake = fake_flash(page_multiple=8)
    query, k_cache, v_cache, table, clean, cu, lens = make_varlen_case(2, CHUNKS, 6, 2, 32, 8, dtype)
    cu_k = torch.zeros_like(cu)
    cu_k[1:] = lens.cumsum(0)
    max_q, max_k = max(q for q, _ in CHUNKS), int(lens.max())
    out = flash_ops.varlen_prefill_attention(
        query,
        k_cache,
        v_cache,
        table,
        cu,
        cu_k,
        0.2,
        sliding_window,
        softcap,
        max_q_len=max_q,
        max_k_len=max_k,
    )
    want = varlen.varlen_prefill_attention(
        query.float(), k_cache.float(), v_cache.float(), clean, cu, lens, 0.2, sliding_window, softcap
    )
    assert out.dtype == dtype
    assert_close(out.float(), want, dtype)
    call = fake.varlen.calls[-1]
    assert call["causal"] is True and call["softmax_scale"] == 0.2
    assert call["window_size"] == ((-1, -1) if sliding_window is None else (sliding_window - 1, 0))
    assert call["softcap"] == (0.0 if softcap is None else softcap)
    assert (call["max_seqlen_q"], call["max_seqlen_k"]) == (max_q, max_k)
    assert call["k"] is k_cache and call["block_table"] is table  # the cache read in place


def test_varlen_prefill_at_the_real_page_size(fake_flash) -> None:
    fake_flash()  # pages of 256 tokens, as flash-attn 2 requires
    chunks = [(300, 0), (7, 500), (40, 216)]
    query, k_cache, v_cache, table, clean, cu, lens = make_varlen_case(
        1, chunks, 8, 2, 64, 256, torch.bfloat16
    )
    cu_k = torch.zeros_like(cu)
    cu_k[1:] = lens.cumsum(0)
    out = flash_ops.varlen_prefill_attention(
        query, k_cache, v_cache, table, cu, cu_k, 0.125, 100, max_q_len=300, max_k_len=507
    )
    want = varlen.varlen_prefill_attention(
        query.float(), k_cache.float(), v_cache.float(), clean, cu, lens, 0.125, 100
    )
    assert_close(out.float(), want, torch.bfloat16)


def test_paged_varlen_is_found_by_its_signature(fake_flash) -> None:
    fake_flash(varlen="paged")
    assert flash_ops.varlen_available()
    fake_flash(varlen="unpaged")  # a flash_attn_varlen_func without block_table
    assert flash_ops.HAS_FLASH_ATTN and not flash_ops.varlen_available()
    fake_flash(varlen=None)
    assert not flash_ops.varlen_available()
    query, k_cache, v_cache, table, _, cu, _ = make_varlen_case(0, CHUNKS, 4, 2, 16, 8, torch.bfloat16)
    with pytest.raises(RuntimeError, match="flash_attn_varlen_func"):
        flash_ops.varlen_prefill_attention(
            query, k_cache, v_cache, table, cu, cu, 0.2, max_q_len=17, max_k_len=52
        )


def test_flash_backend_attends_a_step_in_one_varlen_call(fake_flash) -> None:
    """``FlashAttnBackend.prefill``: every chunk of a built step in one flash call, reading the
    step's varlen metadata as it is (no copies, nothing to launch)."""
    from types import SimpleNamespace

    from cbgen.model.attention import paged_attention_forward
    from cbgen.model.backends import FlashAttnBackend

    fake = fake_flash(page_multiple=8)
    backend = FlashAttnBackend(torch.device("cpu"))
    batch = build_step([(5, 0), (18, 9), (3, 30), (40, 0)], decodes=[4, 11], seed=6)
    meta = batch.meta
    k_cache, v_cache = (c.to(torch.bfloat16) for c in step_caches(3, torch.float32))
    meta.kv_caches, meta.backend = [(k_cache, v_cache)], backend
    gen = torch.Generator().manual_seed(4)
    query = torch.randn(1, batch.num_tokens, 6, 16, generator=gen).to(torch.bfloat16).transpose(1, 2)
    key, value = (
        torch.randn(1, batch.num_tokens, 2, 16, generator=gen).to(torch.bfloat16).transpose(1, 2)
        for _ in range(2)
    )
    out, _ = paged_attention_forward(
        SimpleNamespace(layer_idx=0), query, key, value, None, scaling=0.25, sliding_window=9, cbgen_meta=meta
    )
    (call,) = fake.varlen.calls
    info = meta.varlen
    assert call["block_table"] is info.block_table and call["cu_seqlens_k"] is info.cu_seqlens_k
    assert call["cu_seqlens_q"] is info.cu_seqlens_q and call["max_seqlen_q"] == 40
    q = query[0].transpose(0, 1)
    assert_close(out[0].float(), step_reference(batch, q, k_cache, v_cache, 9, None), torch.bfloat16)


def test_flash_backend_without_paged_varlen_falls_back(fake_flash, monkeypatch) -> None:
    """An older flash-attn: the Triton varlen kernel where Triton runs, else the torch strategies."""
    from cbgen.model import backends
    from cbgen.model.kernels.triton import ops as triton_ops

    fake_flash(page_multiple=8, varlen="unpaged")
    backend = backends.FlashAttnBackend(torch.device("cpu"))
    assert backend.varlen_kernel is (backends._triton_varlen if triton_ops.available("cpu") else None)
    monkeypatch.setattr(triton_ops, "available", lambda device: False)
    backend = backends.FlashAttnBackend(torch.device("cpu"))
    assert backend.varlen_kernel is None
    batch = build_step([(5, 0), (18, 9)], decodes=[], seed=1)
    meta = batch.meta
    k_cache, v_cache = step_caches(2, torch.float32)
    meta.kv_caches = [(k_cache, v_cache)]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch.num_tokens, 4, 16, generator=gen)
    k, v = (torch.randn(batch.num_tokens, 2, 16, generator=gen) for _ in range(2))
    paged_ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    backend.prefill(meta, q, k, v, k_cache, v_cache, LayerAttention(0.25), out)
    assert_close(out, step_reference(batch, q, k_cache, v_cache, None, None), torch.float32)
