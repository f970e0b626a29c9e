"""``cbgen bench`` end to end, in tiny form: every workload, every cheap engine, the report files and
fields, the greedy token check against ``hf-generate``, the null model, the cold-start processes and
their table, and the vLLM subprocess protocol (against a fake ``vllm`` package, since vLLM itself is
not installed here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from cbgen_bench.cli import EXIT_CHECK_FAILED, main
from cbgen_bench.cold_start import MARKS, VLLM_NOTE, ColdRun, ColdStartResult, run_cold_start
from cbgen_bench.engine_result import EngineResult, RunRecord
from cbgen_bench.engine_settings import BenchOptions
from cbgen_bench.history import HISTORY_NAME, recorded_runs
from cbgen_bench.report import summarize
from cbgen_bench.report_markdown import cold_start_markdown, markdown
from cbgen_bench.workloads import Workload

from fake_vllm import FAKE_VLLM

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
COLD_FIELDS = (
    "import_s",
    "load_s",
    "engine_start_s",
    "load_engine_s",
    "generate_s",
    "total_s",
    "exit_s",
    "total_s_min",
    "total_s_max",
    "output_tokens",
    "tokens_match",
    "cbgen_speedup",
    "peak_rss_bytes",
    "settings",
    "runs",
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
        "--cold-start",
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
    # The tiny model has no folder, so there is nothing to cold-start; the report says why.
    for wl in report["workloads"].values():
        assert "only in memory" in wl["cold_start"]["skipped"]
    assert "- cold start skipped for grpo: model 'tiny' exists only in memory" in table


def test_the_run_is_a_line_of_the_history(tiny_report: tuple[dict, Path]) -> None:
    """The harness appends every run it writes to ``history.jsonl`` in its ``--out`` folder."""
    _, out = tiny_report
    (report_file,) = out.glob("bench-*.json")
    assert recorded_runs(out / HISTORY_NAME) == {report_file.stem}


def test_greedy_tokens_match_hf_generate(tiny_report: tuple[dict, Path]) -> None:
    report, _ = tiny_report
    for name in ("overhead", "mixed"):
        wl = report["workloads"][name]
        assert wl["correctness"]["checked"]
        assert wl["engines"]["hf-generate"]["tokens_match"] == "reference"
        for engine in ("cbgen", "cbgen-noshare", "hf-cb"):
            assert wl["engines"][engine]["tokens_match"] == 1.0, (name, engine)


def test_isolated_workers_round_robin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Also the ``--no-check`` path: without hf-generate nothing checks the tokens, and the report
    says so in its header and in the table instead of failing."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    argv = [
        "--tiny",
        "--repeats",
        "2",
        "--workloads",
        "overhead",
        "--engines",
        "cbgen",
        "--no-check",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0
    report = _report(tmp_path)
    row = report["workloads"]["overhead"]["engines"]["cbgen"]
    # One worker process per repeat, merged into one row.
    assert row["isolated"] and row["error"] is None and row["peak_memory_bytes"] > 0
    assert row["repeats"] == 2 and len(row["runs"]) == 2
    assert report["problems"] == [] and report["unchecked"] == [
        "overhead: output NOT checked (hf-generate was not run)"
    ]
    table = next(tmp_path.glob("bench-*.md")).read_text()
    assert "> **NOT CHECKED (--no-check)" in table
    assert "**NOT CHECKED: overhead**" in table and table.rstrip().endswith("| NOT CHECKED | – |")


def test_run_without_a_reference_fails(tmp_path: Path) -> None:
    """A greedy workload without hf-generate is a failed check unless --no-check is given."""
    argv = ["--tiny", "--repeats", "1", "--no-isolate", "--model", "tiny", "--workloads", "overhead"]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--engines", "cbgen", "--out", str(tmp_path)])
    assert exc.value.code == EXIT_CHECK_FAILED
    (problem,) = _report(tmp_path)["problems"]
    assert problem["level"] == "FAIL" and "output NOT checked (hf-generate was not run)" in problem["message"]


def _result(engine: str, wl: Workload, runs: list[list]) -> EngineResult:
    records = [RunRecord(1.0, wl.output_tokens, tokens=tokens) for tokens in runs]
    return EngineResult(engine, wl.name, runs=records, tokens=runs[-1])


def test_every_repeat_is_compared() -> None:
    """A wrong first repeat fails the check although the last one (the only one compared before) is
    right; so does a reference whose own repeats disagree."""
    wl = Workload("overhead", "tiny", [[5, 6, 7], [8, 9]], [3, 3])
    good, bad = [[[1, 2, 3]], [[4, 5, 6]]], [[[1, 2, 3]], [[4, 5, 7]]]
    results = {
        "cbgen": _result("cbgen", wl, [bad, good]),
        "hf-generate": _result("hf-generate", wl, [good, good]),
    }
    report = summarize({"overhead": wl}, {"overhead": results}, {}, {}, {"dtype": "float32"})
    row = report["workloads"]["overhead"]["engines"]["cbgen"]
    assert row["tokens_match"] == 0.5 and row["flags"] == ["FAIL"]
    assert [p["message"] for p in report["problems"]] == [
        "overhead/cbgen (run 1 of 2): only 50.0% of greedy sequences match hf-generate"
    ]
    results = {"cbgen": _result("cbgen", wl, [good]), "hf-generate": _result("hf-generate", wl, [good, bad])}
    report = summarize({"overhead": wl}, {"overhead": results}, {}, {}, {"dtype": "float32"})
    assert "overhead/hf-generate (run 2 of 2)" in report["problems"][0]["message"]


def test_sampled_check_catches_wrong_sampling_and_logprobs() -> None:
    """The plain-forward check of sampled runs (logprob_check.py): tokens drawn at the workload's
    temperature pass, tokens drawn at another temperature fail the z-test, and raw logprobs off by
    more than the tolerance fail the logprob check."""
    from cbgen_bench.logprob_check import MAX_Z, check_run
    from cbgen_bench.workloads import build_workload, make_tiny_model

    from cbgen import LLM, SamplingParams

    model = make_tiny_model()
    wl = build_workload("grpo", tiny=True, model="tiny", vocab_size=512)
    wl.max_tokens = [48] * wl.num_requests  # enough draws for the z-test to tell temperatures apart
    llm = LLM(model, block_size=16)

    def sample(temperature: float) -> tuple[list, list]:
        params = [
            SamplingParams(n=wl.n, max_tokens=m, temperature=temperature, seed=wl.seed + i, ignore_eos=True)
            for i, m in enumerate(wl.max_tokens)
        ]
        outs = llm.generate(wl.prompts, params, use_tqdm=False)
        return [[c.token_ids for c in o.outputs] for o in outs], [
            [c.raw_logprobs for c in o.outputs] for o in outs
        ]

    tokens, raw = sample(wl.temperature)
    good = check_run(model, wl, tokens, raw, "float32")
    assert good["ok"] and good["max_raw_logprob_diff"] < 1e-4 and good["tokens"] == 8 * 48
    cold, _ = sample(0.5)
    too_cold = check_run(model, wl, cold, None, "float32")
    assert too_cold["z"] > MAX_Z and not too_cold["ok"]
    shifted = [[[lp + 1e-3 for lp in seq] for seq in req] for req in raw]
    assert not check_run(model, wl, tokens, shifted, "float32")["ok"]


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


def _fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    fake = tmp_path / "fake"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    monkeypatch.setenv("PYTHONPATH", str(fake))
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("FAKE_VLLM_CALLS", str(calls))
    return calls


@pytest.mark.slow
def test_cold_start_chat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One thread per child process: on a shared box spinning OpenMP threads would make it slow.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    argv = [
        "--tiny",
        "--repeats",
        "1",
        "--no-isolate",
        "--cold-start",
        "--workloads",
        "chat",
        "--engines",
        "cbgen,hf-generate",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0
    report = _report(tmp_path)
    assert report["problems"] == []
    wl = report["workloads"]["chat"]
    cold = wl["cold_start"]
    assert cold["folder"] and cold["correctness"] == {"reference": "hf-generate (cold)", "checked": True}
    assert set(cold["engines"]) == {"cbgen", "hf-generate"}
    for engine, row in cold["engines"].items():
        assert row["error"] is None, (engine, row["error"])
        for key in COLD_FIELDS:
            assert key in row, (engine, key)
        assert row["total_s"] > row["generate_s"] > 0, engine
        assert row["import_s"] > 0 and row["load_s"] > 0 and row["engine_start_s"] >= 0, engine
        parts = row["import_s"] + row["load_s"] + row["engine_start_s"] + row["generate_s"]
        assert parts == pytest.approx(row["total_s"]), engine
        assert row["exit_s"] >= 0 and row["output_tokens"] == wl["output_tokens"]
        (run,) = row["runs"]
        stamps = [run["spawn"], *(run["marks"][k] for k in MARKS), run["exited"]]
        assert None not in stamps and stamps == sorted(stamps), (engine, stamps)
    cb, hf = cold["engines"]["cbgen"], cold["engines"]["hf-generate"]
    assert hf["tokens_match"] == "reference" and cb["tokens_match"] == 1.0
    assert cb["cbgen_speedup"] is None
    assert hf["cbgen_speedup"] == pytest.approx(hf["total_s"] / cb["total_s"])
    assert cb["settings"]["num_blocks"] == wl["engines"]["cbgen"]["settings"]["num_blocks"]
    lines = next(tmp_path.glob("bench-*.md")).read_text().rstrip().splitlines()
    # The cold-start table comes before the throughput table, which stays last.
    cold_at = lines.index("### Cold start: process start → all outputs")
    assert any(line.startswith("| chat | cbgen | ") and "**" in line for line in lines[cold_at:])
    assert lines.index("### Throughput after warm-up (generate only)") > cold_at
    assert lines[-1].startswith("| chat | hf-generate |")


def test_vllm_cold_start_protocol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_vllm(tmp_path, monkeypatch)
    wl = Workload("chat", "smollm2", [[5, 6, 7], [8, 9]], [3, 2])
    opts = BenchOptions(repeats=3, vllm_python=sys.executable)
    result = run_cold_start("vllm", str(tmp_path / "model"), wl, opts)
    assert result.error is None
    # Cold means one generate and no warm-up, whatever --repeats says.
    assert calls.read_text().splitlines() == ["generate"]
    (run,) = result.runs
    phases = run.phases()
    # vLLM loads inside LLM(): no separate load mark, one load + engine start number.
    assert run.marks["loaded"] is None and phases["load_s"] is None and phases["engine_start_s"] is None
    assert phases["load_engine_s"] >= 0 and phases["total_s"] >= phases["generate_s"] >= 0
    assert phases["import_s"] > 0 and run.output_tokens == wl.output_tokens
    assert result.tokens == [[[7, 7, 7]], [[7, 7]]]
    assert result.settings["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert VLLM_NOTE in result.notes


def _cold(
    engine: str, spawn: float, marks: list[float | None], tokens: list, exited: float
) -> ColdStartResult:
    run = ColdRun(spawn, dict(zip(MARKS, marks)), exited, sum(len(t) for r in tokens for t in r))
    return ColdStartResult(engine, "chat", runs=[run], tokens=tokens)


def test_cold_start_summary_and_table() -> None:
    wl = Workload("chat", "smollm2", [[5, 6, 7], [8, 9]], [3, 3], description="two prompts")
    good = [[[1, 2, 3]], [[4, 5, 6]]]
    cold = {
        "cbgen": _cold("cbgen", 100.0, [100.1, 102.0, 102.5, 102.6, 103.6], good, 104.0),
        "hf-generate": _cold("hf-generate", 200.0, [200.1, 201.5, 203.5, 203.5, 205.0], good, 205.5),
        "vllm": _cold("vllm", 300.0, [300.5, 305.0, None, 360.0, 361.0], [[[7, 7, 7]], [[7, 7, 7]]], 370.0),
    }
    tiny = Workload("overhead", "tiny", [[5, 6]], [2], description="tiny")
    report = summarize(
        {"chat": wl, "overhead": tiny},
        {"chat": {}, "overhead": {}},
        {},
        {},
        {"dtype": "float32", "cold_repeats": 1},
        cold_start={
            "chat": {"folder": "/models/smollm2", "engines": cold},
            "overhead": {"skipped": "model 'tiny' exists only in memory"},
        },
    )
    section = report["workloads"]["chat"]["cold_start"]
    cb, hf, vl = (section["engines"][e] for e in ("cbgen", "hf-generate", "vllm"))
    assert cb["import_s"] == pytest.approx(2.0) and cb["load_s"] == pytest.approx(0.5)
    assert cb["engine_start_s"] == pytest.approx(0.1) and cb["generate_s"] == pytest.approx(1.0)
    assert cb["total_s"] == pytest.approx(3.6) and cb["exit_s"] == pytest.approx(0.4)
    assert hf["engine_start_s"] == 0 and hf["cbgen_speedup"] == pytest.approx(5.0 / 3.6)
    assert vl["load_s"] is None and vl["load_engine_s"] == pytest.approx(55.0)
    assert vl["cbgen_speedup"] == pytest.approx(61.0 / 3.6)
    assert (cb["tokens_match"], hf["tokens_match"], vl["tokens_match"]) == (1.0, "reference", 0.0)
    assert vl["flags"] == ["FAIL"] and "flags" not in cb
    assert [p["level"] for p in report["problems"]] == ["FAIL"]
    assert "chat/vllm cold start: only 0.0%" in report["problems"][0]["message"]
    assert report["workloads"]["overhead"]["cold_start"]["skipped"]

    text = markdown(report)
    assert "| chat | cbgen | 2.00 | 0.50 | 0.10 | 1.00 | **3.60** | 100% | – |" in text
    assert "| chat | hf-generate | 1.50 | 2.00 | 0.00 | 1.50 | **5.00** | ref | 1.39 |" in text
    assert "| chat | vllm | 5.00 | – | 55.00 † | 1.00 | **61.00** | **FAIL 0%** | 16.94 |" in text
    assert "- † load and engine start as one number" in text
    assert "- cold start skipped for overhead: model 'tiny' exists only in memory" in text
    assert "CORRECTNESS CHECK FAILED" in text
    # The throughput table stays last.
    lines = text.rstrip().splitlines()
    assert lines.index("### Cold start: process start → all outputs") < lines.index(
        "### Throughput after warm-up (generate only)"
    )
    assert lines[-1].startswith("|---|")


def test_cold_start_table_from_dict() -> None:
    """The table from a hand-written report: repeats show min–max, errors get a row, non-greedy
    workloads are not flagged as unchecked, and a report without cold starts has no table."""
    row = {
        "import_s": 2.0,
        "load_s": 0.5,
        "engine_start_s": 0.25,
        "load_engine_s": 0.75,
        "generate_s": 1.0,
        "total_s": 3.75,
        "total_s_min": 3.5,
        "total_s_max": 4.0,
        "repeats": 3,
        "tokens_match": None,
        "cbgen_speedup": None,
    }
    report = {
        "meta": {"cold_repeats": 3},
        "workloads": {
            "grpo": {
                "greedy": False,
                "cold_start": {
                    "correctness": {"reference": None, "checked": False},
                    "engines": {
                        "cbgen": row,
                        "vllm": {"error": "RuntimeError: cold-start child exited with status 1"},
                    },
                },
            }
        },
    }
    lines = cold_start_markdown(report)
    assert lines[0] == "### Cold start: process start → all outputs"
    assert "(medians of 3)" in lines[2]
    assert "| grpo | cbgen | 2.00 | 0.50 | 0.25 | 1.00 | **3.75 (3.50–4.00)** | – | – |" in lines
    error = next(line for line in lines if line.startswith("| grpo | vllm |"))
    assert "**ERROR** RuntimeError" in error and error.count("|") == lines[4].count("|")
    assert not any("NOT checked" in line for line in lines)
    assert cold_start_markdown({"meta": {}, "workloads": {"grpo": {"greedy": False}}}) == []


def test_workload_flops_count_each_distinct_prompt_prefix_once():
    """The ceiling's FLOPs are the minimal work: a prefix two prompts share (a chat template's
    system prompt) is computed once, as prefix caching does; decode counts every sample."""
    from cbgen_bench.workloads import ModelDims, Workload, workload_flops

    dims = ModelDims(2, 8, 2, 4, 10, [(8, 8)], 100)
    attn = 4 * 2 * 2 * 4
    shared = Workload("w", "tiny", [[1, 2, 3], [1, 2, 4, 5]], [2, 1], n=2)
    flops = workload_flops(shared, dims)
    # distinct prefixes [1], [1 2], [1 2 3], [1 2 4], [1 2 4 5]: contexts 1, 2, 3, 3, 4
    assert flops["prefill"] == 5 * 2 * 100 + attn * (1 + 2 + 3 + 3 + 4)
    # prompt 0: one token fed back at context 4, two LM-head rows; prompt 1: none fed, one row; n = 2
    assert flops["decode"] == 2 * ((2 * 100 + attn * 4 + 2 * 2 * 80) + 2 * 80)
    alone = workload_flops(Workload("w", "tiny", [[1, 2, 3]], [1]), dims)
    assert alone["prefill"] == 3 * 2 * 100 + attn * (1 + 2 + 3)
