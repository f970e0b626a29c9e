"""The panel GEMM (``csrc/cpu_panel.c``, a candidate of the measured GEMM choice): the packed layout,
``F.linear`` at every tile and chunk edge in both dtypes, argument checks before any memory is
touched, and the engine's greedy tokens with it forced for every row class."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.native("avx2")


@pytest.fixture(scope="module")
def panel():
    from cbgen.model.kernels.cpu import panel as cpu_panel

    assert cpu_panel.panel_available()
    return cpu_panel


def test_pack_layout(panel) -> None:
    """Column n of the weight is lane n % 16 of panel n // 16, in the weight's dtype; the lanes past N
    are zero."""
    for dtype, panel_dtype in (
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),  # widened exactly
        (torch.bfloat16, torch.bfloat16),
    ):
        weight = torch.randn(37, 9).to(dtype)
        packed = panel.panel_pack(weight, panel_dtype)
        assert packed.shape == (3, 9, 16) and packed.dtype == panel_dtype
        for n in range(37):
            assert torch.equal(packed[n // 16, :, n % 16], weight[n].to(panel_dtype))
        assert not packed[2, :, 37 - 32 :].any()
    with pytest.raises(ValueError):
        panel.panel_pack(torch.randn(37, 9), torch.bfloat16)  # float32 weights are never narrowed


@pytest.mark.parametrize(
    ("dtype", "panel_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)],
)
@pytest.mark.parametrize(("n", "k"), [(203, 576), (48, 37), (16, 8), (5, 1)])
def test_equals_f_linear(panel, dtype: torch.dtype, panel_dtype: torch.dtype, n: int, k: int) -> None:
    """Row counts on both sides of the 6-row tile and the 192-row chunk, output widths that are and
    are not multiples of the 16-column panel, with and without bias, x rows with a stride."""
    gen = torch.Generator().manual_seed(n * k)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    packed = panel.panel_pack(weight, panel_dtype)
    wide = torch.randn(400, k + 3, generator=gen).to(dtype)
    # float32: sums in another order; bf16: one rounding of the output, as torch's bf16 GEMM
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for rows in (1, 5, 6, 7, 64, 191, 192, 193, 400):
        x = wide[:rows, :k]
        for b in (None, bias):
            got = panel.panel_linear(x, packed, n, b)
            assert got.dtype == dtype and got.shape == (rows, n)
            expected = nn.functional.linear(x.float(), weight.float(), None if b is None else b.float())
            torch.testing.assert_close(got.float(), expected, atol=tol * max(1, k**0.5), rtol=tol)


@pytest.mark.parametrize("n", [64, 203])
def test_bf16_output_is_the_float32_result_rounded_once(panel, n: int) -> None:
    """The bfloat16 output (vector rounding for whole panels, scalar for the last partial one) is the
    float32 GEMM's result, bias added, rounded to nearest even: bit for bit what torch's cast does."""
    gen = torch.Generator().manual_seed(n)
    weight = torch.randn(n, 96, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    x = torch.randn(13, 96, generator=gen).to(torch.bfloat16)
    packed = panel.panel_pack(weight, torch.float32)
    for b in (None, bias):
        got = panel.panel_linear(x, packed, n, b)
        wide = panel.panel_linear(x.float(), packed, n, None if b is None else b.float())
        assert torch.equal(got, wide.to(torch.bfloat16))


@pytest.mark.parametrize("panel_dtype", [torch.float32, torch.bfloat16])
def test_threads_split_panels_without_changing_bits(panel, panel_dtype) -> None:
    """Panels are shared out in contiguous ranges (cbgen_ranges.h): with 1, 2 or 3 threads (more
    than this machine may have cores), fewer panels than threads, and rows over two 192-row chunks,
    every output column is computed, with the same bits."""
    gen = torch.Generator().manual_seed(12)
    before = torch.get_num_threads()
    try:
        for n in (20, 64, 1000):
            weight = torch.randn(n, 96, generator=gen).to(torch.bfloat16)
            packed = panel.panel_pack(weight, panel_dtype)
            for rows in (1, 17, 200):
                x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
                results = []
                for threads in (1, 2, 3):
                    torch.set_num_threads(threads)
                    results.append(panel.panel_linear(x, packed, n))
                assert all(torch.equal(r, results[0]) for r in results[1:])
                expected = nn.functional.linear(x.float(), weight.float())
                torch.testing.assert_close(results[0].float(), expected, atol=1e-1, rtol=2e-2)
    finally:
        torch.set_num_threads(before)


def test_refuses_what_it_cannot_take(panel) -> None:
    weight = torch.randn(40, 24)
    packed = panel.panel_pack(weight)
    with pytest.raises(ValueError):
        panel.panel_linear(torch.zeros(0, 24), packed, 40)  # no rows
    with pytest.raises(ValueError):
        panel.panel_linear(torch.zeros(3, 25), packed, 40)  # width differs from the weight's
    with pytest.raises(ValueError):
        panel.panel_linear(torch.zeros(3, 24), packed, 49)  # more columns than the panels hold
    with pytest.raises(ValueError):
        panel.panel_linear(torch.zeros(24, 3).t(), packed, 40)  # column-major x
    with pytest.raises(ValueError):
        panel.panel_linear(torch.zeros(3, 24), packed, 40, torch.zeros(39))  # bias length
    with pytest.raises(ValueError):
        panel.panel_linear(torch.zeros(3, 24, dtype=torch.float16), packed, 40)
    with pytest.raises(ValueError):  # bfloat16 panels take bfloat16 inputs only
        panel.panel_linear(torch.zeros(3, 24), panel.panel_pack(weight.bfloat16(), torch.bfloat16), 40)
    with pytest.raises(ValueError):
        panel.panel_pack(weight.t())  # column-major weight
    # The C entry points check sizes themselves too: a packed size that does not match is refused
    # before anything is read.
    from cbgen.model.kernels.cpu.ops import library

    x, out = torch.zeros(3, 24), torch.empty(3, 40)
    lib = library()
    args = (
        x.data_ptr(),
        24,
        packed.data_ptr(),
        packed.numel() - 1,
        None,
        out.data_ptr(),
        40,
        3,
        40,
        24,
        0,
        0,
    )
    assert lib.cbgen_panel_gemm(*args) == 1
    args = (weight.data_ptr(), 24, 40, 24, 0, packed.data_ptr(), packed.numel() + 16, 0)
    assert lib.cbgen_panel_pack(*args) == 1
    args = (weight.data_ptr(), 24, 40, 24, 0, packed.data_ptr(), packed.numel(), 1)  # fp32 -> bf16 panels
    assert lib.cbgen_panel_pack(*args) == 1


def test_is_a_gemm_candidate(panel) -> None:
    from cbgen.model.cpu_fast import gemm_choice

    assert "panel" in gemm_choice.candidates(torch.float32)
    assert {"panel", "panel_bf16"} <= set(gemm_choice.candidates(torch.bfloat16))


def test_engine_with_panel_for_every_row_class_equals_generate(monkeypatch, panel) -> None:
    """Prefill chunks (the LM head of a chunk that samples nothing has zero rows: F.linear takes
    it), batched and single-row decode steps, all projections on the panel GEMM: greedy tokens equal
    ``generate()``."""
    from cbgen import LLM, SamplingParams
    from oracle import compare, hf_greedy
    from tiny_models import make_model

    monkeypatch.setenv("CBGEN_GEMM", "panel")
    # Projections of at least 2^16 weights, so PackedLinears hands them to the plan's candidates.
    model = make_model("llama", hidden_size=256, intermediate_size=512, num_attention_heads=4)
    prompts = [[(i * 37 + j) % 500 + 3 for i in range(150 if j == 0 else 20 + j)] for j in range(4)]
    llm = LLM(model, None, max_num_batched_tokens=64, num_blocks=128, block_size=16)
    assert llm.engine.runner is not None
    lengths = [12, 3, 5, 8]  # sequences finish apart, so the last steps have fewer rows, then one
    out = llm.generate(
        prompts,
        [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in lengths],
        use_tqdm=False,
    )
    got = [list(o.outputs[0].token_ids) for o in out]
    compare(model, prompts, got, [hf_greedy(model, p, m) for p, m in zip(prompts, lengths)])


# The AVX-512 panel GEMMs (csrc/cpu_panel512.c): panels of 32 columns, float32 by k, bfloat16 by k
# pairs through vdpbf16ps.
P512 = [
    pytest.param(torch.float32, "panel512", id="fp32", marks=pytest.mark.native("avx512")),
    pytest.param(torch.bfloat16, "dpbf16", id="bf16", marks=pytest.mark.native("avx512", "avx512bf16")),
]


@pytest.mark.parametrize(("dtype", "name"), P512)
def test_panel512_pack_layout(panel, dtype, name) -> None:
    """float32: column n at lane n % 32 of panel n // 32, per k; bfloat16: column n's pair i at lane
    n % 32 of pair row i.  The slot past an odd K and the columns past N are zero; the weight keeps
    its dtype."""
    weight = torch.randn(37, 9).to(dtype)
    packed = panel.panel512_pack(weight)
    assert packed.dtype == dtype and packed.shape == panel.panel512_shape(37, 9, dtype)
    for n in range(37):
        if dtype == torch.float32:
            assert torch.equal(packed[n // 32, :, n % 32], weight[n])
        else:
            for i in range(5):
                pair = [weight[n, 2 * i], weight[n, 2 * i + 1] if 2 * i + 1 < 9 else 0]
                assert packed[n // 32, i, n % 32].tolist() == [float(v) for v in pair]
    assert not packed[1, :, 37 - 32 :].any()


@pytest.mark.parametrize(("dtype", "name"), P512)
@pytest.mark.parametrize(("n", "k"), [(203, 576), (64, 1536), (48, 37), (32, 8), (5, 1)])
def test_panel512_equals_f_linear(panel, dtype, name, n: int, k: int) -> None:
    """Row counts on both sides of the 14-row tile and the 192-row chunk, widths on and off the
    32-column panel (masked stores), odd K, with and without bias, x rows at a stride, and into a
    given ``out`` (nothing written outside it)."""
    gen = torch.Generator().manual_seed(n * k)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    packed = panel.panel512_pack(weight)
    wide = torch.randn(400, k + 3, generator=gen).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # sums in another order; bf16: one output rounding
    for rows in (1, 5, 13, 14, 15, 64, 191, 192, 193, 400):
        x = wide[:rows, :k]
        for b in (None, bias):
            got = panel.panel512_linear(x, packed, n, b)
            assert got.dtype == dtype and got.shape == (rows, n)
            expected = nn.functional.linear(x.float(), weight.float(), None if b is None else b.float())
            torch.testing.assert_close(got.float(), expected, atol=tol * max(1, k**0.5), rtol=tol)
    into = torch.full((7, n + 5), 7.0).to(dtype)
    panel.panel512_linear(wide[:6, :k], packed, n, bias, out=into[:6, :n])
    assert torch.equal(into[:6, :n], panel.panel512_linear(wide[:6, :k], packed, n, bias))
    assert (into[6] == 7).all() and (into[:, n:] == 7).all()


@pytest.mark.parametrize(("dtype", "name"), P512)
def test_panel512_rows_do_not_depend_on_the_batch(panel, dtype, name) -> None:
    """Each output element is one chain over k (bf16: over k pairs): a row alone, in a tile or at any
    place of a large batch gets the same bits (what parity mode's bfloat16 products rely on).  The
    float32 chain is the AVX2 panel GEMM's, FMA by FMA: the same bits as it too."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(70, 301, generator=gen).to(dtype)
    packed = panel.panel512_pack(weight)
    x = torch.randn(250, 301, generator=gen).to(dtype)
    whole = panel.panel512_linear(x, packed, 70)
    for r in (0, 13, 14, 191, 192, 249):
        assert torch.equal(panel.panel512_linear(x[r : r + 1].clone(), packed, 70), whole[r : r + 1])
    if dtype == torch.float32:
        assert torch.equal(whole, panel.panel_linear(x, panel.panel_pack(weight), 70))


@pytest.mark.parametrize(("dtype", "name"), P512)
def test_panel512_threads_split_panels_without_changing_bits(panel, dtype, name) -> None:
    """Each thread takes a contiguous range of panels and then what the others left: with 1, 2 or 3
    threads (more than this machine may have cores), and with fewer panels than threads, every
    output column is written once, with the same bits."""
    gen = torch.Generator().manual_seed(11)
    before = torch.get_num_threads()
    try:
        for n in (20, 64, 1000):
            weight = torch.randn(n, 96, generator=gen).to(dtype)
            packed = panel.panel512_pack(weight)
            x = torch.randn(17, 96, generator=gen).to(dtype)
            results = []
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                out = torch.full((17, n), float("nan")).to(dtype)
                results.append(panel.panel512_linear(x, packed, n, out=out))
                assert not out.isnan().any()
            assert all(torch.equal(r, results[0]) for r in results[1:])
            expected = nn.functional.linear(x.float(), weight.float())
            torch.testing.assert_close(results[0].float(), expected, atol=1e-2, rtol=2e-2)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("dtype", "name"), P512)
def test_panel512_refuses_what_it_cannot_take(panel, dtype, name) -> None:
    weight = torch.randn(40, 24).to(dtype)
    packed = panel.panel512_pack(weight)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    for bad in (
        lambda: panel.panel512_linear(torch.zeros(0, 24, dtype=dtype), packed, 40),  # no rows
        lambda: panel.panel512_linear(torch.zeros(3, 25, dtype=dtype), packed, 40),  # width differs
        lambda: panel.panel512_linear(torch.zeros(3, 24, dtype=dtype), packed, 65),  # more columns
        lambda: panel.panel512_linear(torch.zeros(24, 3, dtype=dtype).t(), packed, 40),  # column-major
        lambda: panel.panel512_linear(
            torch.zeros(3, 24, dtype=dtype), packed, 40, torch.zeros(39, dtype=dtype)
        ),
        lambda: panel.panel512_linear(torch.zeros(3, 24, dtype=other), packed, 40),  # x of another dtype
        lambda: panel.panel512_linear(
            torch.zeros(3, 24, dtype=dtype), packed, 40, out=torch.empty(3, 39, dtype=dtype)
        ),
        lambda: panel.panel512_pack(torch.randn(40, 24, dtype=torch.float16)),
    ):
        with pytest.raises(ValueError):
            bad()
    from cbgen.model.kernels.cpu.ops import library

    lib = library()
    gemm, pack = (
        (lib.cbgen_p512_gemm, lib.cbgen_p512_pack)
        if dtype == torch.float32
        else (lib.cbgen_dp_gemm, lib.cbgen_dp_pack)
    )
    x, out = torch.zeros(3, 24, dtype=dtype), torch.empty(3, 40, dtype=dtype)
    args = [x.data_ptr(), 24, packed.data_ptr(), packed.numel() - 1, None, out.data_ptr(), 40, 3, 40, 24]
    assert gemm(*args) == 1  # a packed size that does not match: refused before any read
    args[3], args[1] = packed.numel(), 23  # x rows shorter than K
    assert gemm(*args) == 1
    assert pack(weight.data_ptr(), 24, 40, 24, packed.data_ptr(), packed.numel() + 64) == 1


@pytest.mark.parametrize(("dtype", "name"), P512)
def test_panel512_is_a_gemm_candidate_and_the_engine_equals_generate(monkeypatch, panel, dtype, name) -> None:
    """A candidate for its own dtype only; with every row class forced onto it (prefill chunks,
    batched and single-row decode steps, the one-call C step), greedy tokens equal ``generate()``
    (bf16: under the bf16 near-tie rule of ``tests/oracle.py``) on a model wide enough for whole
    panels and tiles."""
    from cbgen import LLM, SamplingParams
    from cbgen.model.cpu_fast import gemm_choice
    from oracle import BF16, FP32, compare, hf_greedy
    from tiny_models import make_prompts, make_wide_model

    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    assert name in gemm_choice.candidates(dtype) and name not in gemm_choice.candidates(other)
    monkeypatch.setenv("CBGEN_GEMM", name)
    model = make_wide_model("llama", dtype=dtype)
    prompts = make_prompts(6, (4, 40), vocab=model.config.vocab_size, seed=4)
    llm = LLM(model, block_size=8, max_num_batched_tokens=64)
    plan = llm.engine.runner.plan
    assert plan.gemms.names() == dict.fromkeys(gemm_choice.ROW_CLASSES, name)
    assert plan.c_step == frozenset(gemm_choice.ROW_CLASSES)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    refs = [hf_greedy(model, p, 8) for p in prompts]
    rule = FP32 if dtype == torch.float32 else BF16
    compare(model, prompts, [o.outputs[0].token_ids for o in outs], refs, rule=rule)
