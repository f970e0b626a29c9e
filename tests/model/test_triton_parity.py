"""Parity mode's Triton kernels (:mod:`cbgen.batch_invariant.kernels.triton_parity`) on CPU through Triton's
interpreter: close to float64 references, and each output row the same bits whatever shares its
call (the property parity mode rests on).

Under the interpreter ``tl.dot`` is a NumPy matmul, so these tests pin the kernels' structure (what
is reduced with what, in which blocks, which keys are read); the GPU's bits come from the same
structure on its own dot instructions.  ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` unless
``CBGEN_TEST_CUDA=1``; these tests then skip, since compiled kernels cannot take CPU tensors.
Shapes stay small: the interpreter runs every program in Python.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from cbgen.batch_invariant.kernels.triton_parity import (
    triton_parity_attention,
    triton_parity_available,
    triton_parity_linear,
)
from cbgen.model.kernels.triton import ops as triton_ops
from extras import require_extra

require_extra("triton")

pytestmark = pytest.mark.skipif(
    not triton_ops._interpreting(), reason="compiled Triton (CBGEN_TEST_CUDA=1) cannot take CPU tensors"
)

# Unit roundoff of each output dtype: a correctly rounded result is within this of the exact one.
_UNIT = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# Sizes off every tile edge (linear tiles 64 x 64, K steps of 32).
M, N, K = 70, 75, 100


def _linear_inputs(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(M, K, generator=gen).to(dtype), torch.randn(N, K, generator=gen).to(dtype)


def test_available_under_interpreter() -> None:
    assert triton_parity_available("cpu", torch.float32)
    assert triton_parity_available(torch.device("cpu"), torch.bfloat16)
    assert not triton_parity_available("cpu", torch.float64)


# ------------------------------------------------------------------------------------------------
# linear
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_close_to_float64(dtype: torch.dtype) -> None:
    """Within one rounding to the output dtype plus a float32 accumulation bound
    (K * 2^-24 * sum |x_k w_k| < 1e-5 * sum |x_k w_k|) of the float64 product of the same inputs;
    the weight is a strided view (the kernel takes any strides)."""
    x, w = _linear_inputs(dtype, seed=1)
    w_view = torch.full((N, 2 * K), math.nan, dtype=dtype)[:, ::2]  # column stride 2
    w_view.copy_(w)
    out = triton_parity_linear(x, w_view)
    assert out.dtype == dtype and out.shape == (M, N)
    exact = x.double() @ w.double().T
    bound = _UNIT[dtype] * exact.abs() + 1e-5 * (x.double().abs() @ w.double().abs().T)
    assert ((out.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_are_batch_invariant(dtype: torch.dtype) -> None:
    """Every row alone, a sub-batch, and a row among other rows (at another place in its tile, and in
    another tile) equal, bit for bit, that row of the whole call."""
    x, w = _linear_inputs(dtype, seed=2)
    full = triton_parity_linear(x, w)
    for i in range(M):
        assert torch.equal(triton_parity_linear(x[i : i + 1], w), full[i : i + 1]), i
    assert torch.equal(triton_parity_linear(x[7:50], w), full[7:50])
    others = torch.randn(130, K, generator=torch.Generator().manual_seed(3)).to(dtype)
    for place in (0, 37, 64, 129):
        mixed = others.clone()
        mixed[place] = x[5]
        assert torch.equal(triton_parity_linear(mixed, w)[place], full[5]), place


def test_linear_control_a_different_order_is_caught() -> None:
    """The bitwise checks above have teeth: the same sums taken over K in reverse order (the kernel
    on K-flipped inputs) agree to float32 accuracy but not bit for bit."""
    x, w = _linear_inputs(torch.float32, seed=4)
    forward = triton_parity_linear(x, w)
    backward = triton_parity_linear(x.flip(1), w.flip(1))
    torch.testing.assert_close(backward, forward, rtol=1e-5, atol=1e-4)
    assert not torch.equal(backward, forward)


def test_linear_rejects_bad_arguments_and_handles_empty() -> None:
    x, w = _linear_inputs(torch.float32, seed=5)
    with pytest.raises(ValueError, match=r"x \[M, K\] and weight \[N, K\]"):
        triton_parity_linear(x, w[:, :-1])
    with pytest.raises(ValueError, match=r"x \[M, K\]"):
        triton_parity_linear(x[0], w)
    with pytest.raises(ValueError, match="share float32, bfloat16 or float16"):
        triton_parity_linear(x, w.bfloat16())
    with pytest.raises(ValueError, match="share float32, bfloat16 or float16"):
        triton_parity_linear(x.double(), w.double())
    with pytest.raises(ValueError, match="is on meta"):
        triton_parity_linear(x, w.to("meta"))
    assert triton_parity_linear(x[:0], w).shape == (0, N)
    assert triton_parity_linear(x, w[:0]).shape == (M, 0)
    zeros = triton_parity_linear(x[:, :0], w[:, :0])
    assert zeros.shape == (M, N) and not zeros.any()


# ------------------------------------------------------------------------------------------------
# attention
# ------------------------------------------------------------------------------------------------

# Sequence lengths (the first spans three 64-position key blocks) and where each starts in its
# table row (seq_start).
LENGTHS = (150, 70, 9)
STARTS = (0, 5, 3)


def _keys(dtype: torch.dtype, kv_heads: int, dim: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence, its keys and values by position, ``[length, Hkv, D]``."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(n, kv_heads, dim, generator=gen).to(dtype),
            torch.randn(n, kv_heads, dim, generator=gen).to(dtype),
        )
        for n in LENGTHS
    ]


def _paged(
    seqs: list[tuple[torch.Tensor, torch.Tensor]],
    block_size: int,
    starts: tuple[int, ...],
    seed: int,
    spare: int = 3,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(k_cache, v_cache, block_table, seq_start)`` holding ``seqs`` in shuffled blocks of
    ``block_size``, sequence ``g``'s position ``j`` at index ``starts[g] + j`` of its table row.
    Everything else in the cache is NaN (a read of a hidden key would show) and unused table
    entries are -1 (the kernel must not need them)."""
    kv_heads, dim = seqs[0][0].shape[1:]
    widths = [-(-(start + k.shape[0]) // block_size) for start, (k, _) in zip(starts, seqs)]
    num_blocks = sum(widths) + spare
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    shape = (num_blocks, block_size, kv_heads, dim)
    k_cache = torch.full(shape, math.nan, dtype=seqs[0][0].dtype)
    v_cache = torch.full(shape, math.nan, dtype=seqs[0][0].dtype)
    table = torch.full((len(seqs), max(widths) + 1), -1, dtype=torch.int32)
    used = 0
    for g, ((k, v), start) in enumerate(zip(seqs, starts)):
        table[g, : widths[g]] = order[used : used + widths[g]]
        used += widths[g]
        index = start + torch.arange(k.shape[0])
        blocks = table[g, index // block_size].long()
        k_cache[blocks, index % block_size] = k
        v_cache[blocks, index % block_size] = v
    return k_cache, v_cache, table, torch.tensor(starts, dtype=torch.long)


def _contiguous(seqs: list[tuple[torch.Tensor, torch.Tensor]]):
    """The same keys the way the trainer side lays out a batch: one block per sequence, keys at
    their positions, seq_start 0."""
    size = max(k.shape[0] for k, _ in seqs)
    return _paged(seqs, size, (0,) * len(seqs), seed=0, spare=0)


def _rows(picks: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``row_seq``, ``row_pos`` from ``(sequence, position)`` pairs (position -1: padding)."""
    return torch.tensor([g for g, _ in picks], dtype=torch.long), torch.tensor(
        [p for _, p in picks], dtype=torch.long
    )


# Positions around the 64-key block edges and a window's start, with padding rows between.
PICKS = [
    (0, 0),
    (0, 1),
    (0, 63),
    (0, 64),
    (1, 0),
    (0, -1),
    (0, 100),
    (0, 128),
    (0, 149),
    (1, 30),
    (1, 69),
    (2, -1),
    (2, 0),
    (2, 8),
]


def _reference(q, seqs, row_seq, row_pos, scale, window, softcap) -> torch.Tensor:
    """Plain float64 causal softmax attention, query by query, over keys by position."""
    rows, heads, dim = q.shape
    out = torch.zeros(rows, heads, dim, dtype=torch.float64)
    for t in range(rows):
        p, g = int(row_pos[t]), int(row_seq[t])
        if p < 0:
            continue
        lo = max(p - window + 1, 0) if window else 0
        k, v = (x[lo : p + 1].double() for x in seqs[g])
        group = heads // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[t].double(), k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        out[t] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v)
    return out


@pytest.mark.parametrize(
    ("dtype", "heads", "kv_heads", "dim", "window", "softcap"),
    [
        (torch.float32, 4, 2, 16, None, None),
        (torch.float32, 4, 2, 16, 20, None),
        (torch.float32, 6, 2, 24, None, 5.0),
        (torch.float32, 2, 2, 16, 70, 30.0),
        (torch.bfloat16, 4, 1, 32, 20, 30.0),
        (torch.float16, 4, 2, 16, None, None),
    ],
)
def test_attention_close_to_float64(dtype, heads, kv_heads, dim, window, softcap) -> None:
    """Within one rounding to the output dtype plus 2e-5 (float32 accumulation; the soft cap's tanh
    through exp2) of float64 attention over the same inputs: GQA, windows that start inside a key
    block, soft caps, a head_dim that is not a power of two; padding rows give 0."""
    seqs = _keys(dtype, kv_heads, dim, seed=10)
    k_cache, v_cache, table, seq_start = _paged(seqs, 8, STARTS, seed=11)
    row_seq, row_pos = _rows(PICKS)
    q = torch.randn(len(PICKS), heads, dim, generator=torch.Generator().manual_seed(12)).to(dtype)
    out = triton_parity_attention(
        q, k_cache, v_cache, table, seq_start, row_seq, row_pos, 0.3, window, softcap
    )
    assert out.dtype == dtype and out.shape == q.shape
    want = _reference(q, seqs, row_seq, row_pos, 0.3, window, softcap)
    assert ((out.double() - want).abs() <= _UNIT[dtype] * want.abs() + 2e-5).all()
    assert not out[row_pos < 0].any()


@pytest.mark.parametrize(
    ("dtype", "window", "softcap"), [(torch.float32, 20, 5.0), (torch.bfloat16, None, None)]
)
def test_attention_does_not_depend_on_the_cache_layout(dtype, window, softcap) -> None:
    """The same keys in shuffled blocks of 8 behind seq_start offsets, in blocks of 16, and one block
    per sequence (the trainer's layout) give the same bits."""
    seqs = _keys(dtype, 2, 16, seed=20)
    row_seq, row_pos = _rows(PICKS)
    q = torch.randn(len(PICKS), 4, 16, generator=torch.Generator().manual_seed(21)).to(dtype)
    layouts = [_paged(seqs, 8, STARTS, seed=22), _paged(seqs, 16, (0, 0, 0), seed=23), _contiguous(seqs)]
    outs = [
        triton_parity_attention(q, *layout, row_seq, row_pos, 0.25, window, softcap) for layout in layouts
    ]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_attention_row_does_not_depend_on_the_other_rows() -> None:
    """A row's output is the same bits alone, among other rows in another order, as a decode row (one
    per sequence) and as a prefill row (a run of positions of one sequence across a block edge)."""
    seqs = _keys(torch.float32, 2, 16, seed=30)
    paged = _paged(seqs, 8, STARTS, seed=31)

    def attend(picks: list[tuple[int, int]]) -> dict[tuple[int, int], torch.Tensor]:
        row_seq, row_pos = _rows(picks)
        # Each (sequence, position) has its own query vector, whatever call it is in.
        q = torch.stack(
            [torch.randn(4, 16, generator=torch.Generator().manual_seed(1000 * g + p)) for g, p in picks]
        )
        out = triton_parity_attention(q, *paged, row_seq, row_pos, 0.25, 70, 30.0)
        return dict(zip(picks, out))

    def same(outs: dict[tuple[int, int], torch.Tensor], want: dict[tuple[int, int], torch.Tensor]) -> bool:
        return all(torch.equal(out, want[pick]) for pick, out in outs.items())

    every = attend(PICKS)
    assert all(same(attend([pick]), every) for pick in PICKS)
    assert same(attend(PICKS[::-1]), every)
    decode = [(0, 149), (1, 69), (2, 8)]
    assert same(attend(decode), every)
    chunk = [(0, p) for p in range(58, 68)]
    prefill = attend(chunk)
    assert same(prefill, every | {pick: attend([pick])[pick] for pick in chunk})


def test_attention_padding_and_empty() -> None:
    seqs = _keys(torch.float32, 2, 16, seed=40)
    paged = _paged(seqs, 8, STARTS, seed=41)
    q = torch.randn(3, 4, 16)
    out = triton_parity_attention(q, *paged, torch.tensor([0, 2, 1]), torch.full((3,), -1), 0.25)
    assert out.shape == (3, 4, 16) and not out.any()
    empty = triton_parity_attention(
        q[:0], *paged, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), 0.25
    )
    assert empty.shape == (0, 4, 16)


@pytest.mark.native("c")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_matches_the_cpu_parity_kernel(dtype: torch.dtype) -> None:
    """Same contract as the C parity attention (seq_start offsets, window, soft cap, GQA): the two
    agree to float32 accuracy (they are different devices' kernels, not the same bits)."""
    from cbgen.batch_invariant.kernels.cpu_parity import parity_attention

    seqs = _keys(dtype, 2, 16, seed=50)
    paged = _paged(seqs, 8, STARTS, seed=51)
    row_seq, row_pos = _rows(PICKS)
    q = torch.randn(len(PICKS), 4, 16, generator=torch.Generator().manual_seed(52)).to(dtype)
    args = (q, *paged, row_seq, row_pos, 0.25, 20, 30.0)
    ours, theirs = triton_parity_attention(*args), parity_attention(*args)
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=_UNIT[dtype], atol=1e-5)


def test_attention_reads_only_the_blocks_it_needs() -> None:
    """Table entries no row reads (before every row's window, past every row's position) may be
    anything, as in the C kernel: accepted, and the results unchanged."""
    seqs = _keys(torch.float32, 2, 16, seed=60)
    k_cache, v_cache, table, seq_start = _paged(seqs, 8, (0, 0, 0), seed=61)
    row_seq, row_pos = _rows([(0, 149), (0, 140)])
    q = torch.randn(2, 4, 16)
    want = triton_parity_attention(q, k_cache, v_cache, table, seq_start, row_seq, row_pos, 0.25, 20)
    holed = table.clone()
    holed[0, :14] = 10_000  # positions 0..111, before both windows (they start at 121 and 130)
    holed[1:] = -5  # sequences no row belongs to
    got = triton_parity_attention(q, k_cache, v_cache, holed, seq_start, row_seq, row_pos, 0.25, 20)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="block id"):
        triton_parity_attention(q, k_cache, v_cache, holed, seq_start, row_seq, row_pos, 0.25, 40)


def test_attention_rejects_bad_arguments() -> None:
    seqs = _keys(torch.float32, 2, 16, seed=70)
    k_cache, v_cache, table, seq_start = _paged(seqs, 8, STARTS, seed=71)
    row_seq, row_pos = _rows([(0, 10), (1, 5)])
    q = torch.randn(2, 4, 16)
    good = dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=table,
        seq_start=seq_start,
        row_seq=row_seq,
        row_pos=row_pos,
        scale=0.25,
    )
    assert triton_parity_attention(**good).shape == (2, 4, 16)
    bad_block = table.clone()
    bad_block[1, 0] = k_cache.shape[0]
    cases = {
        "q [T, H, D]": dict(q=q[0]),
        "caches": dict(v_cache=v_cache[:, :4]),
        "head_dim": dict(q=torch.randn(2, 4, 8)),
        "share float32": dict(q=q.bfloat16()),
        "H a multiple of Hkv": dict(q=torch.randn(2, 3, 16)),
        "block_table must be a": dict(block_table=table.long()),
        "seq_start must be a": dict(seq_start=seq_start[:2]),
        "row_seq must be a": dict(row_seq=row_seq.int()),
        "row_pos must be a": dict(row_pos=row_pos[:1]),
        "is on meta": dict(row_pos=row_pos.to("meta")),
        "sliding_window": dict(sliding_window=-1),
        "row_seq outside [0, 3)": dict(row_seq=torch.tensor([0, 3])),
        "row_pos below -1": dict(row_pos=torch.tensor([-2, 5])),
        "key position outside": dict(row_pos=torch.tensor([10, table.shape[1] * 8 - 5])),
        "block id": dict(block_table=bad_block),
    }
    for message, change in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            triton_parity_attention(**{**good, **change})
