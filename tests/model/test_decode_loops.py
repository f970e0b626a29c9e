"""The measured choice of decode-attention loops (``cbgen.model.cpu_fast.decode_loops``): the faster
set wins and is cached per machine and geometry, a forced choice is checked against the build, and
the engine runs what its plan names, exactly."""

from __future__ import annotations

import pytest
import torch

from cbgen import LLM, SamplingParams
from cbgen.model.cpu_fast import decode_loops, gemm_choice
from oracle import compare, hf_greedy
from tiny_models import make_prompts, make_wide_model

BOTH = ["avx512", "avx2", "portable"]


class FakeTimer:
    """avx2 takes ``ratio`` of avx512's time at every case; counts its calls."""

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio
        self.calls = 0

    def __call__(self, loops: str, rows: int, ctx: int) -> float:
        self.calls += 1
        base = rows * ctx * 1e-6
        return base * (self.ratio if loops == "avx2" else 1.0)


@pytest.fixture(autouse=True)
def _measured(monkeypatch):
    monkeypatch.delenv("CBGEN_DECODE_LOOPS", raising=False)


@pytest.mark.parametrize(("ratio", "winner"), [(0.75, "avx2"), (1.3, "avx512")])
def test_the_faster_loops_win_and_are_cached(tmp_path, ratio, winner) -> None:
    path = tmp_path / "loops.json"
    timer = FakeTimer(ratio)
    loops, why = decode_loops.choose(torch.float32, 9, 3, 64, 16, timer, path, BOTH)
    assert loops == winner and "measured on this machine" in why
    assert timer.calls == 2 * len(decode_loops.CASES) * decode_loops.TIMING_ROUNDS
    again = FakeTimer(1 / ratio)  # a second engine reads the answer instead of timing
    assert decode_loops.choose(torch.float32, 9, 3, 64, 16, again, path, BOTH)[0] == winner
    assert again.calls == 0
    # Another geometry or dtype is measured on its own.
    other = FakeTimer(1 / ratio)
    assert decode_loops.choose(torch.bfloat16, 9, 3, 64, 16, other, path, BOTH)[0] != winner
    assert other.calls > 0


def test_a_cache_from_another_cpu_is_not_read(tmp_path, monkeypatch) -> None:
    path = tmp_path / "loops.json"
    decode_loops.choose(torch.float32, 9, 3, 64, 16, FakeTimer(0.5), path, BOTH)
    monkeypatch.setattr(gemm_choice, "cpu_key", lambda: "x86_64|model name: Another CPU|flags: avx2")
    timer = FakeTimer(2.0)
    assert decode_loops.choose(torch.float32, 9, 3, 64, 16, timer, path, BOTH)[0] == "avx512"
    assert timer.calls > 0


def test_nothing_to_choose(tmp_path) -> None:
    timer = FakeTimer(0.5)
    path = tmp_path / "loops.json"
    assert decode_loops.choose(torch.float32, 9, 3, 64, 16, timer, path, ["avx2", "portable"])[0] == "widest"
    # Head sizes the AVX-512 loops do not take run the AVX2 ones whatever was measured.
    assert decode_loops.choose(torch.float32, 6, 3, 24, 16, timer, path, BOTH)[0] == "widest"
    assert timer.calls == 0 and not path.exists()


def test_a_forced_choice_must_exist(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CBGEN_DECODE_LOOPS", "avx2")
    assert decode_loops.choose(torch.float32, 9, 3, 64, 16, FakeTimer(2.0), tmp_path / "x", BOTH) == (
        "avx2",
        "CBGEN_DECODE_LOOPS",
    )
    monkeypatch.setenv("CBGEN_DECODE_LOOPS", "avx512")
    with pytest.raises(ValueError, match="this build's loops"):
        decode_loops.choose(torch.float32, 9, 3, 64, 16, FakeTimer(2.0), tmp_path / "x", ["avx2", "portable"])


def test_the_real_timer_times_every_built_loop() -> None:
    timer = decode_loops.time_loops(torch.float32, 4, 2, 32, 16)
    for loops in decode_loops.built_loops():
        assert timer(loops, 2, 40) > 0


def test_the_engine_runs_the_measured_loops_exactly() -> None:
    """With nothing forced, the plan measures (into this run's own kernel directory), names a set of
    loops this build has, and greedy output stays transformers'."""
    model = make_wide_model("llama", dtype=torch.float32)
    llm = LLM(model, block_size=8, max_num_batched_tokens=64)
    plan = llm.engine.runner.plan
    assert plan.attention == "cpu"
    assert plan.decode_loops in [*decode_loops.built_loops(), "widest"]
    assert "decode loops" in plan.describe()
    assert llm.engine.runner.attn_backend.decode_impl == decode_loops.IMPLS[plan.decode_loops]
    prompts = make_prompts(5, (4, 40), vocab=model.config.vocab_size, seed=2)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    compare(model, prompts, [o.outputs[0].token_ids for o in outs], [hf_greedy(model, p, 8) for p in prompts])


def test_each_loop_set_competes_in_both_prefetch_forms(tmp_path) -> None:
    """Where the build has them, the ``-l2`` forms (prefetches into L2) are timed beside the
    non-temporal ones and can win; every name the build reports has an ``impl``."""
    all_forms = ["avx512", "avx512-l2", "avx2", "avx2-l2", "portable"]
    seen = []

    def timer(loops: str, rows: int, ctx: int) -> float:
        seen.append(loops)
        return rows * ctx * 1e-6 * (0.6 if loops == "avx2-l2" else 1.0)

    loops, _ = decode_loops.choose(torch.float32, 9, 3, 64, 16, timer, tmp_path / "l.json", all_forms)
    assert loops == "avx2-l2" and set(seen) == set(decode_loops.CONTENDERS)
    # An AVX2-only build still chooses between its two prefetch forms.
    seen.clear()
    assert decode_loops.choose(torch.float32, 9, 3, 64, 16, timer, tmp_path / "m.json", ["avx2", "avx2-l2"])[
        0
    ] == ("avx2-l2")
    assert set(seen) == {"avx2", "avx2-l2"}
    for name in decode_loops.built_loops():
        assert name in decode_loops.IMPLS
