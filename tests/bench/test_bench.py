"""``cbgen bench`` end to end, in tiny form: every workload, every cheap engine, the report files and
fields, the greedy token check against ``hf-generate``, the null model, and the vLLM subprocess
protocol (against a fake ``vllm`` package, since vLLM itself is not installed here)."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from cbgen.bench.cli import EXIT_CHECK_FAILED, main

ENGINE_FIELDS = (
    "wall_s",
    "output_tok_s",
    "total_tok_s",
    "peak_memory_bytes",
    "steps",
    "mean_batch_size",
    "prefix_cache_hit_rate",
    "preemptions",
    "ttft_p50_s",
    "ttft_p99_s",
    "tokens_match",
    "pct_of_ceiling",
)
WORKLOAD_FIELDS = (
    "engines",
    "ratios",
    "flops",
    "matmul_ceiling",
    "correctness",
    "prompt_tokens",
    "output_tokens",
    "num_requests",
    "num_sequences",
    "greedy",
)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny workloads gain nothing from a second thread, and on a busy machine torch's spinning
    OpenMP threads make every small op stall; one thread keeps the test fast and steady."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _report(out: Path) -> dict:
    files = sorted(out.glob("bench-*.json"))
    assert len(files) == 1, files
    assert files[0].with_suffix(".md").is_file()
    return json.loads(files[0].read_text())


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("bench-tiny")
    argv = [
        "--tiny",
        "--repeats",
        "1",
        "--no-isolate",
        "--model",
        "tiny",
        "--profile",
        "--null-model",
        "--workloads",
        "overhead,grpo,mixed",
        "--engines",
        "cbgen,cbgen-noshare,hf-generate,hf-cb",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    return _report(out), out


def test_report_has_every_field(tiny_report: tuple[dict, Path]) -> None:
    report, out = tiny_report
    assert report["problems"] == []
    assert set(report["workloads"]) == {"overhead", "grpo", "mixed"}
    for name, wl in report["workloads"].items():
        for key in WORKLOAD_FIELDS:
            assert key in wl, (name, key)
        assert set(wl["engines"]) == {"cbgen", "cbgen-noshare", "hf-generate", "hf-cb"}
        for engine, row in wl["engines"].items():
            assert row["error"] is None, (name, engine, row["error"])
            for key in ENGINE_FIELDS:
                assert key in row, (name, engine, key)
            assert row["output_tok_s"]["min"] <= row["output_tok_s"]["median"] <= row["output_tok_s"]["max"]
            assert row["runs"][0]["output_tokens"] == wl["output_tokens"]
        cb = wl["engines"]["cbgen"]
        assert cb["steps"] > 0 and cb["mean_batch_size"] > 0 and cb["ttft_p50_s"] > 0
        assert cb["pct_of_ceiling"] > 0
        assert set(wl["ratios"]) == {"cbgen/hf-generate", "cbgen/hf-cb", "cbgen/cbgen-noshare"}
        assert wl["matmul_ceiling"]["float32"]["decode_gflops"] > 0
        assert wl["matmul_ceiling"]["bfloat16"]["prefill_gflops"] > 0
    grpo = report["workloads"]["grpo"]
    assert grpo["n"] > 1 and not grpo["greedy"]
    # One prefill per group shows up as prefix-cache-free sharing: noshare computes n times the prompt.
    assert (
        grpo["engines"]["cbgen-noshare"]["runs"][0]["stats"]["prompt_tokens_computed"]
        == grpo["n"] * grpo["engines"]["cbgen"]["runs"][0]["stats"]["prompt_tokens_computed"]
    )
    assert {(r["running"], r["mode"]) for r in report["null_model"]} == {
        (n, m) for n in (1, 16, 64, 256) for m in ("greedy", "sampled")
    }
    assert all(r["overhead_ms"] > 0 and r["sample_ms"] > 0 for r in report["null_model"])
    assert set(report["profile"]) == {"overhead", "grpo", "mixed"}
    assert report["profile"]["overhead"]["all"]["phases"]["forward"]["count"] > 0
    assert list(out.glob("bench-*.png")) and list(out.glob("profile-*.json"))
    table = next(out.glob("bench-*.md")).read_text()
    assert table.rstrip().splitlines()[-1].startswith("| mixed | hf-cb |")


def test_greedy_tokens_match_hf_generate(tiny_report: tuple[dict, Path]) -> None:
    report, _ = tiny_report
    for name in ("overhead", "mixed"):
        wl = report["workloads"][name]
        assert wl["correctness"]["checked"]
        assert wl["engines"]["hf-generate"]["tokens_match"] == "reference"
        for engine in ("cbgen", "cbgen-noshare", "hf-cb"):
            assert wl["engines"][engine]["tokens_match"] == 1.0, (name, engine)


def test_isolated_workers_round_robin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    argv = [
        "--tiny",
        "--repeats",
        "2",
        "--workloads",
        "overhead",
        "--engines",
        "cbgen",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0
    row = _report(tmp_path)["workloads"]["overhead"]["engines"]["cbgen"]
    # One worker process per repeat, merged into one row.
    assert row["isolated"] and row["error"] is None and row["peak_memory_bytes"] > 0
    assert row["repeats"] == 2 and len(row["runs"]) == 2


FAKE_VLLM = textwrap.dedent(
    """
    __version__ = "0.0-fake"

    class SamplingParams:
        def __init__(self, n=1, max_tokens=16, **kwargs):
            self.n, self.max_tokens = n, max_tokens

    class _Completion:
        def __init__(self, index, token_ids):
            self.index, self.token_ids = index, token_ids

    class _Output:
        metrics = None

        def __init__(self, outputs):
            self.outputs = outputs

    class LLM:
        def __init__(self, model, **kwargs):
            self.model = model

        def generate(self, prompts, params, use_tqdm=True):
            # Deliberately wrong tokens: the report must refuse to trust these numbers.
            return [_Output([_Completion(j, [7] * p.max_tokens) for j in range(p.n)]) for p in params]
    """
)


@pytest.mark.slow
def test_smollm2_chat_smoke_and_vllm_guard(
    tmp_path: Path, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "fake"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    monkeypatch.setenv("PYTHONPATH", str(fake))
    out = tmp_path / "out"
    argv = [
        "--tiny",
        "--repeats",
        "1",
        "--no-isolate",
        "--workloads",
        "chat",
        "--engines",
        "cbgen,hf-generate,vllm",
        "--vllm-python",
        sys.executable,
        "--out",
        str(out),
    ]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == EXIT_CHECK_FAILED
    report = _report(out)
    chat = report["workloads"]["chat"]
    assert chat["model"] == "smollm2" and chat["num_requests"] == 2
    assert chat["engines"]["cbgen"]["tokens_match"] == 1.0
    assert chat["engines"]["vllm"]["tokens_match"] == 0.0
    assert chat["engines"]["vllm"]["settings"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert [p["level"] for p in report["problems"]] == ["FAIL"]
    assert "CORRECTNESS CHECK FAILED" in next(out.glob("bench-*.md")).read_text()
