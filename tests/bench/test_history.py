"""``cbgen_bench.history``: which runs keep their files, what a history line holds, and that pruning
deletes exactly the older runs' files and is safe to repeat."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cbgen_bench.history import HISTORY_NAME, RunKey, main, plan_prune, prune, run_key, summarize_run


def _report(
    cpu: str, dtype: str, workloads: tuple[str, ...], wall: float, long: bool = False
) -> dict[str, Any]:
    engine = {
        "wall_s": {"median": wall, "min": wall - 1, "max": wall + 1},
        "output_tok_s": {"median": 8192 / wall, "min": 1.0, "max": 2.0},
        "pct_of_ceiling": 80.0,
        "tokens_match": 1.0,
        "peak_memory_bytes": 123,
        "error": None,
    }
    report: dict[str, Any] = {
        "meta": {"started": "2026-12-02 05:59:31", "cpu": cpu, "dtype": dtype, "repeats": 3, "tiny": False},
        "workloads": {
            name: {
                "model": "smollm2",
                "matmul_ceiling": {"ceiling_s": 36.5},
                "ratios": {"cbgen/vllm": 8.25},
                "engines": {"cbgen": dict(engine), "vllm": {**engine, "pct_of_ceiling": 10.0}},
                "cold_start": {"engines": {"cbgen": {"total_s": 51.3}}},
            }
            for name in workloads
        },
        "problems": [{"level": "WARN", "message": "chat/vllm: only 7.8% match"}],
    }
    if long:
        report["long"] = {
            "machine": {"bandwidth_gbs": 22.6},
            "cases": [
                {
                    "name": "decode@2k",
                    "bound": {"decode_ms": 28.0, "prefill_s": 7.6},
                    "engines": {"cbgen": {"decode_ms_per_token": 38.0, "ttft_s": 9.5}},
                }
            ],
        }
    return report


def _write_run(results: Path, stamp: str, report: dict[str, Any], profile: bool = False) -> None:
    (results / f"bench-{stamp}.json").write_text(json.dumps(report))
    (results / f"bench-{stamp}.md").write_text("table")
    (results / f"bench-{stamp}.png").write_bytes(b"png")
    if profile:
        (results / f"profile-{stamp}.json").write_text("{}")


def test_run_key_separates_workloads_cpu_and_dtype() -> None:
    chat = run_key(_report("AMD EPYC", "float32", ("chat",), 40.0))
    assert chat == RunKey(workloads="chat", cpu="AMD EPYC", dtype="float32")
    assert run_key(_report("AMD EPYC", "bfloat16", ("chat",), 40.0)) != chat
    assert run_key(_report("Intel Xeon", "float32", ("chat",), 40.0)) != chat
    assert run_key(_report("AMD EPYC", "float32", ("chat", "overhead"), 40.0)).workloads == "chat,overhead"
    assert run_key(_report("AMD EPYC", "float32", (), 40.0, long=True)).workloads == "long"


def test_plan_keeps_the_newest_run_of_each_key() -> None:
    reports = {
        "20261201-100000": _report("AMD EPYC", "float32", ("chat",), 50.0),
        "20261202-100000": _report("AMD EPYC", "float32", ("chat",), 45.0),
        "20261201-120000": _report("AMD EPYC", "bfloat16", ("chat",), 46.0),
        "20261130-100000": _report("Intel Xeon", "float32", ("chat",), 18.0),
    }
    plan = plan_prune(reports)
    assert plan.kept == ["20261130-100000", "20261201-120000", "20261202-100000"]
    assert plan.moved == ["20261201-100000"]


def test_summarize_run_keeps_the_key_numbers() -> None:
    record = summarize_run("20261202-055931", _report("AMD EPYC", "bfloat16", ("chat",), 43.19, long=True))
    assert record["run"] == "bench-20261202-055931"
    assert (record["cpu"], record["dtype"], record["started"]) == (
        "AMD EPYC",
        "bfloat16",
        "2026-12-02 05:59:31",
    )
    chat = record["workloads"]["chat"]
    assert chat["ceiling_s"] == 36.5
    assert chat["ratios"] == {"cbgen/vllm": 8.25}
    assert chat["engines"]["cbgen"]["wall_s"] == 43.19
    assert chat["engines"]["cbgen"]["output_tok_s"] == 8192 / 43.19
    assert chat["engines"]["vllm"]["pct_of_ceiling"] == 10.0
    assert "error" not in chat["engines"]["cbgen"]
    assert chat["cold_start_total_s"] == {"cbgen": 51.3}
    case = record["long"]["cases"]["decode@2k"]
    assert record["long"]["bandwidth_gbs"] == 22.6
    assert case["bound_decode_ms"] == 28.0
    assert case["engines"]["cbgen"] == {"decode_ms_per_token": 38.0, "ttft_s": 9.5}
    assert record["problems"] == ["chat/vllm: only 7.8% match"]
    json.dumps(record)  # one history line


def test_prune_moves_older_runs_into_the_history_once(tmp_path: Path) -> None:
    _write_run(tmp_path, "20261201-100000", _report("AMD EPYC", "float32", ("chat",), 50.0), profile=True)
    _write_run(tmp_path, "20261202-100000", _report("AMD EPYC", "float32", ("chat",), 45.0), profile=True)
    (tmp_path / ".gitkeep").write_text("")

    plan = prune(tmp_path, dry_run=True)
    assert plan.moved == ["20261201-100000"]
    assert (tmp_path / "bench-20261201-100000.json").exists()
    assert not (tmp_path / HISTORY_NAME).exists()

    assert main([str(tmp_path)]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        ".gitkeep",
        "bench-20261202-100000.json",
        "bench-20261202-100000.md",
        "bench-20261202-100000.png",
        HISTORY_NAME,
        "profile-20261202-100000.json",
    ]
    lines = (tmp_path / HISTORY_NAME).read_text().splitlines()
    assert [json.loads(line)["run"] for line in lines] == ["bench-20261201-100000"]
    assert json.loads(lines[0])["workloads"]["chat"]["engines"]["cbgen"]["wall_s"] == 50.0

    # A newer run of the same key pushes the previous newest into the history; nothing is written twice.
    _write_run(tmp_path, "20261203-100000", _report("AMD EPYC", "float32", ("chat",), 44.0))
    prune(tmp_path)
    prune(tmp_path)
    runs = [json.loads(line)["run"] for line in (tmp_path / HISTORY_NAME).read_text().splitlines()]
    assert runs == ["bench-20261201-100000", "bench-20261202-100000"]
    assert not (tmp_path / "profile-20261202-100000.json").exists()
    assert (tmp_path / "bench-20261203-100000.json").exists()
