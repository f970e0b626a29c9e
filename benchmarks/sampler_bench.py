"""Micro-benchmark of the Sampler against a bare ``logits.argmax(-1)``.

Times B=256, V=49152 for (a) an all-greedy batch and (b) a batch mixing temperature, top-k,
top-p, min-p, penalties and seeds, and prints the median milliseconds and the ratio to argmax.
The logits are LM-like (a few dominant tokens over a long tail), so truncation behaves as it does
on real models.  Run: ``python benchmarks/sampler_bench.py [--device cuda] [--iters 20]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cbgen.model.kernels.cpu import ops as cpu_kernels
from cbgen.request import Request
from cbgen.sample.sampler import Sampler
from cbgen.sampling_params import SamplingParams


def lm_like_logits(batch: int, vocab: int, device: str, seed: int = 0) -> torch.Tensor:
    """Gaussian tail plus a Zipf-like head of boosted tokens per row.

    The head's height varies per row so the tail holds from under 1% to about half of the mass:
    most rows have small top-p nuclei, some (high-entropy positions) have thousands of tokens.
    """
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen) * 2.0
    head = torch.randint(0, vocab, (batch, 40), generator=gen)
    height = 11.0 + 8.0 * torch.rand(batch, 1, generator=gen)
    boost = height - 2.5 * torch.log1p(torch.arange(40, dtype=torch.float32))
    logits.scatter_(1, head, boost + torch.randn(batch, 40, generator=gen))
    return logits.to(device)


def mixed_params(i: int) -> SamplingParams:
    """A rotating mix of the settings real traffic uses."""
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=50),
        SamplingParams(temperature=0.8, min_p=0.05, seed=i),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, top_k=40, top_p=0.95, repetition_penalty=1.1),
        SamplingParams(temperature=1.0, top_p=0.95, presence_penalty=0.5, frequency_penalty=0.3, seed=i),
        SamplingParams(temperature=0.9, top_k=20, logprobs=5),
    ]
    return kinds[i % len(kinds)]


def make_requests(batch: int, params_of, vocab: int) -> list[Request]:
    gen = torch.Generator().manual_seed(1)
    reqs = []
    for i in range(batch):
        prompt = torch.randint(0, vocab, (200,), generator=gen).tolist()
        req = Request(
            request_id=f"r{i}", prompt_token_ids=prompt, params=params_of(i), eos_token_ids=frozenset({2})
        )
        for t in torch.randint(0, vocab, (50,), generator=gen).tolist():
            req.append_token(t)
        reqs.append(req)
    return reqs


def median_ms(fn, iters: int, device: str) -> float:
    fn()
    times = []
    for _ in range(iters):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    """Runs the benchmark and prints one line per case."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    logits = lm_like_logits(args.batch, args.vocab, args.device)
    # The engine hands the sampler the C greedy kernel where its execution plan picks it (CPU, C built).
    kernel = None
    if args.device == "cpu" and cpu_kernels.available():
        kernel = cpu_kernels.greedy_rows
    sampler = Sampler(args.vocab, greedy_kernel=kernel)
    greedy = make_requests(args.batch, lambda i: SamplingParams(temperature=0.0), args.vocab)
    mixed = make_requests(args.batch, mixed_params, args.vocab)

    t_argmax = median_ms(lambda: logits.argmax(-1), args.iters, args.device)
    t_greedy = median_ms(lambda: sampler(logits, greedy), args.iters, args.device)
    t_mixed = median_ms(lambda: sampler(logits, mixed), args.iters, args.device)
    print(f"B={args.batch} V={args.vocab} device={args.device} threads={torch.get_num_threads()}")
    print(f"bare argmax      {t_argmax:8.2f} ms")
    print(f"sampler greedy   {t_greedy:8.2f} ms   ({t_greedy / t_argmax:.2f}x argmax)")
    print(f"sampler mixed    {t_mixed:8.2f} ms   ({t_mixed / t_argmax:.2f}x argmax)")


if __name__ == "__main__":
    main()
