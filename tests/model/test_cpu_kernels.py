"""C kernels (``cbgen.model.kernels.cpu.ops``) vs the torch reference, and their selection by the engine."""

from __future__ import annotations

import pytest
import torch
from paged_cases import LENS, NUM_BLOCKS, check_decode, make_case

from cbgen import LLM, SamplingParams
from cbgen.model.backends import backend_choice, make_backend
from cbgen.model.kernels.cpu import amx as cpu_amx
from cbgen.model.kernels.cpu import ops as cpu_kernels
from cbgen.model.kernels.reference import paged_ops

pytestmark = pytest.mark.native("c")

# More than 16 rows switches the kernel from one task per (row, kv head) to one task per row.
MANY_LENS = [(i * 37) % 150 + 1 for i in range(40)]
# Each of the decode kernel's loops, by name: "avx512" (the fastest, where the CPU has AVX-512),
# "avx2" (AVX2 + FMA) and the portable C loops.  A build without a vector path would silently run the
# portable loops again, so those cases skip by name where the CPU lacks it.
IMPLS = [
    pytest.param(cpu_kernels.IMPL_FAST, id="avx512", marks=pytest.mark.native("avx512")),
    pytest.param(cpu_kernels.IMPL_AVX2, id="avx2", marks=pytest.mark.native("avx2")),
    pytest.param(cpu_kernels.IMPL_PORTABLE, id="portable"),
]
# The same loops with their prefetches into L2 (where the lines go changes no result, but the
# prefetch walk runs over the same blocks and must stay inside them: the ASan run covers that).
L2_IMPLS = [
    pytest.param(
        cpu_kernels.IMPL_FAST | cpu_kernels.IMPL_PREFETCH_L2,
        id="avx512-l2",
        marks=pytest.mark.native("avx512"),
    ),
    pytest.param(
        cpu_kernels.IMPL_AVX2 | cpu_kernels.IMPL_PREFETCH_L2, id="avx2-l2", marks=pytest.mark.native("avx2")
    ),
]


def _check_decode(*args, window=None, **kwargs) -> None:
    check_decode(cpu_kernels.paged_decode_attention, *args, sliding_window=window, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 8, 16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(2, 2, 16), (9, 3, 64), (8, 2, 64), (4, 1, 128), (6, 3, 24), (2, 1, 256)],
)
@pytest.mark.parametrize("lens", [LENS, MANY_LENS], ids=["few-rows", "many-rows"])
@pytest.mark.parametrize("impl", IMPLS)
def test_decode_matches_reference(dtype, block_size, num_heads, num_kv_heads, head_dim, lens, impl) -> None:
    """Every loop variant the CPU has (AVX-512: head sizes that are multiples of 16; AVX2: of 8)
    and the portable one; head_dim 24 takes the AVX2 or portable loops."""
    _check_decode(
        lens,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        seed=head_dim + block_size,
        impl=impl,
    )


@pytest.mark.parametrize("window", [1, 5, 16, 33, 100])
@pytest.mark.parametrize("lens", [LENS, MANY_LENS], ids=["few-rows", "many-rows"])
@pytest.mark.parametrize("impl", IMPLS)
def test_decode_sliding_window(window: int, lens, impl: int) -> None:
    _check_decode(lens, 4, 2, 32, 8, torch.float32, seed=window, window=window, impl=impl)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [0.5, 30.0])
@pytest.mark.parametrize("impl", IMPLS)
def test_decode_softcap_and_window(dtype: torch.dtype, softcap: float, impl: int) -> None:
    _check_decode(MANY_LENS, 4, 1, 32, 16, dtype, seed=3, softcap=softcap, impl=impl)
    _check_decode(LENS, 8, 2, 32, 16, dtype, seed=4, window=20, softcap=softcap, impl=impl)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("lens", "window"),
    [([3000], None), ([1100, 520, 9], None), ([2500, 700], 600), ([513, 4000], 1500)],
    ids=["one-row", "three-rows", "window", "window-longer"],
)
def test_decode_long_contexts_split_into_chunks(dtype: torch.dtype, impl: int, lens, window) -> None:
    """Few rows with long contexts: each row's context is cut into chunks whose partial softmaxes
    are merged (rows of other lengths, and sliding windows, in the same call)."""
    _check_decode(lens, 9, 3, 64, 16, dtype, seed=len(lens), window=window, impl=impl)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", L2_IMPLS)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (4, 4, 32), (16, 2, 64)]
)
@pytest.mark.parametrize("lens", [LENS, MANY_LENS, [3000, 40]], ids=["few-rows", "many-rows", "long"])
def test_decode_with_prefetches_into_l2(dtype, impl, num_heads, num_kv_heads, head_dim, lens) -> None:
    _check_decode(lens, num_heads, num_kv_heads, head_dim, 16, dtype, seed=head_dim, impl=impl)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "v_head_dim"),
    [(4, 4, 40, 16), (16, 16, 192, 128), (8, 2, 24, 32), (2, 1, 96, 64), (3, 3, 8, 5)],
)
@pytest.mark.parametrize("lens", [LENS, MANY_LENS, [1200, 3]], ids=["few-rows", "many-rows", "long"])
@pytest.mark.parametrize("impl", IMPLS)
def test_decode_with_values_of_another_head_size(
    dtype, num_heads, num_kv_heads, head_dim, v_head_dim, lens, impl
):
    """Latent attention's expanded keys and values (DeepSeek 192 / 128, MiniCPM3 96 / 64, the tiny
    test models' 40 / 16) and values wider than keys, through every loop request (the vector loops
    take one size for both, so these run the portable loops whatever is asked), in one task per
    (row, kv head), per row and split into chunks; against the torch reference."""
    _check_decode(lens, num_heads, num_kv_heads, head_dim, 8, dtype, v_head_dim=v_head_dim, impl=impl)
    _check_decode(
        lens, num_heads, num_kv_heads, head_dim, 8, dtype, v_head_dim=v_head_dim, window=33, impl=impl
    )


def test_store_kv_with_values_of_another_head_size() -> None:
    gen = torch.Generator().manual_seed(2)
    heads, k_dim, v_dim, tokens, block_size = 4, 40, 16, 9, 8
    key = torch.randn(tokens, heads, k_dim, generator=gen)
    value = torch.randn(tokens, heads, v_dim, generator=gen)
    slots = torch.randperm(NUM_BLOCKS * block_size, generator=gen)[:tokens]
    slots[3] = -1
    k_cache = torch.randn(NUM_BLOCKS, block_size, heads, k_dim, generator=gen)
    v_cache = torch.randn(NUM_BLOCKS, block_size, heads, v_dim, generator=gen)
    ref_k, ref_v, out_k, out_v = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    paged_ops.store_kv(key, value, ref_k, ref_v, slots)
    cpu_kernels.store_kv(key, value, out_k, out_v, slots)
    assert torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v)
    # Values shaped for another head count, or keys for the value size, are refused before C.
    with pytest.raises(ValueError, match="v_cache"):
        cpu_kernels.store_kv(key, value, out_k, torch.zeros(NUM_BLOCKS, block_size, heads + 1, v_dim), slots)
    with pytest.raises(ValueError, match="value"):
        cpu_kernels.store_kv(key, key, out_k, out_v, slots)
    assert torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v)


@pytest.mark.parametrize("impl", [3, 7, 8, -1])
def test_decode_refuses_an_unknown_impl(impl: int) -> None:
    query, k_cache, v_cache, table, _, seq_lens = make_case(1, [5, 9], 4, 2, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="sizes"):
        cpu_kernels.decode_direct(
            query, k_cache, v_cache, table.to(torch.int32), seq_lens.to(torch.int32), 0.25, 0, 0.0, impl
        )


@pytest.mark.native("avx512", "avx512bf16")
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_decode_bf16_pairs_on_avx512_bf16(head_dim: int) -> None:
    """bf16 queries and keys go straight into ``vdpbf16ps`` (head sizes that are multiples of 32),
    against the float32 reference."""
    for lens in (LENS, MANY_LENS):
        _check_decode(lens, 8, 2, head_dim, 16, torch.bfloat16, seed=head_dim)


def test_decode_float16_takes_the_reference_through_the_plan() -> None:
    """float16 is not the C kernel's: the backend choice gives it the torch reference (whose decode
    is the reference's, bit for bit), and the C entry point refuses it instead of rerouting it."""
    query, k_cache, v_cache, _, clean, seq_lens = make_case(5, [3, 9], 4, 2, 16, 8, torch.float16)
    backend = make_backend(backend_choice("auto", torch.device("cpu"), torch.float16)[0], torch.device("cpu"))
    out = backend.decode_kernel(query, k_cache, v_cache, clean, seq_lens, 0.25)
    expected = paged_ops.paged_decode_attention(query, k_cache, v_cache, clean, seq_lens, 0.25)
    assert backend.name == "torch" and torch.equal(out, expected)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_kernels.paged_decode_attention(query, k_cache, v_cache, clean, seq_lens, 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_kv_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    num_kv_heads, head_dim, num_tokens, block_size = 3, 32, 11, 8
    fused = torch.randn(num_tokens, 2 * num_kv_heads, head_dim + 8, generator=gen)
    key, value = fused[:, :num_kv_heads, :head_dim], fused[:, num_kv_heads:, 8:]  # strided, float32
    slots = torch.randperm(NUM_BLOCKS * block_size, generator=gen)[:num_tokens]
    slots[[2, 5, 10]] = -1
    caches = [
        torch.randn(NUM_BLOCKS, block_size, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2)
    ]
    ref_k, ref_v = (c.clone() for c in caches)
    out_k, out_v = (c.clone() for c in caches)
    paged_ops.store_kv(key, value, ref_k, ref_v, slots)
    cpu_kernels.store_kv(key, value, out_k, out_v, slots.to(torch.int32))
    assert torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v)
    cpu_kernels.store_kv(key[:0], value[:0], out_k, out_v, slots[:0])
    assert torch.equal(out_k, ref_k)


def test_backend_choice() -> None:
    cpu = torch.device("cpu")
    assert backend_choice("auto", cpu, torch.float32)[0] == "cpu"
    assert backend_choice("auto", cpu, torch.bfloat16)[0] == "cpu"
    assert backend_choice("auto", cpu, torch.float16)[0] == "torch"
    assert backend_choice("torch", cpu, torch.float32)[0] == "torch"
    with pytest.raises(ValueError, match="float32/bfloat16"):
        backend_choice("cpu", cpu, torch.float16)


def _no_compiler(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "_error", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("CBGEN_KERNEL_DIR", str(tmp_path))


def test_failed_build_falls_back(monkeypatch, tmp_path) -> None:
    """No compiler: ``available`` is false with a reason, and ``auto`` resolves to torch."""
    _no_compiler(monkeypatch, tmp_path)
    monkeypatch.delenv("CBGEN_REQUIRE_KERNELS", raising=False)
    assert not cpu_kernels.available()
    assert "no-such-compiler" in cpu_kernels.unavailable_reason()
    assert backend_choice("auto", torch.device("cpu"), torch.float32)[0] == "torch"


def test_failed_build_is_an_error_when_kernels_are_required(monkeypatch, tmp_path) -> None:
    """``CBGEN_REQUIRE_KERNELS=1``: the same failure raises, naming the build error, on every call and
    from the engine's backend choice, so no path falls back to torch."""
    _no_compiler(monkeypatch, tmp_path)
    monkeypatch.setenv("CBGEN_REQUIRE_KERNELS", "1")
    for _ in range(2):
        with pytest.raises(cpu_kernels.KernelsRequiredError, match=r"did not build: .*no-such-compiler"):
            cpu_kernels.available()
    with pytest.raises(cpu_kernels.KernelsRequiredError):
        backend_choice("auto", torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_engine_backends_agree(arch: str) -> None:
    """Greedy tokens through the C kernels equal the torch reference path (gemma2: window + soft-cap)."""
    from tiny_models import make_model, make_prompts

    model = make_model(arch)
    prompts = make_prompts(20, lengths=(3, 90))
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    runs = {}
    for backend in ("cpu", "torch"):
        llm = LLM(model, block_size=8, attention_backend=backend)
        assert llm.engine.runner.backend == backend
        runs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert runs["cpu"] == runs["torch"]


amx_only = pytest.mark.native("amx")


@amx_only
@pytest.mark.parametrize(
    ("rows", "n", "k"),
    [(1, 32, 32), (5, 64, 96), (16, 960, 576), (37, 576, 1536), (64, 3072, 576), (300, 96, 64)],
)
@pytest.mark.parametrize("bias", [False, True])
def test_amx_linear_matches_float32_reference(rows: int, n: int, k: int, bias: bool) -> None:
    """bf16 x bf16 -> bf16 with fp32 sums: the float32 product rounded once (one ulp for sums that
    land on a rounding tie in another order), for row counts off the 16-row tile size, more than
    one 256-row chunk, and strided input rows."""
    gen = torch.Generator().manual_seed(rows * n + k)
    weight = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    wide = torch.randn(rows, k + 32, generator=gen).to(torch.bfloat16)
    x = wide[:, 16 : 16 + k]  # row stride k + 32
    got = cpu_amx.amx_linear(x, cpu_amx.amx_pack(weight), b)
    exact = x.float() @ weight.float().T + (b.float() if bias else 0)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), exact, rtol=2**-7, atol=1e-3)
    assert (got != exact.to(torch.bfloat16)).float().mean() < 0.01


@amx_only
def test_amx_rejects_shapes_it_does_not_tile() -> None:
    """Sides that are not multiples of 32 are not packed (the caller keeps oneDNN for those)."""
    assert cpu_amx.amx_supports(torch.zeros(64, 96, dtype=torch.bfloat16))
    assert not cpu_amx.amx_supports(torch.zeros(48, 96, dtype=torch.bfloat16))
    assert not cpu_amx.amx_supports(torch.zeros(64, 40, dtype=torch.bfloat16))
    assert not cpu_amx.amx_supports(torch.zeros(64, 96, dtype=torch.float32))
