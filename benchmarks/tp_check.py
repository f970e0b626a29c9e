"""Tensor-parallel check for a device run: one rank of ``torchrun --nproc-per-node N tp_check.py``.

Saves a small Qwen3-shaped model (rank 0), loads it sharded with ``LLM(path, tensor_parallel_size=N)``
(NCCL on CUDA, gloo on CPU), and compares greedy tokens with the unsharded model on one device, and
the ranks' outputs with each other.  Rank 0 prints one JSON line: ``{"ok": ..., ...}``.
``benchmarks/gpu_check.py`` runs it when the machine has two or more GPUs (CPU in its dry run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from cbgen import LLM, SamplingParams


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--out", default=None, help="folder for the model (default: a temporary one)")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    folder = Path(args.out or tempfile.gettempdir()) / "cbgen-tp-check"
    dtype = torch.bfloat16 if cuda else torch.float32
    if rank == 0:
        config = transformers.Qwen3Config(
            vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
        )  # fmt: skip
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(folder)
    dist.barrier()
    device = f"cuda:{local}" if cuda else "cpu"
    prompts = [[(7 * i + j) % 4000 + 10 for j in range(20 + 13 * i)] for i in range(16)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm = LLM(
        str(folder), tensor_parallel_size=world, tokenizer=False, dtype=str(dtype).removeprefix("torch.")
    )
    sharded = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    seconds = time.perf_counter() - start
    single = LLM(str(folder), tokenizer=False, device=device, dtype=str(dtype).removeprefix("torch."))
    alone = [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    gathered: list = [None] * world
    dist.all_gather_object(gathered, sharded)
    same_ranks = all(g == sharded for g in gathered)
    # bf16 on a device: summation orders differ between sharded and whole matmuls, so a few greedy
    # runs may part at near-ties; report how many match rather than demand all.
    matching = sum(a == b for a, b in zip(sharded, alone))
    if rank == 0:
        result = {
            "ok": same_ranks and matching >= len(prompts) - (0 if not cuda else 3),
            "ranks_identical": same_ranks,
            "match_single_device": f"{matching}/{len(prompts)}",
            "kv_heads_per_rank": llm.engine.kv_cache.geometry.num_kv_heads,
            "seconds": round(seconds, 2),
            "world": world,
        }
        print(json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
