"""The engine side of parity attention.

Where :func:`cbgen.batch_invariant.native.parity_form` says so, every row of a step goes through a
parity attention kernel (C on the CPU, Triton on CUDA) straight from the paged cache (one call for all prefill chunks, one for the decode
rows).  Elsewhere each sequence's keys and values are gathered from the cache by position and the
blocked core (:mod:`cbgen.batch_invariant.attention_core`) runs on them; prefill chunks differ in length; one call padded to the longest would compute up to several times
the work, and one call per chunk pays a fixed cost per chunk.  Chunks of similar size share a call
(:func:`chunk_groups`); the core's result for a query does not depend on what shares its call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cbgen.batch_invariant.attention_core import blocked_attention
from cbgen.batch_invariant.kernels.cpu_parity import parity_attention
from cbgen.batch_invariant.kernels.triton_parity import triton_parity_attention
from cbgen.batch_invariant.native import parity_form

# A group of chunks may cost at most this much more than its chunks alone (padded rows and keys).
_PADDING_SLACK = 1.5


def _kernel(q: torch.Tensor, cache: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """The parity attention kernel for these tensors, or None for the torch form."""
    if cache.dtype != q.dtype:
        return None
    form = parity_form(q.device, q.dtype)
    return {"c": parity_attention, "triton": triton_parity_attention}.get(form)


def _cached(derived: dict | None, key: str, make: Callable[[], tuple]) -> tuple:
    if derived is None:
        return make()
    if key not in derived:
        derived[key] = make()
    return derived[key]


def _chunk_plan(chunks: list[tuple[int, int, int]], block_table: torch.Tensor, dev: torch.device) -> tuple:
    """One kernel call for every chunk: row t of the call is chunk ``row_seq[t]``'s query at
    ``row_pos[t]``, read from packed row ``rows[t]``."""
    rows = torch.cat([torch.arange(start, start + n) for start, n, _ in chunks])
    row_seq = torch.cat([torch.full((n,), i, dtype=torch.long) for i, (_, n, _) in enumerate(chunks)])
    row_pos = torch.cat([torch.arange(ctx, ctx + n) for _, n, ctx in chunks])
    zeros = torch.zeros(block_table.shape[0], dtype=torch.long)
    return tuple(t.to(dev) for t in (rows, block_table.to(torch.int32), zeros, row_seq, row_pos))


def by_position(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Each row's first ``length`` cached tokens, ``[B, length, Hkv, D]``, index = position."""
    num_rows, width = block_table.shape
    blocks = cache[block_table.long()]
    return blocks.view(num_rows, width * cache.shape[1], cache.shape[2], cache.shape[3])[:, :length]


def chunk_groups(sizes: list[tuple[int, int]]) -> list[list[int]]:
    """Indices of chunks ``(q_len, key_len)`` in groups whose padded cost stays within
    :data:`_PADDING_SLACK` of their own, by increasing key length."""
    order = sorted(range(len(sizes)), key=lambda i: (sizes[i][1], sizes[i][0]))
    groups: list[list[int]] = []
    work = 0
    for i in order:
        group = groups[-1] if groups else None
        if group is not None:
            q_max = max(sizes[j][0] for j in [*group, i])
            padded = (len(group) + 1) * q_max * sizes[i][1]
            if padded <= _PADDING_SLACK * (work + sizes[i][0] * sizes[i][1]):
                group.append(i)
                work += sizes[i][0] * sizes[i][1]
                continue
        groups.append([i])
        work = sizes[i][0] * sizes[i][1]
    return groups


def attend_chunks(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunks: list[tuple[int, int, int]],
    block_table: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    out: torch.Tensor,
    derived: dict | None = None,
) -> None:
    """Prefill chunks ``(q_start, q_len, ctx_len)`` of the packed queries ``q [T, H, D]``, row ``i`` of
    ``block_table`` for chunk ``i``, attended into ``out [T, H, D]``.  ``derived``: the step's
    per-step cache (``AttentionMetadata.derived``), so every layer reuses the kernel's index tensors."""
    kernel = _kernel(q, k_cache)
    if kernel is not None:
        plan = _cached(derived, "parity_prefill", lambda: _chunk_plan(chunks, block_table, q.device))
        rows, table, zeros, row_seq, row_pos = plan
        out[rows] = kernel(
            q[rows], k_cache, v_cache, table, zeros, row_seq, row_pos, scale, sliding_window, softcap
        )
        return
    for group in chunk_groups([(n, ctx + n) for _, n, ctx in chunks]):
        longest = max(chunks[i][1] for i in group)
        length = max(chunks[i][1] + chunks[i][2] for i in group)
        rows = torch.full((len(group), longest), -1, dtype=torch.long)
        pos = torch.full((len(group), longest), -1, dtype=torch.long)
        for g, i in enumerate(group):
            start, n, ctx = chunks[i]
            rows[g, :n] = torch.arange(start, start + n)
            pos[g, :n] = torch.arange(ctx, ctx + n)
        rows, pos = rows.to(q.device), pos.to(q.device)
        table = block_table[torch.tensor(group, device=block_table.device)]
        keys, values = by_position(k_cache, table, length), by_position(v_cache, table, length)
        # Padding rows repeat row 0 at position -1: their output is 0 and dropped.
        res = blocked_attention(q[rows.clamp(min=0)], keys, values, pos, scale, sliding_window, softcap)
        real = rows >= 0
        out[rows[real]] = res[real]


def attend_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    derived: dict | None = None,
) -> torch.Tensor:
    """Decode rows ``q [B, H, D]``, row ``b`` at position ``seq_lens[b] - 1`` (a padding row of a
    fixed-shape step has length 0: output 0), over its first ``seq_lens[b]`` cached tokens.
    ``derived``: as for :func:`attend_chunks`."""
    kernel = _kernel(q, k_cache)
    if kernel is not None:
        dev = q.device

        def plan() -> tuple:
            zeros = torch.zeros(block_table.shape[0], dtype=torch.long, device=dev)
            rows = torch.arange(q.shape[0], device=dev)
            return block_table.to(torch.int32), zeros, rows, seq_lens.to(torch.long) - 1

        table, zeros, rows, pos = _cached(derived, "parity_decode", plan)
        return kernel(q, k_cache, v_cache, table, zeros, rows, pos, scale, sliding_window, softcap)
    q_pos = (seq_lens.to(torch.long) - 1)[:, None]
    keys, values = by_position(k_cache, block_table, max_len), by_position(v_cache, block_table, max_len)
    return blocked_attention(q[:, None], keys, values, q_pos, scale, sliding_window, softcap)[:, 0]
