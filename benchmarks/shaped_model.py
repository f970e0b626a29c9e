"""Writes a model of a published shape with random weights to a folder, for ``cbgen bench --model``.

Shapes (``--shape``), each with SmolLM2's vocabulary and tokenizer so the chat workload's prompts
are real text; nothing is downloaded:

* ``qwen3.5-0.8b``: Qwen3.5-0.8B's text model (hidden 1024, 24 layers, Gated DeltaNet and gated full
  attention 3:1, 16 DeltaNet heads of 128, 8 attention heads of 256 over 2 KV heads);
* ``deepseek-v2-lite``: DeepSeek-V2-Lite's latent attention (hidden 2048, 16 heads, latent 512 +
  rope 64, keys 128 + 64, values 128) over 8 layers with a dense MLP of 2816 instead of 27 layers of
  64 experts (349M parameters against 15.7B, so it runs on a 2-core machine);
* ``gemma4-e2b``: Gemma-4-E2B's attention as ``benchmarks/kv_layouts.py`` states it (35 layers, 1 KV
  head, 256/512-wide layers 4:1, window 512, the last 20 layers KV-shared), MLP and per-layer inputs
  shrunk.

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


def build_gemma4(layers: int = 35, seed: int = 0):
    """A random Gemma-4-E2B-attention model (float32) and its tokenizer: hidden 1536, 8 query heads
    over 1 KV head, 256-wide sliding (window 512) and 512-wide full layers 4:1, the last 20 layers
    reading earlier layers' keys and values; MLP and per-layer inputs shrunk (2048, 64)."""
    tokenizer = _tokenizer()
    config = transformers.Gemma4TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=1536,
        intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=256,
        global_head_dim=512,
        num_kv_shared_layers=layers * 4 // 7,
        layer_types=[("full_attention" if (i + 1) % 5 == 0 else "sliding_attention") for i in range(layers)],
        sliding_window=512,
        vocab_size_per_layer_input=len(tokenizer),
        hidden_size_per_layer_input=64,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return transformers.Gemma4ForCausalLM(config).eval(), tokenizer


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
    parser.add_argument(
        "--shape", choices=["qwen3.5-0.8b", "deepseek-v2-lite", "gemma4-e2b"], default="qwen3.5-0.8b"
    )
    parser.add_argument(
        "--layers", type=int, help="default: 24 (qwen3.5-0.8b), 8 (deepseek-v2-lite), 35 (gemma4-e2b)"
    )
    parser.add_argument("--hidden", type=int, default=1024, help="qwen3.5-0.8b only")
    parser.add_argument(
        "--std",
        type=float,
        help="redraw every matrix from N(0, std): transformers' 0.02 init gives nearly flat logits on "
        "deep models, where float32 rounding flips greedy near-ties between engines",
    )
    args = parser.parse_args()
    if args.shape == "deepseek-v2-lite":
        model, tokenizer = build_deepseek(args.layers or 8)
    elif args.shape == "gemma4-e2b":
        model, tokenizer = build_gemma4(args.layers or 35)
    else:
        model, tokenizer = build(args.layers or 24, args.hidden)
    if args.std:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, args.std)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: {type(model).__name__}, {params / 1e6:.0f}M parameters")


if __name__ == "__main__":
    main()
