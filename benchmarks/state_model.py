"""Writes a Qwen3.5-shaped model with random weights to a folder, for ``cbgen bench --model``.

The shape is Qwen3.5-0.8B's text model (hidden 1024, 24 layers, Gated DeltaNet and gated full
attention 3:1, 16 DeltaNet heads of 128, 8 attention heads of 256 over 2 KV heads), with SmolLM2's
vocabulary and tokenizer so the chat workload's prompts are real text.  Nothing is downloaded::

    python benchmarks/state_model.py --out /tmp/qwen35-0.8b-shape
    cbgen bench --model /tmp/qwen35-0.8b-shape --workloads chat,grpo --engines cbgen,hf-generate
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers


def build(layers: int = 24, hidden: int = 1024, seed: int = 0) -> torch.nn.Module:
    """The random Qwen3.5-shaped model (float32)."""
    from cbgen_bench.workloads import load_bench_model

    _, tokenizer = load_bench_model("smollm2", "float32", "cpu")
    config = transformers.Qwen3_5TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=3584 * hidden // 1024,
        num_hidden_layers=layers,
        layer_types=[("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(layers)],
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    return model, tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()
    model, tokenizer = build(args.layers, args.hidden)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: {type(model).__name__}, {params / 1e6:.0f}M parameters")


if __name__ == "__main__":
    main()
