"""A/B of cbgen checkouts on the bench's `chat` and `overhead` workloads (fp32, the bench's settings).

Run it once per checkout, alternating, with that checkout's `src` first on the path, e.g.

    git worktree add /tmp/old 17af4ca
    for v in /tmp/old .; do PYTHONPATH=$v/src python benchmarks/ab_checkouts.py; done

Each run prints one JSON line: wall seconds and engine steps of 3 timed runs after a warm-up, and
the first tokens (the checkouts must agree).  Used for #14's before/after comparison.
"""

import json
import os
import time

import torch

import cbgen
from cbgen.bench.workloads import build_workload, load_bench_model, vocab_size_of
from cbgen.llm import LLM
from cbgen.sampling_params import SamplingParams

out = {"src": os.path.dirname(cbgen.__file__), "threads": torch.get_num_threads()}
for name, key in (("chat", "smollm2"), ("overhead", "tiny")):
    model, tok = load_bench_model(key, "float32", None)
    wl = build_workload(name, tiny=False, model=key, vocab_size=vocab_size_of(model), tokenizer=tok)
    llm = LLM(
        model, None, max_num_batched_tokens=2048, max_num_seqs=256, block_size=16, enable_prefix_caching=True
    )
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
    eng = llm.engine
    real_step = eng.step
    count = [0]

    def step(*a, real_step=real_step, count=count, **k):
        count[0] += 1
        return real_step(*a, **k)

    eng.step = step
    llm.generate(wl.prompts, params, use_tqdm=False)  # warm-up
    walls, steps = [], []
    for _ in range(3):
        count[0] = 0
        t = time.perf_counter()
        outs = llm.generate(wl.prompts, params, use_tqdm=False)
        walls.append(time.perf_counter() - t)
        steps.append(count[0])
    toks = sum(len(c.token_ids) for o in outs for c in o.outputs)
    out[name] = {
        "walls": walls,
        "steps": steps,
        "tokens": toks,
        "ms_per_step": [w / s * 1e3 for w, s in zip(walls, steps)],
        "first_tokens": [list(c.token_ids[:8]) for c in outs[0].outputs],
    }
print("AB " + json.dumps(out))
