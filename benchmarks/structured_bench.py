"""Per-step cost of structured output: 64 constrained rows, SmolLM2's tokenizer (V = 49,152).

Each constrained row walks a nested JSON schema (object, enum, array) at its own position: before a
timed step every matcher has consumed a different random-length valid prefix, so the masks are a
realistic mix (inside strings most tokens are allowed, between keys only a few).  Times, medians
over ``--iters`` steps:

* ``fill``: the backend filling 64 bitmasks (one call);
* ``apply``: expanding the bitmask and adding it to the logits;
* ``sampler``: a whole ``Sampler`` call on 64 constrained rows against the same call on 64
  unconstrained rows with the same settings; the difference is what a step pays.

Also prints the one-off costs: preparing the tokenizer for the grammar library, and compiling the
schema.  Run: ``python benchmarks/structured_bench.py [--rows 64] [--iters 30] [--temperature 0.7]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from cbgen.model.loading.loader import ensure_default_model
from cbgen.request import Request
from cbgen.sample.sampler import Sampler
from cbgen.sample.structured import StructuredOutputs
from cbgen.sampling_params import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}


def _median_ms(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _walk(so: StructuredOutputs, req: Request, steps: int, rng: random.Random) -> None:
    """Advances ``req`` by up to ``steps`` random allowed tokens (not EOS)."""
    for _ in range(steps):
        logits = torch.zeros(1, so.vocab_size)
        so.apply(logits, [0], [req], {})
        allowed = [t for t in logits[0].isfinite().nonzero().flatten().tolist() if t not in so.eos_token_ids]
        if not allowed:
            return
        req.append_token(rng.choice(allowed) if rng.random() < 0.5 else max(allowed))


def main() -> None:
    """Prints the timings (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--temperature", type=float, default=0.7)
    args = ap.parse_args()
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(ensure_default_model()))
    vocab = 49152
    so = StructuredOutputs(tokenizer, vocab, [2])
    t = time.perf_counter()
    _ = so.backend
    print(f"tokenizer preparation (once per engine): {(time.perf_counter() - t) * 1e3:.0f} ms")
    constrained = SamplingParams(temperature=args.temperature, structured_output={"json": SCHEMA})
    t = time.perf_counter()
    so.validate(constrained)
    print(f"schema compile (once per distinct schema): {(time.perf_counter() - t) * 1e3:.1f} ms")

    rng = random.Random(0)
    reqs = [Request(f"c{i}", [1, 2, 3], constrained, eos_token_ids=frozenset({2})) for i in range(args.rows)]
    for req in reqs:
        _walk(so, req, rng.randrange(0, 40), rng)
    free_params = SamplingParams(temperature=args.temperature)
    free = [Request(f"f{i}", r.token_ids[:3], free_params, frozenset({2})) for i, r in enumerate(reqs)]
    logits = torch.randn(args.rows, vocab) * 2

    backend = so.backend
    states = [so._caught_up(r) for r in reqs]
    bitmask = torch.full((args.rows, vocab // 32), -1, dtype=torch.int32)
    fill = _median_ms(lambda: backend.fill([(m, i) for i, m in enumerate(states)], bitmask), args.iters)
    work = logits.clone()
    apply = _median_ms(lambda: work.add_(so._expand(bitmask, work.device, vocab)), args.iters)
    sampler = Sampler(vocab, structured=so)
    with_so = _median_ms(lambda: sampler(logits, reqs), args.iters)
    without = _median_ms(lambda: sampler(logits, free), args.iters)
    print(f"{args.rows} rows, V={vocab}, torch threads {torch.get_num_threads()}:")
    print(f"  fill {fill:.2f} ms   apply {apply:.2f} ms")
    print(
        f"  sampler: constrained {with_so:.2f} ms, unconstrained {without:.2f} ms, "
        f"difference {with_so - without:.2f} ms per step"
    )


if __name__ == "__main__":
    main()
