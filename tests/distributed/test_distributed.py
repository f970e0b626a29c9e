"""Tensor and data parallelism on CPU with gloo: each test starts two ranks with ``torchrun`` (in a
subprocess, with a time limit) running tests/distributed/worker.py, then compares what they wrote."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("worker.py")
LIMIT_S = 420


def _run(tmp_path: Path, scenario: str, arch: str = "llama") -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CBGEN_LOG_LEVEL": "WARNING"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(WORKER), scenario, str(tmp_path), arch]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT_S, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((tmp_path / f"{scenario}-{arch}-rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_tensor_parallel_equals_one_process(tmp_path, arch):
    """TP=2 greedy tokens equal generate() on the unsharded model (the oracle's near-tie rule) for the
    torch and C backends, the fused path on and off (it steps aside for sharded weights) and the
    fixed-shape decode path; both ranks return the same outputs, sampled ones included."""
    r0, r1 = _run(tmp_path, "tp", arch)
    assert r0["configs"] == r1["configs"] and r0["sampled"] == r1["sampled"]
    for config in r0["configs"].values():
        assert config["kv_heads"] == 1  # 2 KV heads over 2 ranks: each rank caches its own
        assert not config["fused"] and config["blocks_free"]
        assert config["near_ties"] <= 1


def test_optimizer_step_on_the_sharded_model_is_seen_by_both_ranks(tmp_path):
    r0, r1 = _run(tmp_path, "update")
    assert r0["second"] == r1["second"] and r0["version"] == r1["version"] == 1
    assert r0["second"] != r0["first"] and r0["near_ties"] <= 1


def test_kv_heads_that_do_not_divide_raise(tmp_path):
    for r in _run(tmp_path, "bad_heads"):
        assert r["error"] is not None and "divide" in r["error"]


def test_data_parallel_equals_one_engine_and_replicas_sample_differently(tmp_path):
    r0, r1 = _run(tmp_path, "dp")
    assert r0["dp"] == r1["dp"] == r0["alone"]
    assert r0["unseeded"] != r1["unseeded"], "two replicas drew the same samples without a seed"
    assert r0["seeded"] == r1["seeded"], "a seeded request must not depend on the rank"


def test_only_the_root_takes_requests_and_the_other_rank_follows(tmp_path):
    r0, r1 = _run(tmp_path, "driver")
    assert r0["near_ties"] <= 1 and r0["aborted"] == "abort"
    assert r0["groups_left"] == r1["groups_left"] == 0
    assert r0["steps"] == r1["steps"]  # the follower ran every step the root ran, the stop included


def test_grpo_example_learns_under_torchrun(tmp_path):
    example = Path(__file__).resolve().parents[2] / "examples" / "grpo_tiny.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(example), "--steps", "24", "--no-plot", "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CBGEN_LOG_LEVEL": "WARNING"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT_S, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = next(line for line in proc.stdout.splitlines() if line.startswith("mean reward"))
    first, last = (float(x) for x in re.findall(r"steps ([0-9.]+)", summary))
    assert last > first + 0.3, summary
