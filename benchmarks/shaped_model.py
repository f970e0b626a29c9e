"""Writes a model of a published shape with random weights to a folder, for ``cbgen bench --model``.

Shapes (``--shape``), each with SmolLM2's vocabulary and tokenizer so the chat workload's prompts
are real text; nothing is downloaded:

* ``qwen3.5-0.8b``: Qwen3.5-0.8B's text model (hidden 1024, 24 layers, Gated DeltaNet and gated full
  attention 3:1, 16 DeltaNet heads of 128, 8 attention heads of 256 over 2 KV heads);
* ``deepseek-v2-lite``: DeepSeek-V2-Lite's latent attention (hidden 2048, 16 heads, latent 512 +
  rope 64, keys 128 + 64, values 128) over 8 layers with a dense MLP of 2816 instead of 27 layers of
  64 experts (349M parameters against 15.7B, so it runs on a 2-core machine).

::

    python benchmarks/shaped_model.py --out /tmp/qwen35-shape
    python benchmarks/shaped_model.py --shape deepseek-v2-lite --out /tmp/dsv2-shape
    cbgen bench --model /tmp/qwen35-shape --workloads chat,grpo --engines cbgen,hf-generate
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers


def _tokenizer():
    from cbgen_bench.workloads import load_bench_model

    return load_bench_model("smollm2", "float32", "cpu")[1]


# DeepSeek-V2-Lite's attention (27 layers in the published model): 16 heads, latent 512 + rope 64,
# keys 128 + 64 and values 128 per head.  benchmarks/kv_layouts.py sizes its cache from it too.
DEEPSEEK_V2_LITE_ATTENTION = dict(
    num_attention_heads=16,
    num_key_value_heads=16,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
)


def build_deepseek(layers: int = 8, seed: int = 0):
    """The random DeepSeek-V2-Lite-attention model (float32) and its tokenizer."""
    tokenizer = _tokenizer()
    config = transformers.DeepseekV2Config(
        vocab_size=len(tokenizer),
        hidden_size=2048,
        intermediate_size=2816,
        num_hidden_layers=layers,
        first_k_dense_replace=layers,  # every layer dense
        **DEEPSEEK_V2_LITE_ATTENTION,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return transformers.DeepseekV2ForCausalLM(config).eval(), tokenizer


def build(layers: int = 24, hidden: int = 1024, seed: int = 0):
    """The random Qwen3.5-shaped model (float32) and its tokenizer."""
    tokenizer = _tokenizer()
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
    parser.add_argument("--shape", choices=["qwen3.5-0.8b", "deepseek-v2-lite"], default="qwen3.5-0.8b")
    parser.add_argument("--layers", type=int, help="default: 24 (qwen3.5-0.8b), 8 (deepseek-v2-lite)")
    parser.add_argument("--hidden", type=int, default=1024, help="qwen3.5-0.8b only")
    args = parser.parse_args()
    if args.shape == "deepseek-v2-lite":
        model, tokenizer = build_deepseek(args.layers or 8)
    else:
        model, tokenizer = build(args.layers or 24, args.hidden)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: {type(model).__name__}, {params / 1e6:.0f}M parameters")


if __name__ == "__main__":
    main()
