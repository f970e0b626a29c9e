"""The ``long`` workload: one sequence at a time at long contexts, each engine against the bound this
machine sets.

Cases (:func:`long_cases`): single-sequence decode at 2k and 8k tokens of context and at the model's
maximum (duplicates dropped), and the prefill of the 8k case's prompt.  A case is one request alone:
a random prompt of ``context - N - 1`` tokens and ``N + 1`` new tokens (greedy, EOS ignored), so its
last ``N`` decode steps run at contexts ``context - N .. context - 1``.  Each engine reports its
time to the first token (the prefill) and its decode time per token ``(wall - first) / N``; the
prompts differ per repeat so no prefix cache helps, and are the same for every engine so their
tokens can be compared.

Bounds, measured on this machine in the same run (:func:`bounds`):

* decode: the bytes one step must read, weights (every projection and the LM head) plus the KV of
  its context, over the memory bandwidth measured by streaming a buffer larger than any cache;
* prefill: the FLOPs (projections, causal attention QK^T and AV, the LM head for one row) over the
  best GEMM throughput at prefill shapes (:mod:`cbgen_bench.matmul_ceiling`).  Attention counted at
  GEMM speed makes this bound optimistic, i.e. hard to reach.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cbgen_bench.engine_settings import BLOCK_SIZE, MAX_NUM_BATCHED_TOKENS
from cbgen_bench.lifetime import run_child
from cbgen_bench.workloads import FIRST_ORDINARY_ID, ModelDims

DECODE_TOKENS = 32  # decode steps timed per case (tiny: 4)
CONTEXTS = (2048, 8192)
TINY_CONTEXTS = (64, 128)
LONG_ENGINES = ("cbgen", "hf-generate", "vllm")


@dataclass(frozen=True)
class LongCase:
    """One single-sequence case: ``prompt_len`` prompt tokens, ``new_tokens`` generated."""

    name: str
    context: int
    prompt_len: int
    new_tokens: int

    @property
    def decode_steps(self) -> int:
        """Steps timed as decode (the first token comes from the prefill)."""
        return self.new_tokens - 1


@dataclass
class CaseTiming:
    """One engine's timings of one case over the repeats, and the tokens of its last repeat."""

    ttft_s: list[float] = field(default_factory=list)
    decode_ms: list[float] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)  # per repeat


def long_cases(max_context: int, tiny: bool) -> list[LongCase]:
    """The cases for a model whose context holds ``max_context`` tokens."""
    steps = 4 if tiny else DECODE_TOKENS
    wanted = list(TINY_CONTEXTS) if tiny else [*CONTEXTS, max_context]
    contexts = sorted({min(c, max_context) for c in wanted})
    cases = []
    for c in contexts:
        label = f"{c // 1024}k" if c % 1024 == 0 else str(c)
        if c == max_context:
            label += " (max)"
        cases.append(LongCase(f"decode@{label}", c, c - steps - 1, steps + 1))
    return cases


def case_prompts(cases: list[LongCase], vocab_size: int, repeats: int) -> list[list[list[int]]]:
    """``[case][repeat]`` random prompts: distinct per repeat (no prefix-cache hits), the same for
    every engine."""
    out = []
    for i, case in enumerate(cases):
        rng = np.random.default_rng(1000 + i)
        out.append(
            [
                rng.integers(FIRST_ORDINARY_ID, vocab_size, size=case.prompt_len).tolist()
                for _ in range(repeats)
            ]
        )
    return out


# --------------------------------------------------------------------------- engines


def _cbgen_case(model: Any, prompt: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
    from cbgen.llm import LLM
    from cbgen.sampling_params import SamplingParams

    blocks = -(-(len(prompt) + new_tokens + 1) // BLOCK_SIZE) + 4
    llm = LLM(
        model, None, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, block_size=BLOCK_SIZE, num_blocks=blocks
    )
    engine = llm.engine
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    sample = engine.groups[rid].samples[0]
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
    wall = time.perf_counter() - t0
    # The engine stamps the first token on its own (monotonic) clock; steps return only finished
    # requests here.
    first = sample.first_token_time - sample.arrival_time if sample.first_token_time else wall
    return first, wall, tokens


def _hf_case(model: Any, prompt: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
    import torch

    stamps: list[float] = []

    class _Clock:
        """A streamer that only notes when generate hands it the prompt, then each token."""

        def put(self, value: Any) -> None:
            stamps.append(time.perf_counter())

        def end(self) -> None:
            pass

    ids = torch.tensor([prompt])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=[],
            pad_token_id=0,
            streamer=_Clock(),
        )
    wall = time.perf_counter() - t0
    first = stamps[1] - t0 if len(stamps) > 1 else wall
    return first, wall, out[0, len(prompt) :].tolist()


def run_in_process(
    engine: str, model: Any, cases: list[LongCase], prompts: list[list[int]]
) -> list[CaseTiming]:
    """One repeat of every case on ``engine`` (``cbgen`` or ``hf-generate``) in this process;
    ``prompts[i]`` is case ``i``'s prompt for this repeat."""
    run = _cbgen_case if engine == "cbgen" else _hf_case
    out = []
    for case, prompt in zip(cases, prompts):
        first, wall, tokens = run(model, prompt, case.new_tokens)
        out.append(CaseTiming([first], [(wall - first) / case.decode_steps * 1e3], [tokens]))
    return out


def warm_up(engine: str, model: Any, vocab_size: int) -> None:
    """One short untimed request, so first-call costs (kernel builds, GEMM choice) are not timed."""
    prompt = [vocab_size - 1 - (i % 7) for i in range(24)]
    (_cbgen_case if engine == "cbgen" else _hf_case)(model, prompt, 3)


def run_vllm_long(
    python: str, folder: str, dtype: str, cases: list[LongCase], prompts: list[list[list[int]]]
) -> list[CaseTiming]:
    """Every case and repeat in one vLLM process (its start-up takes a minute)."""
    from cbgen_bench.vllm_launch import VLLM_RUNNER, vllm_env

    spec = {
        "mode": "long",
        "model": folder,
        "dtype": dtype,
        "prompts": [p for per_case in prompts for p in per_case],
        "max_tokens": [c.new_tokens for c in cases for _ in prompts[0]],
        "n": 1,
        "temperature": 0.0,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "max_num_seqs": 1,
    }
    with tempfile.TemporaryDirectory(prefix="cbgen-vllm-long-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        proc = run_child(
            [python, str(VLLM_RUNNER), "--spec", str(spec_path), "--out", str(out_path)],
            env=vllm_env(),
            check=False,
        )
        if proc.returncode != 0 or not out_path.exists():
            raise RuntimeError(f"vllm_runner exited with status {proc.returncode}")
        data = json.loads(out_path.read_text())
    repeats = len(prompts[0])
    out = []
    for i, case in enumerate(cases):
        timing = CaseTiming()
        for r in data["requests"][i * repeats : (i + 1) * repeats]:
            timing.ttft_s.append(r["ttft_s"])
            timing.decode_ms.append((r["wall_s"] - r["ttft_s"]) / case.decode_steps * 1e3)
            timing.tokens.append(r["tokens"])
        out.append(timing)
    return out


# --------------------------------------------------------------------------- bounds


def memory_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> dict[str, float]:
    """GB/s streaming a ``nbytes`` buffer (larger than any cache) with torch's threads: a read-only
    pass (sum) and a copy (read + write bytes counted), best of ``repeats``."""
    import torch

    x = torch.ones(nbytes // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    read = copy = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        read = min(read, time.perf_counter() - t0)
        t0 = time.perf_counter()
        y.copy_(x)
        copy = min(copy, time.perf_counter() - t0)
    return {"read_gbs": nbytes / read / 1e9, "copy_gbs": 2 * nbytes / copy / 1e9}


def bounds(
    case: LongCase,
    dims: ModelDims,
    kv_heads: int,
    elem_bytes: int,
    bandwidth_gbs: float,
    prefill_gflops: float,
) -> dict[str, float]:
    """The decode bound (ms per token at the case's mean timed context) and the prefill bound (s)."""
    weights = (dims.matmul_params + dims.lm_head_params) * elem_bytes
    mean_context = case.prompt_len + 1 + case.decode_steps / 2
    kv = 2 * dims.num_layers * kv_heads * dims.head_dim * mean_context * elem_bytes
    n = case.prompt_len
    attn = 4 * dims.num_layers * dims.num_heads * dims.head_dim * n * (n + 1) / 2
    prefill_flops = 2 * dims.matmul_params * n + attn + 2 * dims.lm_head_params
    return {
        "weight_bytes": weights,
        "kv_bytes": kv,
        "decode_ms": (weights + kv) / (bandwidth_gbs * 1e9) * 1e3,
        "prefill_flops": prefill_flops,
        "prefill_s": prefill_flops / (prefill_gflops * 1e9),
    }


# --------------------------------------------------------------------------- report


def summarize_long(
    cases: list[LongCase],
    timings: dict[str, list[CaseTiming] | str],
    case_bounds: list[dict[str, float]],
    machine: dict[str, Any],
) -> dict[str, Any]:
    """The ``long`` section of the report: per case, each engine's medians, its ratio to the bound and
    to cbgen, and whether its tokens equal hf-generate's."""
    rows = []
    for i, case in enumerate(cases):
        bound = case_bounds[i]
        engines: dict[str, Any] = {}
        ref = timings.get("hf-generate")
        for engine, result in timings.items():
            if isinstance(result, str):
                engines[engine] = {"error": result}
                continue
            t = result[i]
            decode, ttft = statistics.median(t.decode_ms), statistics.median(t.ttft_s)
            row = {
                "decode_ms_per_token": decode,
                "decode_ms_runs": t.decode_ms,
                "ttft_s": ttft,
                "ttft_s_runs": t.ttft_s,
                "decode_x_bound": decode / bound["decode_ms"],
                "prefill_x_bound": ttft / bound["prefill_s"],
            }
            if isinstance(ref, list) and engine != "hf-generate":
                pairs = list(zip(t.tokens, ref[i].tokens))
                row["tokens_equal_hf"] = sum(a == b for a, b in pairs) / len(pairs) if pairs else None
            engines[engine] = row
        cb = engines.get("cbgen", {})
        for row in engines.values():
            if "decode_ms_per_token" in row and "decode_ms_per_token" in cb:
                row["decode_vs_cbgen"] = row["decode_ms_per_token"] / cb["decode_ms_per_token"]
                row["ttft_vs_cbgen"] = row["ttft_s"] / cb["ttft_s"]
        rows.append({**asdict(case), "bound": bound, "engines": engines})
    return {"machine": machine, "cases": rows}


def long_markdown(section: dict[str, Any] | None) -> list[str]:
    """The ``long`` section as markdown lines (empty when the run had none)."""
    if not section:
        return []
    m = section["machine"]
    lines = [
        "### Long contexts (one sequence at a time)",
        "",
        f"Bounds: decode = (weights + KV bytes of a step) / {m['bandwidth_gbs']:.1f} GB/s measured "
        f"(read {m['read_gbs']:.1f}, copy {m['copy_gbs']:.1f}); prefill = FLOPs / "
        f"{m['prefill_gflops']:.0f} GFLOP/s ({m['prefill_gemm']}, best GEMM at prefill shapes). "
        "`x bound`: time over the bound (1.00 = at the bound). `vs cbgen`: the engine's time over cbgen's "
        "(above 1: cbgen is faster).",
        "",
        "| case | engine | decode ms/token | x bound | vs cbgen | prefill s | x bound | vs cbgen | tokens = hf |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case in section["cases"]:
        b = case["bound"]
        label = f"{case['name']} ({case['prompt_len']:,}-token prompt)"
        lines.append(
            f"| {label} | *bound* | {b['decode_ms']:.1f} | 1.00 | | {b['prefill_s']:.2f} | 1.00 | | |"
        )
        for engine, row in case["engines"].items():
            if "error" in row:
                lines.append(f"| {label} | {engine} | ERROR {row['error']} | | | | | | |")
                continue
            eq = row.get("tokens_equal_hf")
            lines.append(
                f"| {label} | {engine} | {row['decode_ms_per_token']:.1f} | {row['decode_x_bound']:.2f} | "
                f"{row.get('decode_vs_cbgen', 1.0):.2f} | {row['ttft_s']:.2f} | {row['prefill_x_bound']:.2f} | "
                f"{row.get('ttft_vs_cbgen', 1.0):.2f} | {'ref' if engine == 'hf-generate' else _pct(eq)} |"
            )
    lines.append("")
    return lines


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.0%}"


__all__ = [
    "CaseTiming",
    "LongCase",
    "bounds",
    "case_prompts",
    "long_cases",
    "long_markdown",
    "memory_bandwidth",
    "run_in_process",
    "run_vllm_long",
    "summarize_long",
    "warm_up",
]
