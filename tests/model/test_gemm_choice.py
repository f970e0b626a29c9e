"""The projection GEMMs are chosen by timing them on the machine: with injected timings, the choice
picks the fastest per row class, is cached and reloaded without timing again, is never read back on
another CPU, and can be forced through CBGEN_GEMM."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cbgen.model.cpu_fast import gemm_choice
from cbgen.model.cpu_fast.gemm_choice import PLAIN, Candidate, GemmPlan
from cbgen.model.cpu_fast.packed_linears import PackedLinears

SHAPES = [(384, 256), (256, 256)]


@pytest.fixture(autouse=True)
def _measured_choice(monkeypatch):
    """These tests are about the measured choice: no fixed GEMM from the test run (conftest)."""
    monkeypatch.delenv("CBGEN_GEMM", raising=False)


def _fake(name: str, serves_prefill: bool = True) -> Candidate:
    def apply(x, packed, weight, bias):
        if not serves_prefill and x.shape[0] != gemm_choice.DECODE_ROWS:
            return None
        return nn.functional.linear(x, weight, bias) + (packed if packed is not None else 0)

    return Candidate(name, lambda w: torch.zeros(()), apply)


FOUND = {
    "plain": PLAIN,
    "fast_small": _fake("fast_small", serves_prefill=False),
    "fast_big": _fake("fast_big"),
}
TIMES = {
    ("plain", gemm_choice.SINGLE_ROWS): 2.0,
    ("fast_small", gemm_choice.SINGLE_ROWS): None,  # does not serve this row count
    ("fast_big", gemm_choice.SINGLE_ROWS): 1.5,
    ("plain", gemm_choice.DECODE_ROWS): 3.0,
    ("fast_small", gemm_choice.DECODE_ROWS): 1.0,
    ("fast_big", gemm_choice.DECODE_ROWS): 2.0,
    ("plain", gemm_choice.PREFILL_ROWS): 9.0,
    ("fast_small", gemm_choice.PREFILL_ROWS): None,  # does not serve this row count
    ("fast_big", gemm_choice.PREFILL_ROWS): 5.0,
}


# Each candidate is timed once per round and row class, except where it does not serve the rows
# (asked once): fast_small serves neither single nor prefill rows.
CALLS = 9 * gemm_choice.TIMING_ROUNDS - 2 * (gemm_choice.TIMING_ROUNDS - 1)


class Timer:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, cand, layers, rows):
        self.calls += 1
        assert layers and all(w.shape == torch.Size(s) for w, s in zip(layers[0], SHAPES))
        return TIMES[(cand.name, rows)]


def _layers():
    return [[torch.zeros(s) for s in SHAPES] for _ in range(3)]


def test_a_burst_of_load_in_one_round_does_not_decide(tmp_path):
    """The fastest candidate's first turn runs during a burst of load (10x slower): it still wins,
    because every candidate keeps its best turn."""
    timer = Timer()
    seen: set[str] = set()

    def bursty(cand, layers, rows):
        t = timer(cand, layers, rows)
        if cand.name == "fast_small" and t is not None and cand.name not in seen:
            seen.add(cand.name)
            return t * 10
        return t

    plan = _choose(tmp_path, bursty)
    assert (plan.decode.name, plan.prefill.name) == ("fast_small", "fast_big")


def _choose(tmp_path, timer, **kw):
    return gemm_choice.choose(
        torch.float32, SHAPES, _layers, timer=timer, cache_path=tmp_path / "choice.json", found=FOUND, **kw
    )


def test_picks_the_fastest_per_row_class_and_caches_it(tmp_path):
    timer = Timer()
    plan = _choose(tmp_path, timer)
    assert (plan.single.name, plan.decode.name, plan.prefill.name) == ("fast_big", "fast_small", "fast_big")
    assert plan.source == "measured"
    assert timer.calls == CALLS  # 3 candidates x 3 row classes, in turns
    again = _choose(tmp_path, timer)
    assert (again.single.name, again.decode.name, again.prefill.name) == (
        "fast_big",
        "fast_small",
        "fast_big",
    )
    assert again.source == "cache"
    assert timer.calls == CALLS, "a cached choice must not be timed again"


def test_a_cache_from_another_cpu_is_not_used(tmp_path, monkeypatch):
    timer = Timer()
    _choose(tmp_path, timer)
    monkeypatch.setattr(gemm_choice, "cpu_key", lambda: "x86_64|model name: Another CPU|flags: avx2")
    plan = _choose(tmp_path, timer)
    assert plan.source == "measured" and timer.calls == 2 * CALLS


def test_the_environment_forces_a_choice(tmp_path, monkeypatch):
    timer = Timer()
    monkeypatch.setenv("CBGEN_GEMM", "decode=fast_big,prefill=plain")
    plan = _choose(tmp_path, timer)
    assert (plan.decode.name, plan.prefill.name, plan.source) == ("fast_big", "plain", "CBGEN_GEMM")
    assert plan.single.name == "fast_big"  # decode= covers single rows too unless single= is given
    monkeypatch.setenv("CBGEN_GEMM", "single=plain,decode=fast_small,prefill=fast_big")
    forced = _choose(tmp_path, timer)
    assert (forced.single.name, forced.decode.name, forced.prefill.name) == (
        "plain",
        "fast_small",
        "fast_big",
    )
    monkeypatch.setenv("CBGEN_GEMM", "fast_big")
    assert _choose(tmp_path, timer).prefill.name == "fast_big"
    assert timer.calls == 0
    monkeypatch.setenv("CBGEN_GEMM", "no_such_gemm")
    with pytest.raises(ValueError, match="no_such_gemm"):
        _choose(tmp_path, timer)


def test_packed_linears_run_each_row_class_on_its_winner():
    gen = torch.Generator().manual_seed(0)
    layer = nn.Linear(256, 384)
    marker = {"decode": 100.0, "prefill": 200.0}

    def cand(name):
        return Candidate(
            name,
            lambda w: torch.tensor(marker[name]),
            lambda x, p, w, b: torch.full((x.shape[0], 384), float(p)),
        )

    marker["single"] = 300.0
    plan = GemmPlan(cand("decode"), cand("prefill"), single=cand("single"))
    packed = PackedLinears(torch.float32, plan=plan)
    one = packed(torch.randn(gemm_choice.SINGLE_MAX_ROWS, 256, generator=gen), layer)
    small = packed(torch.randn(gemm_choice.SINGLE_MAX_ROWS + 1, 256, generator=gen), layer)
    big = packed(torch.randn(gemm_choice.SPLIT_ROWS + 1, 256, generator=gen), layer)
    assert torch.all(one == 300.0) and torch.all(small == 100.0) and torch.all(big == 200.0)


def test_every_real_candidate_computes_f_linear():
    """Whatever this machine offers computes the same projection (the choice is about speed only)."""
    gen = torch.Generator().manual_seed(1)
    layer = nn.Linear(256, 384)
    for dtype in (torch.float32, torch.bfloat16):
        mod = nn.Linear(256, 384).to(dtype)
        mod.load_state_dict(layer.to(dtype).state_dict())
        for cand in gemm_choice.candidates(dtype).values():
            for rows in (1, 3, gemm_choice.DECODE_ROWS, 300):
                x = torch.randn(rows, 256, generator=gen).to(dtype)
                packed = cand.pack(mod.weight.detach()) if cand.pack is not None else None
                out = cand.apply(x, packed, mod.weight, mod.bias)
                if out is None:
                    continue
                tol = 1e-4 if dtype == torch.float32 else 3e-2
                torch.testing.assert_close(
                    out.float(), nn.functional.linear(x, mod.weight, mod.bias).float(), atol=tol, rtol=tol
                )


@pytest.mark.native("c")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [576, 37, 8])
def test_gemv_kernel(dtype: torch.dtype, k: int) -> None:
    """The C kernel of the ``gemv`` candidate: every row count it takes, widths that are and are not
    multiples of its 8 lanes, output widths that are not multiples of its 4-row groups, with and
    without bias, strided x rows; it refuses what it cannot take before reading anything."""
    from cbgen.model.kernels.cpu import ops as cpu_kernels

    gen = torch.Generator().manual_seed(k)
    weight = torch.randn(203, k, generator=gen).to(dtype)
    bias = torch.randn(203, generator=gen).to(dtype)
    wide = torch.randn(cpu_kernels.GEMV_MAX_ROWS, k + 5, generator=gen).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 1e-2  # float32 sums of 576 terms in another order
    for rows in range(1, cpu_kernels.GEMV_MAX_ROWS + 1):
        x = wide[:rows, :k]  # rows k + 5 apart
        for b in (None, bias):
            expected = nn.functional.linear(x.float(), weight.float(), None if b is None else b.float())
            torch.testing.assert_close(cpu_kernels.gemv(x, weight, b).float(), expected, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="1-8 rows"):
        cpu_kernels.gemv(torch.zeros(9, k, dtype=dtype), weight)
    with pytest.raises(ValueError):
        cpu_kernels.gemv(torch.zeros(1, k + 1, dtype=dtype), weight)  # width differs from the weight's
    with pytest.raises(ValueError):
        cpu_kernels.gemv(torch.zeros(1, k, dtype=dtype), weight.t().contiguous().t())  # column-major
    with pytest.raises(ValueError):
        cpu_kernels.gemv(torch.zeros(1, k, dtype=torch.float16), weight.half())


@pytest.mark.native("c")
def test_engine_with_gemv_for_single_rows_equals_generate(monkeypatch):
    """One sequence through the engine with ``gemv`` forced for one-row steps: a prompt longer than
    the token budget (prefill chunks that sample nothing give the LM head zero rows, which gemv
    hands back to F.linear), then single-row decode steps; greedy tokens equal ``generate()``."""
    from cbgen import LLM, SamplingParams
    from oracle import compare, hf_greedy
    from tiny_models import make_model

    monkeypatch.setenv("CBGEN_GEMM", "single=gemv,decode=plain,prefill=plain")
    # Projections of at least 2^16 weights, so PackedLinears hands them to the plan's candidates.
    model = make_model("llama", hidden_size=256, intermediate_size=512, num_attention_heads=4)
    prompt = [(i * 37) % 500 + 3 for i in range(150)]
    llm = LLM(model, None, max_num_batched_tokens=64, num_blocks=64, block_size=16)
    assert llm.engine.runner is not None
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    got = list(out[0].outputs[0].token_ids)
    compare(model, [prompt], [got], [hf_greedy(model, prompt, 12)])
