"""The ``long`` workload (``cbgen_bench.long_context``, ``cbgen_bench.long_run``): its cases, bounds,
report, the vLLM step-loop protocol (against a fake ``vllm`` package) and one tiny end-to-end run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from cbgen_bench.cli import main
from cbgen_bench.long_context import (
    CaseTiming,
    LongCase,
    bounds,
    case_prompts,
    long_cases,
    long_markdown,
    run_vllm_long,
    summarize_long,
)
from cbgen_bench.workloads import ModelDims

from fake_vllm import FAKE_VLLM


def test_cases_cover_2k_8k_and_the_maximum_once() -> None:
    cases = long_cases(8192, tiny=False)
    assert [c.name for c in cases] == ["decode@2k", "decode@8k (max)"]
    assert [(c.context, c.prompt_len, c.new_tokens) for c in cases] == [(2048, 2015, 33), (8192, 8159, 33)]
    assert [c.name for c in long_cases(32768, tiny=False)] == ["decode@2k", "decode@8k", "decode@32k (max)"]
    assert [c.name for c in long_cases(4096, tiny=False)] == ["decode@2k", "decode@4k (max)"]
    tiny = long_cases(8192, tiny=True)
    assert [(c.context, c.decode_steps) for c in tiny] == [(64, 4), (128, 4)]
    for case in [*cases, *tiny]:  # the last token generated sits at context - 1: it fits the model
        assert case.prompt_len + case.new_tokens == case.context


def test_prompts_differ_per_repeat_and_are_reproducible() -> None:
    cases = long_cases(8192, tiny=True)
    a, b = case_prompts(cases, 500, 3), case_prompts(cases, 500, 3)
    assert a == b
    assert [len(p) for p in a[1]] == [cases[1].prompt_len] * 3
    assert len({tuple(p) for p in a[0]}) == 3  # no repeat can hit another's prefix cache
    assert all(3 <= t < 500 for p in a[0] for t in p)


DIMS = ModelDims(
    num_layers=2,
    hidden_size=8,
    num_heads=4,
    head_dim=2,
    vocab_size=10,
    layer_linears=[(8, 8)],
    matmul_params=1000,
)


def test_bounds_by_hand() -> None:
    case = LongCase("decode@16", 16, 11, 5)  # 4 timed steps at contexts 12..15, mean 14
    b = bounds(case, DIMS, kv_heads=1, elem_bytes=4, bandwidth_gbs=1.0, prefill_gflops=2.0)
    assert b["weight_bytes"] == (1000 + 80) * 4
    assert b["kv_bytes"] == 2 * 2 * 1 * 2 * 14 * 4
    assert b["decode_ms"] == pytest.approx((4320 + 448) / 1e9 * 1e3)
    attn = 4 * 2 * 4 * 2 * 11 * 12 / 2
    assert b["prefill_flops"] == 2 * 1000 * 11 + attn + 2 * 80
    assert b["prefill_s"] == pytest.approx(b["prefill_flops"] / 2e9)


def test_summary_medians_ratios_and_token_check() -> None:
    cases = [LongCase("decode@16", 16, 11, 5)]
    timings = {
        "cbgen": [CaseTiming([1.0, 3.0, 2.0], [10.0, 30.0, 20.0], [[1, 2], [3, 4], [5, 6]])],
        "hf-generate": [CaseTiming([4.0, 4.0, 4.0], [40.0, 40.0, 40.0], [[1, 2], [3, 4], [5, 7]])],
        "vllm": "RuntimeError: vllm_runner exited with status 1",
    }
    bound = {"decode_ms": 5.0, "prefill_s": 0.5}
    section = summarize_long(cases, timings, [bound], {"bandwidth_gbs": 20.0})
    cb, hf, vl = (section["cases"][0]["engines"][e] for e in ("cbgen", "hf-generate", "vllm"))
    assert (cb["decode_ms_per_token"], cb["ttft_s"]) == (20.0, 2.0)
    assert cb["decode_x_bound"] == 4.0 and cb["prefill_x_bound"] == 4.0
    assert hf["decode_vs_cbgen"] == 2.0 and hf["ttft_vs_cbgen"] == 2.0
    assert cb["tokens_equal_hf"] == pytest.approx(2 / 3)
    assert vl == {"error": "RuntimeError: vllm_runner exited with status 1"}
    machine = {"bandwidth_gbs": 20.0, "read_gbs": 20.0, "copy_gbs": 18.0, "prefill_gflops": 100.0}
    text = "\n".join(long_markdown({**section, "machine": {**machine, "prefill_gemm": "plain"}}))
    assert "| decode@16 (11-token prompt) | cbgen | 20.0 | 4.00 | 1.00 | 2.00 | 4.00 | 1.00 | 67% |" in text
    assert (
        "| decode@16 (11-token prompt) | hf-generate | 40.0 | 8.00 | 2.00 | 4.00 | 8.00 | 2.00 | ref |"
        in text
    )
    assert "| vllm | ERROR RuntimeError" in text
    assert long_markdown(None) == []


def test_vllm_long_protocol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every case and repeat in one vLLM process, each request alone through the step loop."""
    fake = tmp_path / "fake"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    monkeypatch.setenv("PYTHONPATH", str(fake))
    cases = long_cases(8192, tiny=True)
    prompts = case_prompts(cases, 500, 2)
    got = run_vllm_long(sys.executable, str(tmp_path), "float32", cases, prompts)
    assert len(got) == 2
    for case, timing in zip(cases, got):
        assert len(timing.ttft_s) == len(timing.decode_ms) == 2
        assert timing.tokens == [[case.prompt_len % 97] * case.new_tokens] * 2
        assert all(t >= 0 for t in timing.ttft_s) and all(d >= 0 for d in timing.decode_ms)


@pytest.mark.slow
def test_long_workload_end_to_end(tmp_path: Path) -> None:
    """A tiny ``cbgen bench --workloads long`` run: both engines timed, tokens equal, bounds set."""
    argv = ["--tiny", "--repeats", "2", "--workloads", "long", "--model", "tiny", "--out", str(tmp_path)]
    assert main(argv) == 0
    report = json.loads(next(tmp_path.glob("bench-*.json")).read_text())
    section = report["long"]
    assert section["machine"]["bandwidth_gbs"] > 0 and section["machine"]["prefill_gflops"] > 0
    assert [c["name"] for c in section["cases"]] == ["decode@64", "decode@128"]
    for case in section["cases"]:
        assert case["bound"]["decode_ms"] > 0 and case["bound"]["prefill_s"] > 0
        cb = case["engines"]["cbgen"]
        assert len(cb["decode_ms_runs"]) == 2 and cb["decode_ms_per_token"] > 0
        assert cb["tokens_equal_hf"] == 1.0
        assert case["engines"]["hf-generate"]["decode_ms_per_token"] > 0
    text = next(tmp_path.glob("bench-*.md")).read_text()
    assert "### Long contexts (one sequence at a time)" in text
