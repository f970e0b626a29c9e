"""Times isolated decode steps of the chat workload: the number every throughput figure rests on.

Prefills the 64 chat prompts of ``cbgen bench``'s ``chat`` workload, then times ``--steps`` decode
steps (all 64 sequences decoding, ~150-400 tokens of context) and prints the median per-phase time
(schedule, build, forward, sample, update) and decode tokens/s.  Variants are timed round-robin in
one process, so machine drift hits them alike.

    python benchmarks/step_bench.py --dtype float32 --variants default torch
    python benchmarks/step_bench.py --dtype bfloat16 --profile
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from cbgen_bench.workloads import chat_prompts

from cbgen import LLM, SamplingParams

VARIANTS = {
    "unfused": {"fused_decode": False},
    "default": {},
    "torch": {"attention_backend": "torch"},
    "static": {"decode_mode": "static"},
    "compile": {"compile": True},
    "parity": {"batch_invariant": True},
}


def build(model, tokenizer, variant: str, batch: int) -> LLM:
    """An LLM configured as ``variant`` (a key of ``VARIANTS``; ``default`` = plain ``LLM``)."""
    kwargs = VARIANTS[variant]
    return LLM(model, tokenizer, max_num_seqs=batch, kv_cache_memory=1 << 30, **kwargs)


def prime(llm: LLM, prompts: list[list[int]], new_tokens: int) -> None:
    """Adds the prompts and steps until every sequence is decoding."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.add_requests(prompts, params)
    llm.engine.step()
    while llm.engine.last_step.num_prefill_tokens or llm.engine.scheduler.waiting:
        llm.engine.step()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=["default"], choices=sorted(VARIANTS))
    parser.add_argument("--profile", action="store_true", help="torch profiler table of one round's steps")
    args = parser.parse_args()

    from cbgen.model.loading.loader import load_model

    model, tokenizer = load_model(None, dtype=args.dtype)
    prompts = chat_prompts(args.batch, tokenizer, model.config.vocab_size)
    results: dict[str, list[dict[str, float]]] = {v: [] for v in args.variants}
    for _ in range(args.rounds):
        for variant in args.variants:
            llm = build(model, tokenizer, variant, args.batch)
            prime(llm, prompts, new_tokens=args.steps + 4)
            t = time.perf_counter()
            llm.engine.step()  # warm (compiles, for the compile variant)
            print(f"{variant}: first decode step {time.perf_counter() - t:.1f} s", flush=True)
            steps = []
            profiler = torch.profiler.profile() if args.profile else None
            if profiler:
                profiler.__enter__()
            for _ in range(args.steps):
                t = time.perf_counter()
                llm.engine.step()
                total = time.perf_counter() - t
                steps.append(
                    {**llm.engine.last_step.times, "total": total, "threads": llm.engine.last_step.threads}
                )
            if profiler:
                profiler.__exit__(None, None, None)
                print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
            results[variant].append({k: statistics.median(s[k] for s in steps) for k in steps[0]})
            del llm
    print(f"\nSmolLM2 {args.dtype}, {args.batch} sequences decoding, median ms/step over rounds")
    print(
        f"{'variant':12s} {'total':>8s} {'forward':>8s} {'sample':>8s} {'other':>8s} {'tok/s':>8s} {'threads':>8s}"
    )
    for variant, rounds in results.items():
        med = {k: statistics.median(r[k] for r in rounds) * 1e3 for k in rounds[0] if k != "threads"}
        other = med["total"] - med["forward"] - med["sample"]
        print(
            f"{variant:12s} {med['total']:8.1f} {med['forward']:8.1f} {med['sample']:8.1f} {other:8.1f} "
            f"{args.batch / med['total'] * 1e3:8.0f} {min(r['threads'] for r in rounds):4.0f}-{max(r['threads'] for r in rounds):.0f}"
        )


if __name__ == "__main__":
    main()
