"""``make demo``: generate for built-in chat prompts on the default model and report speed.

Usage: ``python -m cbgen.demo [--num-prompts N] [--max-tokens N] [--dtype float32|bfloat16] [--model PATH]``
"""

from __future__ import annotations

import argparse
import time

import torch

from cbgen import LLM, SamplingParams
from cbgen.prompts import chat_conversations
from cbgen.utils import human_bytes


def main(argv: list[str] | None = None) -> None:
    """Runs the demo and prints text samples, tokens/s and the KV-cache size."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--model", default=None, help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--show", type=int, default=4, help="how many answers to print")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype)
    t_load = time.perf_counter() - t0
    convs = chat_conversations(args.num_prompts)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    t1 = time.perf_counter()
    outputs = llm.chat(convs, params)
    elapsed = time.perf_counter() - t1

    for conv, out in list(zip(convs, outputs))[: args.show]:
        print(f"\n>>> {conv[-1]['content']}")
        print(out.outputs[0].text.strip())
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    kv = llm.engine.kv_cache
    stats = llm.stats
    print("\n" + "-" * 72)
    print(
        f"model            : {type(llm.model).__name__} ({next(llm.model.parameters()).dtype}, loaded in {t_load:.1f}s)"
    )
    print(f"requests         : {len(outputs)} chat prompts, {prompt_tokens} prompt tokens")
    print(f"generated        : {generated} tokens in {elapsed:.2f}s = {generated / elapsed:.1f} tokens/s")
    print(f"total throughput : {(generated + prompt_tokens) / elapsed:.1f} tokens/s (prompt + generated)")
    print(
        f"KV cache         : {kv.num_blocks} blocks x {kv.block_size} tokens = "
        f"{kv.num_blocks * kv.block_size} tokens, {human_bytes(kv.nbytes)}"
    )
    print(
        f"engine           : {stats.steps} steps, mean batch {stats.mean_batch_size:.1f} seqs, "
        f"{stats.preemptions} preemptions, torch threads {torch.get_num_threads()}"
    )


if __name__ == "__main__":
    main()
