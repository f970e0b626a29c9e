"""A/B of cbgen checkouts on the bench's workloads (fp32, the bench's engine settings).

Run it once per checkout, alternating, with that checkout's `src` first on the path, e.g.

    git worktree add /tmp/old 17af4ca
    for v in /tmp/old .; do PYTHONPATH=$v/src python benchmarks/ab_checkouts.py chat overhead; done

Workloads are named on the command line (default: chat overhead; any of the bench's chat, overhead,
grpo, mixed), each on its default model; a name ending in ``+parity`` runs it with
``batch_invariant=True`` (parity mode).  Each run prints one JSON line: wall seconds and engine
steps of 3 timed runs after a warm-up, each on a fresh engine as in `cbgen bench` (a prefix cache
left warm by the previous run would flatter the later runs), and for greedy workloads the first
tokens (the checkouts must agree).  Used for #14's and #17's before/after comparisons.
"""

import json
import os
import sys
import time

import torch
from cbgen_bench.workloads import DEFAULT_MODELS, build_workload, load_bench_model, vocab_size_of

import cbgen
from cbgen.llm import LLM
from cbgen.sampling_params import SamplingParams


def engine(model, parity: bool = False):
    """An LLM with the bench's settings (``parity``: in parity mode)."""
    extra = {"batch_invariant": True} if parity else {}
    return LLM(
        model,
        None,
        max_num_batched_tokens=2048,
        max_num_seqs=256,
        block_size=16,
        enable_prefix_caching=True,
        **extra,
    )


def time_workload(name: str) -> dict:
    """Wall seconds, steps and tokens of 3 timed runs of workload ``name`` after a warm-up run."""
    name, _, mode = name.partition("+")
    parity = mode == "parity"
    key = DEFAULT_MODELS[name]
    model, tok = load_bench_model(key, "float32", None)
    wl = build_workload(name, tiny=False, model=key, vocab_size=vocab_size_of(model), tokenizer=tok)
    params = [
        SamplingParams(
            n=wl.n,
            max_tokens=m,
            temperature=wl.temperature,
            ignore_eos=True,
            seed=None if wl.greedy else wl.seed + i,
        )
        for i, m in enumerate(wl.max_tokens)
    ]
    engine(model, parity).generate(wl.prompts, params, use_tqdm=False)  # warm-up: kernels, GEMM choice
    walls, steps = [], []
    for _ in range(3):
        llm = engine(model, parity)
        eng = llm.engine
        count = [0]
        real_step = eng.step

        def step(*a, real_step=real_step, count=count, **k):
            count[0] += 1
            return real_step(*a, **k)

        eng.step = step
        t = time.perf_counter()
        outs = llm.generate(wl.prompts, params, use_tqdm=False)
        walls.append(time.perf_counter() - t)
        steps.append(count[0])
    result = {
        "walls": walls,
        "steps": steps,
        "tokens": sum(len(c.token_ids) for o in outs for c in o.outputs),
        "ms_per_step": [w / s * 1e3 for w, s in zip(walls, steps)],
    }
    if wl.greedy:
        result["first_tokens"] = [list(c.token_ids[:8]) for c in outs[0].outputs]
    return result


if __name__ == "__main__":
    names = sys.argv[1:] or ["chat", "overhead"]
    out = {"src": os.path.dirname(cbgen.__file__), "threads": torch.get_num_threads()}
    for name in names:
        out[name] = time_workload(name)
    print("AB " + json.dumps(out))
