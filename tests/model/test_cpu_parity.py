"""Parity mode's CPU kernels (``csrc/cpu_parity.c`` attention, the panel GEMM as parity matmul):
close to a float64 reference, every output independent of what shares the call (rows, batch size,
paged layout, decode vs prefill), argument and index checks before memory is touched.  Also run
under AddressSanitizer (``make test-asan``)."""

from __future__ import annotations

import pytest
import torch

from cbgen.batch_invariant.kernels import cpu_parity
from cbgen.batch_invariant.kernels.cpu_parity import parity_attention, parity_linear, parity_pack

pytestmark = pytest.mark.native("avx2")

DTYPES = [torch.float32, torch.bfloat16]
IDS = ["fp32", "bf16"]


def _reference(q, k, v, pos, scale, window=None, softcap=None):
    """Per-query float64 attention over contiguous keys ``[S, Hkv, D]`` at positions 0..p."""
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for t, p in enumerate(pos.tolist()):
        if p < 0:
            continue
        lo = max(0, p - window + 1) if window else 0
        for h in range(heads):
            kh = k[lo : p + 1, h // (heads // kv_heads)].double()
            s = kh @ q[t, h].double() * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            w = torch.softmax(s, 0)
            out[t, h] = w @ v[lo : p + 1, h // (heads // kv_heads)].double()
    return out


def _paged(k: torch.Tensor, v: torch.Tensor, block_size: int, seed: int):
    """Contiguous ``[S, Hkv, D]`` keys/values in shuffled cache blocks (+1 spare NaN block)."""
    length = k.shape[0]
    blocks = -(-length // block_size)
    perm = torch.randperm(blocks + 1, generator=torch.Generator().manual_seed(seed))
    kc = torch.full((blocks + 1, block_size, *k.shape[1:]), float("nan"), dtype=k.dtype)
    vc = kc.clone()
    table = torch.zeros(1, blocks, dtype=torch.int32)
    for b in range(blocks):
        n = min(block_size, length - b * block_size)
        table[0, b] = int(perm[b])
        kc[perm[b], :n] = k[b * block_size : b * block_size + n]
        vc[perm[b], :n] = v[b * block_size : b * block_size + n]
    return kc, vc, table


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "window", "softcap"),
    [(4, 4, 16, None, None), (6, 2, 24, 7, None), (3, 1, 64, None, 30.0), (2, 2, 13, 70, 5.0)],
)
def test_attention_matches_reference_and_ignores_layout_and_company(
    heads, kv_heads, dim, window, softcap, dtype
) -> None:
    torch.manual_seed(heads * dim)
    length = 75
    q = torch.randn(length, heads, dim).to(dtype)
    k = torch.randn(length, kv_heads, dim).to(dtype)
    v = torch.randn(length, kv_heads, dim).to(dtype)
    pos = torch.arange(length)
    scale = dim**-0.5
    one = torch.zeros(1, dtype=torch.long)
    # Prefill-like: every row in one call, keys in one contiguous block.
    full = parity_attention(
        q,
        k[None],
        v[None],
        torch.zeros(1, 1, dtype=torch.int32),
        one,
        torch.zeros(length, dtype=torch.long),
        pos,
        scale,
        window,
        softcap,
    )
    ref = _reference(q, k, v, pos, scale, window, softcap)
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    assert (full.double() - ref).abs().max() < tol
    # Paged in shuffled blocks, rows one at a time (decode-like) and in a reversed sub-batch.
    for block_size in (8, 16):
        kc, vc, table = _paged(k, v, block_size, seed=block_size)
        for t in (0, 7, 8, 40, 74):
            alone = parity_attention(
                q[t : t + 1], kc, vc, table, one, one, pos[t : t + 1], scale, window, softcap
            )
            assert torch.equal(alone[0], full[t])
        sub = torch.tensor([74, 3, 50, 17])
        got = parity_attention(
            q[sub], kc, vc, table, one, torch.zeros(4, dtype=torch.long), pos[sub], scale, window, softcap
        )
        assert torch.equal(got, full[sub])


def test_attention_seq_start_offsets_and_padding_rows() -> None:
    """A row's keys may start at an offset of its blocks (left padding on the trainer's side); padding
    rows (position -1) give 0."""
    torch.manual_seed(1)
    q = torch.randn(5, 2, 8)
    k, v = torch.randn(2, 12, 2, 8), torch.randn(2, 12, 2, 8)
    table = torch.tensor([[0], [1]], dtype=torch.int32)
    k[1, 3:], v[1, 3:] = k[0, :9], v[0, :9]  # sequence 1 = sequence 0 shifted right by 3
    pos = torch.tensor([0, 4, 8, -1, 4])
    seq = torch.tensor([0, 0, 0, 1, 1])
    out = parity_attention(q[[0, 1, 2, 3, 1]], k, v, table, torch.tensor([0, 3]), seq, pos, 0.3)
    assert torch.equal(out[4], out[1])
    assert not out[3].any()


def test_attention_refuses_bad_indices_before_reading() -> None:
    q = torch.randn(1, 2, 8)
    k = torch.randn(3, 4, 2, 8)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    z = torch.zeros(1, dtype=torch.long)
    five = torch.tensor([5])

    def call(table=table, start=z, seq=z, pos=five):
        return parity_attention(q, k, k.clone(), table, start, seq, pos, 0.5)

    call()
    with pytest.raises(ValueError, match="out of range"):
        call(pos=torch.tensor([8]))  # past the table's two blocks
    with pytest.raises(ValueError, match="out of range"):
        call(table=torch.tensor([[0, 3]], dtype=torch.int32))  # block 3 of 3
    with pytest.raises(ValueError, match="out of range"):
        call(seq=torch.tensor([1]))  # table row 1 of 1
    with pytest.raises(ValueError, match="out of range"):
        call(pos=torch.tensor([-2]))
    with pytest.raises(ValueError, match="out of range"):
        call(start=torch.tensor([-1]))
    with pytest.raises(ValueError):
        call(table=table.long())
    with pytest.raises(ValueError):
        parity_attention(q, k.half(), k.half(), table, z, z, torch.tensor([5]), 0.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("shape", [(70, 37, 75), (19, 50, 64), (3, 1, 1)], ids=["odd-K", "even-K", "K1"])
def test_parity_linear_rows_do_not_depend_on_the_batch(dtype, shape) -> None:
    """Each output element is one fixed chain over k: alone, in any sub-batch, packed ahead of time
    or per call, the same bits; close to a float64 product.  (bfloat16 runs the pair GEMM where the
    CPU has AVX512-BF16, see test_bf16_pair_gemm_where_the_cpu_has_it.)"""
    torch.manual_seed(2)
    m, n, k = shape
    x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    full = parity_linear(x, w)
    ref = x.double() @ w.double().t()
    tol = 1e-4 if dtype == torch.float32 else 0.1
    assert (full.double() - ref).abs().max() < tol
    assert torch.equal(parity_linear(x, w, parity_pack(w)), full)
    for rows in ([0], [m - 1], [1, 2], list(range(m - 1, 0, -9))):
        assert torch.equal(parity_linear(x[rows], w), full[rows])
    # The control: the same products summed in another order (K reversed) differ in some bits, so the
    # equalities above are a property of the fixed order, not of any way to compute the product.
    # (In float32: a bfloat16 output's rounding hides most such differences.)
    xf, wf = x.float(), w.float()
    assert k == 1 or not torch.equal(
        parity_linear(xf.flip(1).contiguous(), wf.flip(1).contiguous()), parity_linear(xf, wf)
    )


@pytest.mark.native("avx512bf16")
def test_bf16_pair_gemm_where_the_cpu_has_it() -> None:
    """On AVX512-BF16 CPUs bfloat16 products take the pair GEMM (vdpbf16ps over k pairs, the
    engine's ``dpbf16`` GEMM without a bias): its packing puts column n's pair i at lane n % 32 of
    panel n // 32, and a packed weight of the wrong shape is refused before the kernel runs."""
    assert cpu_parity._uses_pairs(torch.bfloat16) and not cpu_parity._uses_pairs(torch.float32)
    w = torch.randn(37, 9).bfloat16()
    packed = parity_pack(w)
    assert packed.shape == (2, 5, 32, 2)
    for n in range(37):
        for i in range(5):
            pair = [w[n, 2 * i], w[n, 2 * i + 1] if 2 * i + 1 < 9 else 0]
            assert packed[n // 32, i, n % 32].tolist() == [float(v) for v in pair]
    assert not packed[1, :, 37 - 32 :].any()
    with pytest.raises(ValueError, match="panels"):
        parity_linear(torch.randn(2, 9).bfloat16(), w, packed[:1])


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_token_logprobs_kernel_near_log_softmax_and_row_invariant(dtype) -> None:
    """cbgen.token_logprobs on the CPU (the C kernel): within a few float32 ulps of torch's
    log_softmax, the same bits for a row alone, in any batch and from a strided view, and
    differentiable with log_softmax's gradient."""
    from cbgen.batch_invariant.logprobs import token_logprobs

    g = torch.Generator().manual_seed(3)
    for vocab in (49152, 1003, 7, 1):
        x = (torch.randn(33, vocab + 5, generator=g) * 6).to(dtype)[:, :vocab]  # rows at a stride
        tok = torch.randint(0, vocab, (33,), generator=g)
        got = token_logprobs(x, tok)
        ref = torch.log_softmax(x.float(), -1).gather(-1, tok[:, None])[:, 0]
        assert got.dtype == torch.float32 and torch.allclose(got, ref, rtol=2e-6, atol=2e-5), vocab
        alone = torch.cat([token_logprobs(x[i : i + 1].clone(), tok[i : i + 1]) for i in range(33)])
        assert torch.equal(got, alone), vocab
        assert torch.equal(token_logprobs(x.view(3, 11, vocab), tok.view(3, 11)).flatten(), got), vocab
    x = torch.randn(4, 6, 50, dtype=torch.float32, requires_grad=True)
    tok = torch.randint(0, 50, (4, 6))
    token_logprobs(x, tok).sum().backward()
    want = torch.autograd.grad(torch.log_softmax(x, -1).gather(-1, tok[..., None]).sum(), x)[0]
    assert torch.allclose(x.grad, want, atol=1e-6)


def test_token_logprobs_kernel_special_values_and_bad_tokens() -> None:
    """A NaN anywhere in a row, or an infinite maximum, gives NaN (as log_softmax); a token whose
    logit is -inf gets -inf, other -inf logits count as nothing; a token id out of range or a
    mismatched shape is refused before the kernel reads anything."""
    from cbgen.batch_invariant.logprobs import token_logprobs

    x = torch.zeros(4, 20)
    x[0, 13] = float("nan")
    x[1, 2] = float("inf")
    x[2, 5] = float("-inf")
    x[3, :10] = float("-inf")
    got = token_logprobs(x, torch.tensor([0, 0, 5, 12]))
    assert got[0].isnan() and got[1].isnan()
    assert got[2] == float("-inf")
    assert torch.equal(got[3:], torch.log_softmax(x[3:], -1)[:, 12])
    with pytest.raises(ValueError, match="out of range"):
        cpu_parity.parity_token_logprobs(x, torch.tensor([0, 0, 20, 1]))
    with pytest.raises(ValueError, match="tokens"):
        token_logprobs(x, torch.tensor([0, 1]))
