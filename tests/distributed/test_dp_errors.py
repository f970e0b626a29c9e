"""generate_dp under torchrun (2 CPU ranks, gloo) when a rank fails: a bad input on one rank, a
params list of the wrong length on one or every rank, an error in the middle of one rank's
generation.  Every rank must raise the same exception, naming the failing rank, and a rank that
catches it and calls again must find the others in step.  The worker arms a 30 s watchdog around each
call (``worker.CALL_LIMIT_S``), far below the process group's 30-minute timeout: a rank left waiting
in a collective ends its process and this test fails, instead of hanging."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("worker.py")
LIMIT_S = 420  # the whole torchrun start, interpreters and model included


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("dp-errors")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CBGEN_LOG_LEVEL": "WARNING"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(WORKER), "dp_errors", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT_S, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = [json.loads((out / f"dp_errors-llama-rank{r}.json").read_text()) for r in (0, 1)]
    for r in results:
        assert "exception" not in r, f"rank {r['rank']}:\n{r['exception']}"
    return results


def _same_error(ranks: list[dict], call: str, kind: str) -> str:
    first, second = (r[call] for r in ranks)
    assert "tokens" not in first and "tokens" not in second, f"{call}: a rank did not raise: {ranks}"
    assert first["type"] == second["type"] == kind
    assert first["message"] == second["message"]
    assert first["notes"] and "Traceback" in first["notes"][0]  # the failing rank's own traceback
    return first["message"]


def test_a_bad_prompt_on_one_rank_raises_on_every_rank(ranks):
    message = _same_error(ranks, "oov", "ValueError")
    assert message.startswith("generate_dp failed on rank 1: ")
    assert "prompt token id 999 is outside the vocabulary [0, 300)" in message


def test_a_params_list_of_the_wrong_length_raises_generate_s_error_everywhere(ranks):
    message = _same_error(ranks, "params_len", "ValueError")
    assert message.startswith("generate_dp failed on ranks 0, 1: got 2 SamplingParams for 3 prompts")
    message = _same_error(ranks, "params_len_rank0", "ValueError")
    assert message == "generate_dp failed on rank 0: got 4 SamplingParams for 5 prompts"


def test_an_error_while_generating_reaches_every_rank(ranks):
    message = _same_error(ranks, "generation", "RuntimeError")
    assert message == "generate_dp failed on rank 1: boom: the forward failed"


@pytest.mark.parametrize("call", ["after_oov", "after_generation"])
def test_the_call_after_a_caught_error_works(ranks, call):
    for r in ranks:
        assert r[call] == {"tokens": r["alone"]}
