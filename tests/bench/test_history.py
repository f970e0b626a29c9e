"""``cbgen_bench.history``: what a history line holds, which runs keep their files, that pruning keeps
a results folder within its file limit, deletes exactly the older runs' files and is safe to repeat,
and that ``cbgen bench`` itself appends each run it writes (no benchmark is run here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cbgen_bench.cli import _record, build_parser
from cbgen_bench.history import (
    HISTORY_NAME,
    MAX_RESULT_FILES,
    main,
    plan_prune,
    prune,
    recorded_runs,
    summarize_run,
)


def _report(
    cpu: str, dtype: str, workloads: tuple[str, ...], wall: float, long: bool = False
) -> dict[str, Any]:
    engine = {
        "wall_s": {"median": wall, "min": wall - 1, "max": wall + 1},
        "output_tok_s": {"median": 8192 / wall, "min": 1.0, "max": 2.0},
        "runs": [{"wall_s": wall - 1, "output_tokens": 8192}, {"wall_s": wall}, {"wall_s": wall + 1}],
        "ttft_p50_s": 1.5,
        "pct_of_ceiling": 80.0,
        "tokens_match": 1.0,
        "peak_memory_bytes": 123,
        "error": None,
    }
    report: dict[str, Any] = {
        "meta": {
            "started": "2026-12-02 05:59:31",
            "cpu": cpu,
            "dtype": dtype,
            "repeats": 3,
            "tiny": False,
            "neighbour": None,
        },
        "workloads": {
            name: {
                "model": "smollm2",
                "matmul_ceiling": {"ceiling_s": 36.5},
                "ratios": {"cbgen/vllm": 8.25},
                "engines": {"cbgen": dict(engine), "vllm": {**engine, "pct_of_ceiling": 10.0}},
                "cold_start": {"engines": {"cbgen": {"total_s": 51.3}}},
                "profile": {"steps": list(range(1000))},  # per-step data: never copied into the history
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


def _write_run(results: Path, stamp: str, wall: float = 45.0, profile: bool = False) -> None:
    """The files ``cbgen bench`` writes for one run (3, or 4 with ``--profile``)."""
    report = _report("AMD EPYC", "float32", ("chat",), wall)
    (results / f"bench-{stamp}.json").write_text(json.dumps(report))
    (results / f"bench-{stamp}.md").write_text("table")
    (results / f"bench-{stamp}.png").write_bytes(b"png")
    if profile:
        (results / f"profile-{stamp}.json").write_text("{}")


def _files(results: Path) -> list[str]:
    return sorted(p.name for p in results.iterdir())


def _history_runs(results: Path) -> list[str]:
    lines = (results / HISTORY_NAME).read_text().splitlines()
    return [json.loads(line)["run"] for line in lines]


def test_summarize_run_keeps_the_key_numbers() -> None:
    report = _report("AMD EPYC", "bfloat16", ("chat",), 43.19, long=True)
    report["meta"]["neighbour"] = "nice19"
    record = summarize_run("20261202-055931", report)
    assert record["run"] == "bench-20261202-055931"
    assert (record["cpu"], record["dtype"], record["started"], record["neighbour"]) == (
        "AMD EPYC",
        "bfloat16",
        "2026-12-02 05:59:31",
        "nice19",
    )
    assert "tiny" not in record  # only what differs from an ordinary run
    chat = record["workloads"]["chat"]
    assert chat["ceiling_s"] == 36.5
    assert chat["ratios"] == {"cbgen/vllm": 8.25}
    cbgen = chat["engines"]["cbgen"]
    assert cbgen["wall_s"] == 43.19
    assert cbgen["rounds_wall_s"] == [42.19, 43.19, 44.19]
    assert cbgen["ttft_p50_s"] == 1.5
    assert cbgen["output_tok_s"] == float(f"{8192 / 43.19:.6g}")  # six significant digits
    assert chat["engines"]["vllm"]["pct_of_ceiling"] == 10.0
    assert "error" not in cbgen
    assert chat["cold_start_total_s"] == {"cbgen": 51.3}
    assert "profile" not in chat
    case = record["long"]["cases"]["decode@2k"]
    assert record["long"]["bandwidth_gbs"] == 22.6
    assert case["bound_decode_ms"] == 28.0
    assert case["engines"]["cbgen"] == {"decode_ms_per_token": 38.0, "ttft_s": 9.5}
    assert record["problems"] == ["chat/vllm: only 7.8% match"]
    assert len(json.dumps(record)) < 2000  # one short history line


def test_plan_keeps_the_newest_runs_that_fit() -> None:
    runs = {"20261201-100000": 3, "20261202-100000": 4, "20261203-100000": 3, "20261130-100000": 3}
    # 2 other files + 3 + 4 = 9; the next run (3) would make 12.
    assert plan_prune(runs, other_files=2, max_files=11) == ["20261202-100000", "20261203-100000"]
    assert plan_prune(runs, other_files=2, max_files=12) == [
        "20261201-100000",
        "20261202-100000",
        "20261203-100000",
    ]
    # The newest run keeps its files whatever the limit; 0 means no limit.
    assert plan_prune(runs, other_files=5, max_files=1) == ["20261203-100000"]
    assert plan_prune(runs, other_files=2, max_files=0) == sorted(runs)


def test_prune_records_every_run_once_and_keeps_the_newest(tmp_path: Path) -> None:
    _write_run(tmp_path, "20261201-100000", wall=50.0, profile=True)
    _write_run(tmp_path, "20261202-100000", wall=45.0, profile=True)
    _write_run(tmp_path, "20261203-100000", wall=44.0)
    (tmp_path / "README.txt").write_text("not a run")  # counts towards the limit, never deleted

    plan = prune(tmp_path, max_files=9, dry_run=True)
    assert plan.appended == ["20261201-100000", "20261202-100000", "20261203-100000"]
    assert plan.moved == ["20261201-100000"]
    assert not (tmp_path / HISTORY_NAME).exists() and len(_files(tmp_path)) == 12

    assert main([str(tmp_path), "--max-files", "9"]) == 0
    assert _files(tmp_path) == [
        "README.txt",
        "bench-20261202-100000.json",
        "bench-20261202-100000.md",
        "bench-20261202-100000.png",
        "bench-20261203-100000.json",
        "bench-20261203-100000.md",
        "bench-20261203-100000.png",
        HISTORY_NAME,
        "profile-20261202-100000.json",
    ]
    assert _history_runs(tmp_path) == [
        "bench-20261201-100000",
        "bench-20261202-100000",
        "bench-20261203-100000",
    ]
    first = json.loads((tmp_path / HISTORY_NAME).read_text().splitlines()[0])
    assert first["workloads"]["chat"]["engines"]["cbgen"]["wall_s"] == 50.0

    # Again: nothing is written twice, nothing more is deleted.
    plan = prune(tmp_path, max_files=9)
    assert (plan.appended, plan.moved) == ([], [])
    assert len(_history_runs(tmp_path)) == 3 and len(_files(tmp_path)) == 9

    # A lower limit deletes the older run's files; its line was already written.
    plan = prune(tmp_path, max_files=5)
    assert (plan.appended, plan.kept, plan.moved) == ([], ["20261203-100000"], ["20261202-100000"])
    assert len(_files(tmp_path)) == 5 and len(_history_runs(tmp_path)) == 3


def test_a_run_whose_report_cannot_be_read_keeps_its_files(tmp_path: Path) -> None:
    (tmp_path / "bench-20261201-100000.json").write_text('{"meta": ')  # cut short
    (tmp_path / "bench-20261201-100000.md").write_text("table")
    _write_run(tmp_path, "20261202-100000")
    _write_run(tmp_path, "20261203-100000")
    plan = prune(tmp_path, max_files=4)
    assert plan.appended == ["20261202-100000", "20261203-100000"]
    assert plan.moved == ["20261202-100000"]
    assert (tmp_path / "bench-20261201-100000.md").exists()
    assert recorded_runs(tmp_path / HISTORY_NAME) == {"bench-20261202-100000", "bench-20261203-100000"}


def test_the_harness_appends_each_run_and_holds_the_limit(tmp_path: Path) -> None:
    """``cbgen bench`` runs :func:`_record` on ``--out`` after writing a report: a folder already at
    the limit gains one history line per run and stays at or under :data:`MAX_RESULT_FILES`."""
    assert build_parser().parse_args([]).keep_files == MAX_RESULT_FILES
    assert build_parser().parse_args(["--keep-files", "0"]).keep_files == 0
    for day in range(1, 21):
        _write_run(tmp_path, f"202612{day:02d}-100000", profile=day % 2 == 0)
        _record(tmp_path, MAX_RESULT_FILES)
        assert len(_files(tmp_path)) <= MAX_RESULT_FILES
        assert len(_history_runs(tmp_path)) == day
        assert _history_runs(tmp_path)[-1] == f"bench-202612{day:02d}-100000"
        assert (tmp_path / f"bench-202612{day:02d}-100000.json").exists()
    # The newest runs are the ones left as files, and they fill the folder as far as they can.
    stamps = sorted({name.split("-", 1)[1].rsplit(".", 1)[0] for name in _files(tmp_path) if "-" in name})
    assert stamps == [f"202612{day:02d}-100000" for day in range(17, 21)]
    assert len(_files(tmp_path)) == 1 + 4 * 3 + 2  # history + 4 runs, 2 with a profile file
