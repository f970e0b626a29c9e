"""Correctness and speed check of the triton paged-KV kernels against the torch reference.

On a CUDA device this runs Qwen3-0.6B-like decode shapes (bf16, 16 query heads, 8 kv heads,
head_dim 128, block 16) over a grid of batch sizes and context lengths, and prints a markdown table
of relative error and median times (CUDA events) for both backends.  It also replays the triton
path inside a CUDA graph once, since the engine captures decode steps.

When flash-attn is installed (and suits the GPU and dtype), the ``flash_attn`` backend's decode
(:mod:`cbgen.model.kernels.flash.ops`) joins the table: the same K/V repacked into pages of
``--flash-block-size`` tokens (flash-attn 2 pages only in multiples of 256), compared with the same
reference output (``--flash-tolerance``), and replayed once inside a CUDA graph when the installed
version can be captured.  Without flash-attn (and always in ``--dry-run``) it is reported as skipped.

``--dry-run`` runs a few tiny shapes on CPU (through Triton's interpreter when triton is installed,
otherwise the reference alone) so the script itself can be smoke-tested without a GPU.

Exit status is 1 when any triton result is off by more than ``--tolerance`` (relative norm), or a
flash result by more than ``--flash-tolerance``.

Usage::

    python benchmarks/kernel_check.py                  # full grid on cuda:0
    python benchmarks/kernel_check.py --batches 1 64 --lens 1024 4096 --sliding-window 512
    python benchmarks/kernel_check.py --dry-run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny shapes on CPU; exits 0 unless a check fails"
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--lens", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096])
    parser.add_argument("--num-heads", type=int, default=16)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--sliding-window", type=int, default=None)
    parser.add_argument("--softcap", type=float, default=None)
    parser.add_argument("--repeats", type=int, default=20, help="timed repeats per measurement (median)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tolerance", type=float, default=2e-2, help="max relative-norm error vs reference")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--flash-block-size",
        type=int,
        default=256,
        help="page size for the flash_attn backend (multiple of 256)",
    )
    parser.add_argument(
        "--flash-tolerance",
        type=float,
        default=1e-2,
        help="max relative-norm error of flash_attn vs reference",
    )
    args = parser.parse_args(argv)
    if args.dry_run:
        args.batches, args.lens = [1, 3], [17, 40]
        args.num_heads, args.num_kv_heads, args.head_dim, args.block_size = 4, 2, 32, 8
        args.repeats, args.warmup = 2, 1
    return args


@dataclass
class Row:
    """One line of the result table."""

    batch: int
    ctx: int
    attn_ref_ms: float
    attn_triton_ms: float | None
    attn_rel_err: float | None
    store_ref_us: float
    store_triton_us: float | None
    store_exact: bool | None
    attn_flash_ms: float | None = None
    flash_rel_err: float | None = None


def _median_ms(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> float:
    """Median wall time of ``fn`` in milliseconds (CUDA events on GPU, perf_counter elsewhere)."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
    else:
        for _ in range(repeats):
            start_s = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start_s) * 1e3)
    return statistics.median(times)


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.float(), expected.float()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


def _repack(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    ctx: int,
    page: int,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first ``ctx`` tokens of every row (through ``table``) laid out again in pages of ``page``
    tokens, in one shuffled page order for K and V; returns ``(k pages, v pages, int32 block table)``."""
    from cbgen.model.kernels.reference import paged_ops

    batch = table.shape[0]
    pages = -(-ctx // page)
    order = torch.randperm(batch * pages, generator=gen).to(k_cache.device)
    out = []
    for cache in (k_cache, v_cache):
        rows = paged_ops.gather_kv(cache, table, ctx).transpose(1, 2)  # [B, ctx, Hkv, D]
        padded = rows.new_zeros(batch * pages, page, *rows.shape[2:])
        padded.view(batch, pages * page, *rows.shape[2:])[:, :ctx] = rows
        paged = torch.empty_like(padded)
        paged[order] = padded
        out.append(paged)
    return out[0], out[1], order.view(batch, pages).to(torch.int32)


def _run_shape(
    args: argparse.Namespace,
    batch: int,
    ctx: int,
    device: torch.device,
    use_triton: bool,
    use_flash: bool = False,
) -> Row:
    from cbgen.model.kernels.reference import paged_ops
    from cbgen.model.kernels.triton import ops as triton_ops

    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device="cpu").manual_seed(args.seed + batch * 7919 + ctx)
    blocks_per_row = -(-ctx // args.block_size)
    num_blocks = batch * blocks_per_row + 1
    shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    # Shuffled blocks so the kernel's block-table gather is not a disguised contiguous read.
    table = torch.randperm(num_blocks - 1, generator=gen)[: batch * blocks_per_row].view(
        batch, blocks_per_row
    )
    table = table.to(device=device, dtype=torch.int32)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    query = torch.randn(batch, args.num_heads, args.head_dim, generator=gen).to(device=device, dtype=dtype)
    scale = args.head_dim**-0.5
    attn_kwargs = {"sliding_window": args.sliding_window, "softcap": args.softcap, "max_seq_len": ctx}

    def ref_attn() -> torch.Tensor:
        return paged_ops.paged_decode_attention(
            query, k_cache, v_cache, table, seq_lens, scale, **attn_kwargs
        )

    def tri_attn() -> torch.Tensor:
        return triton_ops.triton_paged_decode_attention(
            query, k_cache, v_cache, table, seq_lens, scale, **attn_kwargs
        )

    # Decode-step store: one new token per row, written to the last slot of the row.
    new_k = torch.randn(batch, args.num_kv_heads, args.head_dim, generator=gen).to(device=device, dtype=dtype)
    new_v = torch.randn_like(new_k)
    last = (ctx - 1) // args.block_size
    slots = (table[:, last].long() * args.block_size + (ctx - 1) % args.block_size).contiguous()

    repeats, warmup = args.repeats, args.warmup
    expected = ref_attn()
    attn_ref_ms = _median_ms(ref_attn, device, repeats, warmup)
    store_ref_k, store_ref_v = k_cache.clone(), v_cache.clone()
    store_ref_us = 1e3 * _median_ms(
        lambda: paged_ops.store_kv(new_k, new_v, store_ref_k, store_ref_v, slots), device, repeats, warmup
    )
    row = Row(batch, ctx, attn_ref_ms, None, None, store_ref_us, None, None)
    if use_flash:
        from cbgen.model.kernels.flash import ops as flash_ops

        fk, fv, flash_table = _repack(k_cache, v_cache, table, ctx, args.flash_block_size, gen)

        def flash_attn() -> torch.Tensor:
            return flash_ops.paged_decode_attention(
                query, fk, fv, flash_table, seq_lens, scale, **attn_kwargs
            )

        row.flash_rel_err = _rel_err(flash_attn(), expected)
        row.attn_flash_ms = _median_ms(flash_attn, device, repeats, warmup)
        del fk, fv
    if not use_triton:
        return row

    actual = tri_attn()
    row.attn_rel_err = _rel_err(actual, expected)
    row.attn_triton_ms = _median_ms(tri_attn, device, repeats, warmup)
    store_tri_k, store_tri_v = k_cache.clone(), v_cache.clone()
    row.store_triton_us = 1e3 * _median_ms(
        lambda: triton_ops.triton_store_kv(new_k, new_v, store_tri_k, store_tri_v, slots),
        device,
        repeats,
        warmup,
    )
    row.store_exact = torch.equal(store_tri_k, store_ref_k) and torch.equal(store_tri_v, store_ref_v)
    return row


def _graph_check(args: argparse.Namespace, device: torch.device) -> float:
    """Captures store + decode attention in a CUDA graph, changes the inputs in place, replays,
    and returns the relative error against eager triton on the new inputs."""
    from cbgen.model.kernels.triton import ops as triton_ops

    dtype = getattr(torch, args.dtype)
    # Long enough that the split-K path (partials + merge) is part of the captured graph.
    batch, ctx, bs = 8, 1000, args.block_size
    blocks_per_row = -(-(ctx + 1) // bs)
    num_blocks = batch * blocks_per_row
    shape = (num_blocks, bs, args.num_kv_heads, args.head_dim)
    k_cache = torch.randn(shape, device=device, dtype=dtype)
    v_cache = torch.randn(shape, device=device, dtype=dtype)
    table = torch.randperm(num_blocks, device=device).view(batch, blocks_per_row).to(torch.int32)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    slots = torch.zeros(batch, dtype=torch.long, device=device)
    query = torch.randn(batch, args.num_heads, args.head_dim, device=device, dtype=dtype)
    new_kv = torch.randn(batch, args.num_kv_heads, args.head_dim, device=device, dtype=dtype)
    scale = args.head_dim**-0.5

    def step() -> torch.Tensor:
        triton_ops.triton_store_kv(new_kv, new_kv, k_cache, v_cache, slots)
        return triton_ops.triton_paged_decode_attention(
            query, k_cache, v_cache, table, seq_lens, scale, args.sliding_window, args.softcap
        )

    def set_lens(lens: torch.Tensor) -> None:
        seq_lens.copy_(lens)
        pos = (lens - 1).clamp_min(0).long()
        slots.copy_(table.gather(1, (pos // bs)[:, None])[:, 0].long() * bs + pos % bs)
        slots.masked_fill_(lens == 0, -1)

    set_lens(seq_lens)
    step()  # compile outside capture
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step()
    # Different lengths (one padding row) and a new query, written into the captured buffers.
    set_lens(torch.tensor([1, 17, 0, 500, 999, 1000, 64, 2], dtype=torch.int32, device=device))
    query.copy_(torch.randn_like(query))
    graph.replay()
    replayed = graph_out.clone()
    eager = step()
    torch.cuda.synchronize(device)
    return _rel_err(replayed, eager)


def _flash_graph_check(args: argparse.Namespace, device: torch.device) -> tuple[float, bool]:
    """The flash decode captured in a CUDA graph, replayed on new lengths (one padding row) and a new
    query; returns the relative error against eager flash and whether the padding row is all zeros."""
    from cbgen.model.kernels.flash import ops as flash_ops

    dtype = getattr(torch, args.dtype)
    batch, page = 8, args.flash_block_size
    blocks_per_row = -(-1000 // page)
    num_blocks = batch * blocks_per_row
    shape = (num_blocks, page, args.num_kv_heads, args.head_dim)
    k_cache = torch.randn(shape, device=device, dtype=dtype)
    v_cache = torch.randn(shape, device=device, dtype=dtype)
    table = torch.randperm(num_blocks, device=device).view(batch, blocks_per_row).to(torch.int32)
    seq_lens = torch.full((batch,), 1000, dtype=torch.int32, device=device)
    query = torch.randn(batch, args.num_heads, args.head_dim, device=device, dtype=dtype)
    scale = args.head_dim**-0.5

    def step() -> torch.Tensor:
        return flash_ops.paged_decode_attention(
            query, k_cache, v_cache, table, seq_lens, scale, args.sliding_window, args.softcap
        )

    step()  # warm-up outside capture
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step()
    seq_lens.copy_(torch.tensor([1, 17, 0, 500, 999, 1000, 256, 257], dtype=torch.int32, device=device))
    query.copy_(torch.randn_like(query))
    graph.replay()
    replayed = graph_out.clone()
    eager = step()
    torch.cuda.synchronize(device)
    live = seq_lens > 0
    zeros_ok = bool((replayed[~live] == 0).all()) and bool((eager[~live] == 0).all())
    return _rel_err(replayed[live], eager[live]), zeros_ok


def _flash_status(args: argparse.Namespace, device: torch.device) -> str | None:
    """None when the flash backend can be checked here, else why it is skipped."""
    if args.dry_run:
        return "dry run (flash-attn needs a CUDA GPU)"
    from cbgen.model.kernels.flash import ops as flash_ops

    return flash_ops.unavailable_reason(
        device, getattr(torch, args.dtype), args.flash_block_size, args.head_dim
    )


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _print_table(
    rows: list[Row], args: argparse.Namespace, device: torch.device, backend: str, flash: str = "skipped"
) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"\n### paged decode kernels: {name}, {args.dtype}, H={args.num_heads}, Hkv={args.num_kv_heads}, "
        f"D={args.head_dim}, block={args.block_size}, window={args.sliding_window}, softcap={args.softcap}, "
        f"triton backend: {backend}, flash_attn backend: {flash}\n"
    )
    print(
        "| batch | ctx | attn ref ms | attn triton ms | speedup | attn rel err "
        "| store ref us | store triton us | store exact | attn flash ms | flash rel err |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|:---:|---:|---:|")
    for r in rows:
        speedup = r.attn_ref_ms / r.attn_triton_ms if r.attn_triton_ms else None
        exact = "n/a" if r.store_exact is None else ("yes" if r.store_exact else "NO")
        print(
            f"| {r.batch} | {r.ctx} | {r.attn_ref_ms:.3f} | {_fmt(r.attn_triton_ms, '.3f')} "
            f"| {_fmt(speedup, '.2f')}{'x' if speedup else ''} | {_fmt(r.attn_rel_err, '.2e')} | {r.store_ref_us:.1f} "
            f"| {_fmt(r.store_triton_us, '.1f')} | {exact} | {_fmt(r.attn_flash_ms, '.3f')} "
            f"| {_fmt(r.flash_rel_err, '.2e')} |"
        )


def main(argv: list[str] | None = None) -> int:
    """Runs the check; returns the process exit status."""
    args = _parse_args(argv)
    if args.dry_run:
        device = torch.device("cpu")
        # The interpreter must be chosen before the kernels are jitted (first call).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        print("no CUDA device; use --dry-run for a CPU smoke test", file=sys.stderr)
        return 2

    from cbgen.model.kernels.triton import ops as triton_ops

    torch.manual_seed(args.seed)
    use_triton = triton_ops.available(device)
    backend = ("interpreter" if device.type != "cuda" else "compiled") if use_triton else "unavailable"
    if not use_triton:
        print("triton unavailable: timing the reference only", file=sys.stderr)
    flash_skip = _flash_status(args, device)
    use_flash = flash_skip is None
    if flash_skip is not None:
        print(f"flash_attn backend skipped: {flash_skip}", file=sys.stderr)

    rows = []
    failed = False
    for batch in args.batches:
        for ctx in args.lens:
            row = _run_shape(args, batch, ctx, device, use_triton, use_flash)
            rows.append(row)
            if row.attn_rel_err is not None and not row.attn_rel_err <= args.tolerance:
                failed = True
            if row.flash_rel_err is not None and not row.flash_rel_err <= args.flash_tolerance:
                failed = True
            if row.store_exact is False:
                failed = True
    flash_desc = "skipped"
    if use_flash:
        from cbgen.model.kernels.flash import ops as flash_ops

        flash_desc = f"flash-attn {flash_ops._FLASH.version}, block {args.flash_block_size}"
    _print_table(rows, args, device, backend, flash_desc)

    if use_triton and device.type == "cuda":
        graph_err = _graph_check(args, device)
        ok = graph_err <= args.tolerance
        failed |= not ok
        print(f"\nCUDA-graph replay vs eager rel err: {graph_err:.2e} ({'ok' if ok else 'FAIL'})")
    if use_flash:
        from cbgen.model.kernels.flash import ops as flash_ops

        if flash_ops.graph_capturable():
            flash_err, zeros_ok = _flash_graph_check(args, device)
            ok = flash_err <= args.flash_tolerance and zeros_ok
            failed |= not ok
            print(
                f"flash_attn CUDA-graph replay vs eager rel err: {flash_err:.2e}, padding row zeros: "
                f"{'yes' if zeros_ok else 'NO'} ({'ok' if ok else 'FAIL'})"
            )
        else:
            print(
                f"flash_attn CUDA-graph replay skipped: flash-attn {flash_ops._FLASH.version} syncs with the "
                "host in paged decode (>= 2.8.4), the engine runs it eagerly"
            )
    if failed:
        print(
            f"\nFAIL: a triton result exceeded tolerance {args.tolerance:g}, a flash_attn result "
            f"{args.flash_tolerance:g}, or a store differed",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
