"""The projection GEMMs are chosen by timing them on the machine: with injected timings, the choice
picks the fastest per row class, is cached and reloaded without timing again, is never read back on
another CPU, and can be forced through CBGEN_GEMM."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cbgen.model import gemm_choice
from cbgen.model.gemm_choice import PLAIN, Candidate, GemmPlan
from cbgen.model.packed_linears import PackedLinears

SHAPES = [(384, 256), (256, 256)]


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
    ("plain", gemm_choice.DECODE_ROWS): 3.0,
    ("fast_small", gemm_choice.DECODE_ROWS): 1.0,
    ("fast_big", gemm_choice.DECODE_ROWS): 2.0,
    ("plain", gemm_choice.PREFILL_ROWS): 9.0,
    ("fast_small", gemm_choice.PREFILL_ROWS): None,  # does not serve this row count
    ("fast_big", gemm_choice.PREFILL_ROWS): 5.0,
}


# Each candidate is timed once per round, except one that does not serve a row class (asked once).
CALLS = 6 * gemm_choice.TIMING_ROUNDS - (gemm_choice.TIMING_ROUNDS - 1)


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
        if cand.name == "fast_small" and cand.name not in seen:
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
    assert (plan.decode.name, plan.prefill.name, plan.source) == ("fast_small", "fast_big", "measured")
    assert timer.calls == CALLS  # 3 candidates x 2 row classes, in turns
    again = _choose(tmp_path, timer)
    assert (again.decode.name, again.prefill.name, again.source) == ("fast_small", "fast_big", "cache")
    assert timer.calls == CALLS, "a cached choice must not be timed again"


def test_a_cache_from_another_cpu_is_not_used(tmp_path, monkeypatch):
    timer = Timer()
    _choose(tmp_path, timer)
    monkeypatch.setattr(gemm_choice, "_cpu_key", lambda: "x86_64|model name: Another CPU|flags: avx2")
    plan = _choose(tmp_path, timer)
    assert plan.source == "measured" and timer.calls == 2 * CALLS


def test_the_environment_forces_a_choice(tmp_path, monkeypatch):
    timer = Timer()
    monkeypatch.setenv("CBGEN_GEMM", "decode=fast_big,prefill=plain")
    plan = _choose(tmp_path, timer)
    assert (plan.decode.name, plan.prefill.name, plan.source) == ("fast_big", "plain", "CBGEN_GEMM")
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

    packed = PackedLinears(torch.float32, plan=GemmPlan(cand("decode"), cand("prefill")))
    small = packed(torch.randn(8, 256, generator=gen), layer)
    big = packed(torch.randn(gemm_choice.SPLIT_ROWS + 1, 256, generator=gen), layer)
    assert torch.all(small == 100.0) and torch.all(big == 200.0)


def test_every_real_candidate_computes_f_linear():
    """Whatever this machine offers computes the same projection (the choice is about speed only)."""
    gen = torch.Generator().manual_seed(1)
    layer = nn.Linear(256, 384)
    for dtype in (torch.float32, torch.bfloat16):
        mod = nn.Linear(256, 384).to(dtype)
        mod.load_state_dict(layer.to(dtype).state_dict())
        for cand in gemm_choice.candidates(dtype).values():
            for rows in (gemm_choice.DECODE_ROWS, 300):
                x = torch.randn(rows, 256, generator=gen).to(dtype)
                packed = cand.pack(mod.weight.detach()) if cand.pack is not None else None
                out = cand.apply(x, packed, mod.weight, mod.bias)
                if out is None:
                    continue
                tol = 1e-4 if dtype == torch.float32 else 3e-2
                torch.testing.assert_close(
                    out.float(), nn.functional.linear(x, mod.weight, mod.bias).float(), atol=tol, rtol=tol
                )
