"""KV-cache bytes per token of latent-attention and per-layer-shape models, and the decode cost of
the two MLA cache layouts.

``python benchmarks/kv_layouts.py bytes``: cbgen's cache layout (what ``cbgen info`` shows) for a
DeepSeek-V2-Lite-shaped and a Gemma-4-E2B-shaped model with random weights (their attention shapes;
the hidden and MLP sizes, which do not change the cache, are shrunk), against the alternatives:
for MLA the compressed latent ``generate()`` caches, for Gemma 4 one head size for every layer and no
KV sharing (what a cache sized from the config holds).

``python benchmarks/kv_layouts.py decode``: one DeepSeek-V2-Lite attention layer's decode step, per
token, at several context lengths, in the two layouts cbgen could keep: expanded per-head K/V
(read the cache, attend) or the latent (``kv_b_proj`` over the whole context at every step, as
``generate()`` does, then attend).  Medians of repeated runs, float32, this machine's threads.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers
from shaped_model import DEEPSEEK_V2_LITE_ATTENTION  # benchmarks/: this script's own folder

from cbgen.model.plan import cache_layout

# DeepSeek-V2-Lite's attention over its 27 layers.
DEEPSEEK_V2_LITE = dict(num_hidden_layers=27, **DEEPSEEK_V2_LITE_ATTENTION)
# Gemma-4-E2B's attention as assumed here: 35 layers, 8 query heads over 1 KV head, 256-wide sliding
# and 512-wide full layers (4 sliding : 1 full), the last 20 layers reading earlier layers' KV.
GEMMA4_E2B = dict(
    num_hidden_layers=35,
    num_attention_heads=8,
    num_key_value_heads=1,
    head_dim=256,
    global_head_dim=512,
    num_kv_shared_layers=20,
    layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7,
    sliding_window=512,
)


def _deepseek() -> torch.nn.Module:
    config = transformers.DeepseekV2Config(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=64,
        first_k_dense_replace=27,
        **DEEPSEEK_V2_LITE,
    )
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def _gemma() -> torch.nn.Module:
    config = transformers.Gemma4TextConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=64,
        vocab_size_per_layer_input=256,
        hidden_size_per_layer_input=16,
        **GEMMA4_E2B,
    )
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def bytes_table() -> None:
    """Bytes per token (bf16) in cbgen's layout and the alternatives."""
    print("| model (bf16 cache) | cbgen layout | bytes a token | alternative | bytes a token | ratio |")
    print("|---|---|---:|---|---:|---:|")
    d = DEEPSEEK_V2_LITE
    layout = cache_layout(_deepseek(), torch.bfloat16, 16)
    ours = sum(g.bytes_per_block() // g.block_size for g in layout.kv_groups)
    latent = d["num_hidden_layers"] * (d["kv_lora_rank"] + d["qk_rope_head_dim"]) * 2
    print(
        f"| DeepSeek-V2-Lite-shaped | expanded K 192 / V 128 x 16 heads | {ours} | latent 512 + 64 "
        f"(`generate()`'s) | {latent} | {ours / latent:.2f}x |"
    )
    g = GEMMA4_E2B
    layout = cache_layout(_gemma(), torch.bfloat16, 16)
    ours = sum(gr.bytes_per_block() // gr.block_size for gr in layout.kv_groups)
    owning = len(layout.kv_groups[0].layers)
    flat = g["num_hidden_layers"] * g["num_key_value_heads"] * 2 * g["global_head_dim"] * 2
    print(
        f"| Gemma-4-E2B-shaped | {owning} layers own KV, 256 / 512 per layer, {len(layout.shared)} read "
        f"another's | {ours} | every layer 512-wide, no sharing | {flat} | {flat / ours:.2f}x smaller |"
    )
    print()
    print(layout.describe())


def _median_ms(fn, repeats: int = 15) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def decode_table(lengths: list[int]) -> None:
    """Per-token decode cost of one DeepSeek-V2-Lite attention layer in the two layouts."""
    d = DEEPSEEK_V2_LITE
    heads, nope, rope, v_dim, rank = (
        d["num_attention_heads"],
        d["qk_nope_head_dim"],
        d["qk_rope_head_dim"],
        d["v_head_dim"],
        d["kv_lora_rank"],
    )
    torch.manual_seed(0)
    kv_b = torch.nn.Linear(rank, heads * (nope + v_dim), bias=False)
    q = torch.randn(1, heads, 1, nope + rope)
    print("| context | expanded K/V: attend (ms) | latent: expand + attend (ms) | latent / expanded |")
    print("|---:|---:|---:|---:|")
    with torch.inference_mode():
        for n in lengths:
            latent = torch.randn(1, n, rank)
            k_rot = torch.randn(1, 1, n, rope)
            kv = kv_b(latent).view(1, n, heads, nope + v_dim).transpose(1, 2)
            keys = torch.cat([kv[..., :nope], k_rot.expand(1, heads, n, rope)], -1).contiguous()
            values = kv[..., nope:].contiguous()

            def expanded(keys=keys, values=values):
                torch.nn.functional.scaled_dot_product_attention(q, keys, values)

            def from_latent(latent=latent, k_rot=k_rot):
                kv = kv_b(latent).view(1, -1, heads, nope + v_dim).transpose(1, 2)
                k = torch.cat([kv[..., :nope], k_rot.expand(1, heads, -1, rope)], -1)
                torch.nn.functional.scaled_dot_product_attention(q, k, kv[..., nope:])

            a, b = _median_ms(expanded), _median_ms(from_latent)
            print(f"| {n} | {a:.3f} | {b:.3f} | {b / a:.1f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["bytes", "decode"])
    parser.add_argument("--lengths", default="128,512,2048,8192")
    args = parser.parse_args()
    if args.what == "bytes":
        bytes_table()
    else:
        decode_table([int(x) for x in args.lengths.split(",")])


if __name__ == "__main__":
    main()
