"""Varlen prefill on the CPU: attention-only step time, old against new.

Every layer of SmolLM2-135M's geometry (30 layers, 9 heads, 3 kv heads, head_dim 64, 16-token
blocks, one KV cache per layer), for a step that is

  (a) 256 prompts of 16-48 tokens (seeded), no context, and
  (b) one 2,048-token chunk after 4,096 tokens of context,

in float32 and bfloat16.  A step's time is the KV store plus the attention of all 30 layers, as the
transformers path runs them (``[1, H, T, D]`` views of token-major projections).  Variants:

  old        the code before varlen prefill, copied below: chunks of <= 64 tokens as decode-kernel
             rows (``index_select`` in, custom op, ``index_put`` out), longer ones one SDPA call each
             (after context: two flash calls merged by LSE, GQA keys copied per query head)
  new        ``CpuBackend`` as shipped, through ``paged_attention_forward``
  loop       one SDPA call per chunk for every chunk (the torch reference's and CUDA's path before;
             in (b), with one chunk, the same as new)
  padded     one SDPA call for all chunks, padded to the longest (below)
  blockdiag  one SDPA call over the packed chunks with a block-diagonal causal mask ((a) only)
  rows       the C decode kernel for every chunk, one row per query token ((b) only; (a) is ``new``)

``blockdiag`` and ``rows`` are quadratic where the others are not: they are timed on a few layers
and scaled to 30 (marked ``*``).  Variants take turns within each repeat; medians are reported.

    python benchmarks/prefill_varlen.py [--repeats 3] [--dtypes float32 bfloat16] [--cases a b]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import torch

from cbgen import SamplingParams
from cbgen.model.attention import AttentionMetadata, paged_attention_forward
from cbgen.model.backends import CpuBackend
from cbgen.model.input_batch import InputBuilder, ModelInput
from cbgen.model.kernels.cpu import ops as cpu_kernels
from cbgen.model.kernels.reference import paged_ops, varlen
from cbgen.request import Request

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
SCALE = HEAD_DIM**-0.5


def build_step(chunks: list[tuple[int, int]], row_prefill_max: int) -> ModelInput:
    """The input builder's step for prefill ``chunks`` (query tokens, context tokens)."""
    scheduled, next_block = [], 0
    for i, (q_len, ctx) in enumerate(chunks):
        r = Request(f"r{i}", [1] * (ctx + q_len), SamplingParams(max_tokens=1))
        r.num_computed_tokens = ctx
        used = -(-(ctx + q_len) // BLOCK)
        r.block_ids = list(range(next_block, next_block + used))
        next_block += used
        scheduled.append((r, q_len))
    builder = InputBuilder(BLOCK, torch.device("cpu"), row_prefill_max=row_prefill_max, num_blocks=next_block)
    return builder.build(scheduled, kv_caches=[])


# ---------------------------------------------------------------------------------- the old code


def _old_after_context(query, key, value, ctx_len):
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    past, past_lse = op(query, key[:, :, :ctx_len], value[:, :, :ctx_len], 0.0, False, scale=SCALE)
    own, own_lse = op(query, key[:, :, ctx_len:], value[:, :, ctx_len:], 0.0, True, scale=SCALE)
    top = torch.maximum(past_lse, own_lse)
    w_past, w_own = (past_lse - top).exp(), (own_lse - top).exp()
    merged = (past.float() * w_past[..., None] + own.float() * w_own[..., None]) / (w_past + w_own)[..., None]
    return merged.to(query.dtype)


def old_attention(meta: AttentionMetadata, layer: int, query, key, value) -> torch.Tensor:
    """The attention function and CPU backend before varlen prefill (no window, no soft-cap)."""
    k_cache, v_cache = meta.kv_caches[layer]
    q = query[0].transpose(0, 1)
    cpu_kernels.store_kv(
        key[0].transpose(0, 1), value[0].transpose(0, 1), k_cache, v_cache, meta.slot_mapping
    )
    out = torch.empty_like(q)
    if meta.row_prefill_tokens:
        idx = meta.old_row_idx
        out[idx] = cpu_kernels.paged_decode_attention(
            q.index_select(0, idx),
            k_cache,
            v_cache,
            meta.row_prefill_table,
            meta.row_prefill_lens,
            SCALE,
            max_seq_len=meta.row_prefill_max_len,
        )
    for i, seq in enumerate(meta.prefills):
        if seq.as_rows:
            continue
        end = seq.q_start + seq.q_len
        qs = query[:, :, seq.q_start : end]
        if seq.ctx_len == 0:
            res = paged_ops.attend(
                qs, key[:, :, seq.q_start : end], value[:, :, seq.q_start : end], None, SCALE, is_causal=True
            )
        else:
            table = meta.varlen.block_table[i : i + 1]
            ks = paged_ops.gather_kv(k_cache, table, seq.ctx_len + seq.q_len)
            vs = paged_ops.gather_kv(v_cache, table, seq.ctx_len + seq.q_len)
            res = _old_after_context(qs, ks, vs, seq.ctx_len)
        out[seq.q_start : end] = res[0].transpose(0, 1)
    return out


# ------------------------------------------------------------------------------ the other variants


def attend_padded(seqs, q, k, v, k_cache, v_cache, block_table, scale, window, softcap, out, derived) -> None:
    """One SDPA call for every chunk, padded to the longest (no window or soft-cap here): without
    context a plain causal call, the padding after each chunk's last query; after context the keys
    gathered from the cache under an offset-causal mask.  Index and mask tensors are built once per
    step (``derived``)."""
    lo, hi = seqs[0].q_start, seqs[-1].q_start + seqs[-1].q_len
    n, max_q = len(seqs), max(s.q_len for s in seqs)
    heads, dim, kv_heads = q.shape[1], q.shape[2], k.shape[1]
    if "padded_rows" not in derived:
        derived["padded_rows"] = torch.cat(
            [torch.arange(i * max_q, i * max_q + s.q_len) for i, s in enumerate(seqs)]
        )
    dest = derived["padded_rows"]
    q_pad = q.new_zeros(n * max_q, heads, dim).index_copy_(0, dest, q[lo:hi]).view(n, max_q, heads, dim)
    if all(s.ctx_len == 0 for s in seqs):
        k_pad = (
            k.new_zeros(n * max_q, kv_heads, dim).index_copy_(0, dest, k[lo:hi]).view(n, max_q, kv_heads, dim)
        )
        v_pad = (
            v.new_zeros(n * max_q, kv_heads, dim).index_copy_(0, dest, v[lo:hi]).view(n, max_q, kv_heads, dim)
        )
        res = paged_ops.attend(
            q_pad.transpose(1, 2), k_pad.transpose(1, 2), v_pad.transpose(1, 2), None, scale, is_causal=True
        )
    else:
        if "padded_mask" not in derived:
            max_k = max(s.ctx_len + s.q_len for s in seqs)
            ctx = torch.tensor([s.ctx_len for s in seqs])[:, None, None]
            lens = torch.tensor([s.ctx_len + s.q_len for s in seqs])[:, None, None]
            q_pos = ctx + torch.arange(max_q)[None, :, None]
            k_pos = torch.arange(max_k)[None, None, :]
            live = k_pos < lens
            derived["padded_mask"] = ((k_pos <= q_pos) & live)[:, None], live.transpose(1, 2)[:, None]
        mask, live = derived["padded_mask"]
        # Keys past a chunk's length (table padding, unwritten slots) zeroed, as any NaN there must be.
        keys = paged_ops.gather_kv(k_cache, block_table, mask.shape[-1]).masked_fill(~live, 0.0)
        values = paged_ops.gather_kv(v_cache, block_table, mask.shape[-1]).masked_fill(~live, 0.0)
        res = paged_ops.attend(q_pad.transpose(1, 2), keys, values, mask, scale)
    out[lo:hi] = res.transpose(1, 2).reshape(n * max_q, heads, dim).index_select(0, dest)


def _new(meta, layer, query, key, value):
    return paged_attention_forward(
        SimpleNamespace(layer_idx=layer), query, key, value, None, scaling=SCALE, cbgen_meta=meta
    )[0]


def _strategy(fn: Callable[..., None]) -> Callable[..., torch.Tensor]:
    def run(meta, layer, query, key, value):
        k_cache, v_cache = meta.kv_caches[layer]
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        cpu_kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype)
        args = (meta.prefills, q, k, v, k_cache, v_cache, meta.varlen.block_table, SCALE, None, None, out)
        if fn is attend_padded:
            fn(*args, meta.derived)
        else:
            fn(*args)
        return out

    return run


def _blockdiag(meta, layer, query, key, value):
    k_cache, v_cache = meta.kv_caches[layer]
    cpu_kernels.store_kv(
        key[0].transpose(0, 1), value[0].transpose(0, 1), k_cache, v_cache, meta.slot_mapping
    )
    mask = meta.derived.get("blockdiag")
    if mask is None:
        seq_id = torch.repeat_interleave(
            torch.arange(len(meta.prefills)), torch.tensor([s.q_len for s in meta.prefills])
        )
        pos = torch.arange(seq_id.numel())
        mask = meta.derived["blockdiag"] = (seq_id[:, None] == seq_id[None, :]) & (
            pos[None, :] <= pos[:, None]
        )
    res = paged_ops.attend(query, key, value, mask, SCALE)
    return res[0].transpose(0, 1)


def _rows(meta, layer, query, key, value):
    return _new(meta, layer, query, key, value)  # on a step built with every chunk as rows


# ------------------------------------------------------------------------------------------ timing


def _case(name: str, dtype: torch.dtype) -> dict:
    """The step(s), caches and inputs of one case; variants -> (function, meta, layers timed)."""
    if name == "a":
        rng = np.random.default_rng(0)
        chunks = [(int(n), 0) for n in rng.integers(16, 49, size=256)]
    else:
        chunks = [(2048, 4096)]
    gen = torch.Generator().manual_seed(1)
    batch = build_step(chunks, CpuBackend.row_prefill_max)
    num_blocks = int(batch.meta.varlen.block_table.max()) + 1
    caches = [
        tuple(torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
        for _ in range(LAYERS)
    ]
    tokens = batch.num_tokens
    query = torch.randn(1, tokens, HEADS, HEAD_DIM, generator=gen).to(dtype).transpose(1, 2)
    key, value = (
        torch.randn(1, tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype).transpose(1, 2) for _ in range(2)
    )

    def meta_of(b: ModelInput) -> AttentionMetadata:
        m = b.meta
        m.kv_caches, m.backend = caches, CpuBackend()
        m.old_row_idx = torch.arange(m.num_decode, m.num_decode + m.row_prefill_tokens)
        return m

    meta = meta_of(batch)
    variants = {"old": (old_attention, meta, LAYERS), "new": (_new, meta, LAYERS)}
    if name == "a":
        variants["loop"] = (_strategy(varlen.attend_loop), meta, LAYERS)
        variants["padded"] = (_strategy(attend_padded), meta, LAYERS)
        variants["blockdiag"] = (_blockdiag, meta, 1)
    else:  # one chunk: "loop" is what "new" runs
        variants["padded"] = (_strategy(attend_padded), meta, 2)  # one chunk: the masked call
        variants["rows"] = (_rows, meta_of(build_step(chunks, 1 << 30)), 1)
    return {"variants": variants, "inputs": (query, key, value), "chunks": chunks}


def _time(fn, meta, layers: int, inputs) -> float:
    start = time.perf_counter()
    for layer in range(layers):
        fn(meta, layer, *inputs)
    return (time.perf_counter() - start) * LAYERS / layers


def run_case(name: str, dtype: torch.dtype, repeats: int) -> None:
    case = _case(name, dtype)
    variants, inputs = case["variants"], case["inputs"]
    chunks = case["chunks"]
    # One layer each first: warms every path, and checks each variant against the new code.
    ref = variants["new"][0](variants["new"][1], 0, *inputs).float()
    for label, (fn, meta, _) in variants.items():
        err = (fn(meta, 0, *inputs).float() - ref).abs().max().item()
        if err > (1e-3 if dtype == torch.float32 else 5e-2):
            raise AssertionError(f"{label} differs from new by {err}")
    times: dict[str, list[float]] = {label: [] for label in variants}
    order = list(variants)
    for rep in range(repeats):
        turn = order[rep % len(order) :] + order[: rep % len(order)]
        for label in turn:
            fn, meta, layers = variants[label]
            if layers < LAYERS and rep:  # scaled variants: one measurement is enough
                continue
            times[label].append(_time(fn, meta, layers, inputs))
    desc = (
        f"{len(chunks)} prompts of {min(q for q, _ in chunks)}-{max(q for q, _ in chunks)} tokens"
        if name == "a"
        else f"{chunks[0][0]}-token chunk after {chunks[0][1]} of context"
    )
    print(f"\n({name}) {desc}, {str(dtype).removeprefix('torch.')}, {LAYERS} layers:")
    old = statistics.median(times["old"])
    for label, values in times.items():
        med = statistics.median(values)
        scaled = "*" if variants[label][2] < LAYERS else " "
        print(
            f"  {label:<10}{scaled} {med * 1e3:9.1f} ms/step  (min {min(values) * 1e3:9.1f}, n={len(values)})"
            f"  {old / med:5.2f}x old"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--cases", nargs="+", default=["a", "b"], choices=["a", "b"])
    args = parser.parse_args()
    if not cpu_kernels.available():
        raise SystemExit(f"the C kernels are unavailable: {cpu_kernels.unavailable_reason()}")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; * = timed on fewer layers, scaled to {LAYERS}"
    )
    start = time.perf_counter()
    with torch.inference_mode():
        for dtype_name in args.dtypes:
            for name in args.cases:
                run_case(name, getattr(torch, dtype_name), args.repeats)
    print(f"\n{time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
