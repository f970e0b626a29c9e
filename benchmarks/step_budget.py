"""Where a decode step of the chat workload goes, against the matmul ceiling that `cbgen bench`
measures: how much of the step is not GEMM, and what reaching a given share of the ceiling leaves
for the rest.

Runs the chat workload's 64 prompts through the engine (128 tokens each, greedy), times every
decode step (the one-call C layer step stage by stage, the rest of the forward, sampling, the host's
scheduling, input building and update), and times the step's FLOPs at the ceiling's rate (the fastest GEMM the
engine can call, cold weights: `cbgen_bench.matmul_ceiling.best_gemm`). Then it times the decode
attention alone over 30 layers on the workload's own block sharing (prompt blocks with equal
prefixes shared, as the prefix cache shares them) at a few decode positions, once with the KV read
from memory and once with each layer's KV already in the last-level cache: the second is what
any exact kernel that reads the KV in this layout pays at least.

    python benchmarks/step_budget.py --dtype bfloat16
    python benchmarks/step_budget.py --dtype float32 --target 0.85
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from cbgen_bench.matmul_ceiling import COLD_BYTES, best_gemm
from cbgen_bench.run_meta import run_meta
from cbgen_bench.workloads import chat_prompts, model_dims

from cbgen import LLM, SamplingParams
from cbgen.model.kernels.cpu import decoder as c_decoder
from cbgen.model.kernels.cpu import ops
from cbgen.utils import advise_huge_pages

ROWS, NEW_TOKENS, BLOCK = 64, 128, 16
# Streamed between touching a layer's KV and attending over it: about one layer's weights, so the
# KV has left L1/L2 for the last-level cache, as a step's GEMMs leave it.
EVICT_BYTES = 12 << 20


def engine_steps(model, tokenizer, prompts: list[list[int]]) -> list[dict[str, float]]:
    """Seconds per phase of every decode step with all ``ROWS`` rows, from one run of the workload
    (a warm-up run first, the prefix cache reset before each)."""
    llm = LLM(model, tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    stages = torch.zeros(len(c_decoder.STAGES), dtype=torch.float64)
    original = c_decoder.decoder_step

    def timed(*args, **kwargs):
        return original(*args, **kwargs, stage_seconds=stages)

    steps: list[dict[str, float]] = []
    c_decoder.decoder_step = timed
    try:
        for keep in (False, True):
            llm.engine.reset_prefix_cache()
            llm.add_requests(prompts, params)
            while llm.engine.has_unfinished():
                stages.zero_()
                t = time.perf_counter()
                llm.engine.step()
                total = time.perf_counter() - t
                last = llm.engine.last_step
                if keep and last.num_decode == ROWS and not last.num_prefill_tokens:
                    parts = dict(zip(c_decoder.STAGES, stages.tolist()))
                    steps.append({**last.times, **parts, "total": total, "c_step": float(stages.sum())})
    finally:
        c_decoder.decoder_step = original
    return steps


def attention_ms(
    prompts: list[list[int]], dims, kv_heads: int, dtype: torch.dtype, position: int, resident: bool
) -> float:
    """Median ms of the decode attention over every layer for the ``ROWS`` rows at decode
    ``position``, on block tables that share prompt blocks with equal prefixes; ``resident``: each
    layer's KV read once (then ``EVICT_BYTES`` of other data) just before its attention."""
    ids: dict[object, int] = {}
    rows = []
    for i, prompt in enumerate(prompts):
        n = len(prompt) + position
        rows.append(
            [
                ids.setdefault(
                    tuple(prompt[: (b + 1) * BLOCK]) if (b + 1) * BLOCK <= len(prompt) else (i, b), len(ids)
                )
                for b in range(-(-n // BLOCK))
            ]
        )
    table = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.int32)
    for i, r in enumerate(rows):
        table[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    lens = torch.tensor([len(p) + position for p in prompts], dtype=torch.int32)
    shape = (len(ids), BLOCK, kv_heads, dims.head_dim)
    caches = [
        tuple(advise_huge_pages(torch.empty(shape, dtype=dtype)).copy_(torch.randn(shape)) for _ in "kv")
        for _ in range(dims.num_layers)
    ]
    q = torch.randn(len(rows), dims.num_heads, dims.head_dim).to(dtype)
    other = torch.randn(EVICT_BYTES // 4)
    scale = dims.head_dim**-0.5
    times = []
    for _ in range(7):
        spent = 0.0
        for k, v in caches:
            if resident:
                k.sum(), v.sum(), other.sum()
            t = time.perf_counter()
            ops.decode_direct(q, k, v, table, lens, scale, 0, 0.0)
            spent += time.perf_counter() - t
        times.append(spent)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--target", type=float, default=0.85, help="share of the ceiling to budget for")
    parser.add_argument("--positions", type=int, nargs="+", default=[0, 32, 64, 96, 127])
    args = parser.parse_args()

    from cbgen.model.loading.loader import load_model

    model, tokenizer = load_model(None, dtype=args.dtype)
    dims = model_dims(model)
    prompts = chat_prompts(ROWS, tokenizer, model.config.vocab_size)
    meta = run_meta(
        argparse.Namespace(
            device=None,
            dtype=args.dtype,
            repeats=1,
            tiny=False,
            no_isolate=True,
            cold_start=False,
            cold_repeats=0,
        ),
        [],
    )
    print(f"{meta['cpu']} ({', '.join(meta['cpu_features'])}), {meta['threads']} threads, {args.dtype}")

    steps = engine_steps(model, tokenizer, prompts)
    med = {k: statistics.mean(s[k] for s in steps) * 1e3 for k in steps[0]}
    host = med["total"] - med["forward"] - med["sample"]

    shapes = [*dims.layer_linears, (dims.hidden_size, dims.vocab_size)]
    gemm = best_gemm(shapes, ROWS, args.dtype, None, 0.3, COLD_BYTES)
    # The ceiling's FLOPs of one step: every matmul and the LM head for each row, plus attention at
    # the GEMM's rate (cbgen_bench.workloads.workload_flops), at the mean decode context.
    context = statistics.mean(len(p) for p in prompts) + (NEW_TOKENS - 1) / 2
    flops = ROWS * (
        2 * dims.matmul_params
        + 2 * dims.lm_head_params
        + 4 * dims.num_layers * dims.num_heads * dims.head_dim * context
    )
    ceiling = flops / (gemm["gflops"] * 1e9) * 1e3

    kv_heads = int(getattr(model.config, "num_key_value_heads", dims.num_heads))
    attn = {
        where: statistics.mean(
            attention_ms(prompts, dims, kv_heads, model.dtype, p, where == "cache") for p in args.positions
        )
        for where in ("memory", "cache")
    }
    budget = ceiling / args.target

    print(f"\nA decode step of the chat workload ({ROWS} rows, mean of {len(steps)} steps), ms:")
    print(f"  whole step                         {med['total']:7.2f}")
    print(f"    C layer step                     {med['c_step']:7.2f}")
    gemms = [n for n in c_decoder.STAGES if "projection" in n]
    print(f"      its projections                {sum(med[n] for n in gemms):7.2f}")
    print(f"      attention                      {med['attention']:7.2f}")
    rest = [n for n in c_decoder.STAGES if n not in gemms and n != "attention"]
    print(f"      {', '.join(rest)}: {sum(med[n] for n in rest):.2f}")
    print(f"    rest of the forward (LM head)    {med['forward'] - med['c_step']:7.2f}")
    print(f"    sampling                         {med['sample']:7.2f}")
    print(f"    host (schedule, build, update)   {host:7.2f}")
    print(
        f"  the ceiling's time for its FLOPs   {ceiling:7.2f}  ({gemm['gemm']}, {gemm['gflops']:.0f} GFLOP/s)"
    )
    print(f"  -> this step is at {100 * ceiling / med['total']:.1f}% of the ceiling")
    print(f"\nAttention alone, mean over positions {args.positions}, ms a step:")
    print(f"  KV from memory                     {attn['memory']:7.2f}")
    print(f"  KV already in the last-level cache {attn['cache']:7.2f}")
    print(
        f"\n{100 * args.target:.0f}% of the ceiling needs a step of {budget:.2f} ms: {budget - ceiling:.2f} ms for"
    )
    print(f"everything but the ceiling's FLOPs. Sampling and host take {med['sample'] + host:.2f} of it, and")
    print(
        f"attention with its KV already cached {attn['cache']:.2f} (in the step: {med['attention']:.2f}):"
        f" {med['sample'] + host + attn['cache']:.2f} ms before any elementwise kernel."
    )


if __name__ == "__main__":
    main()
