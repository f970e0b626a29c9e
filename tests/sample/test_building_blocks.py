"""Unit tests of the sampler's vectorised building blocks: batch parameters, seeded uniforms, inverse
CDF, row kernels, truncation thresholds and penalties."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cbgen.request import Request
from cbgen.sample.batch_params import BatchParams, seeded_uniform
from cbgen.sample.inverse_cdf import inverse_cdf, inverse_cdf_blocked
from cbgen.sample.penalties import (
    apply_banned_tokens,
    apply_frequency_presence,
    apply_logit_bias,
    apply_repetition_penalty,
)
from cbgen.sample.row_ops import (
    BLOCK,
    block_reduce,
    exp_rows,
    exp_sum,
    row_argmax,
    sort_values_desc,
    topk_desc,
)
from cbgen.sample.truncation import truncation_thresholds
from cbgen.sampling_params import SamplingParams


def make_request(params: SamplingParams, prompt=(5, 6), output=(), sample_index=0) -> Request:
    req = Request(
        request_id="r",
        prompt_token_ids=list(prompt),
        params=params,
        eos_token_ids=frozenset({2}),
        sample_index=sample_index,
    )
    for t in output:
        req.append_token(t)
    return req


# ------------------------------------------------------------------------------ seeded uniforms
def test_seeded_uniform_is_deterministic_and_open_interval() -> None:
    a = seeded_uniform(1, 0, 0)
    assert a == seeded_uniform(1, 0, 0)
    assert 0.0 < a < 1.0
    assert len({seeded_uniform(1, 0, p) for p in range(1000)}) == 1000
    assert seeded_uniform(1, 0, 5) != seeded_uniform(1, 1, 5) != seeded_uniform(2, 0, 5)
    assert 0.0 < seeded_uniform(-(2**70), 2**65, 0) < 1.0  # any Python int is accepted


def test_seeded_uniform_is_uniform() -> None:
    u = np.array([seeded_uniform(7, i % 50, i // 50) for i in range(20_000)])
    counts = np.histogram(u, bins=20, range=(0, 1))[0]
    expected = len(u) / 20
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 45.0  # 19 dof, p ~ 5e-4
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.03  # consecutive positions uncorrelated


# ------------------------------------------------------------------------------ inverse CDF
def referenceinverse_cdf(w: np.ndarray, u: float) -> int:
    cum = np.cumsum(w.astype(np.float64))
    return int(np.argmax(cum > u * cum[-1]))


def test_inverse_cdf_exact_quantiles_and_edges() -> None:
    w = torch.tensor([[0.0, 1.0, 0.0, 3.0, 0.0]] * 6)
    u = torch.tensor([0.0, 0.2, 0.25, 0.5, 1 - 2.0**-54, 0.9999999], dtype=torch.float64)
    assert inverse_cdf(w, u).tolist() == [1, 1, 3, 3, 3, 3]


@pytest.mark.parametrize("vocab", [64, 200, 1001])
def test_blocked_inverse_cdf_matches_reference(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    rows = 40
    w = torch.rand(rows, vocab, generator=gen)
    w[w < 0.6] = 0.0  # plenty of zero-probability tokens, including whole zero blocks
    w[:, : min(130, vocab // 2)] = 0.0
    w[:, -1] = 0.0
    u = torch.rand(rows, generator=gen, dtype=torch.float64)
    u[0] = 0.0
    u[1] = 1 - 2.0**-54
    bsum = block_reduce(w, "sum")
    got = inverse_cdf_blocked(w, None, bsum, u)
    for i in range(rows):
        assert w[i, got[i]] > 0
        if i >= 2:
            assert got[i].item() == referenceinverse_cdf(w[i].numpy(), u[i].item())
    nz = [int(torch.nonzero(w[i])[0]) for i in range(2)]
    last = int(torch.nonzero(w[1])[-1])
    assert got[0].item() == nz[0]  # u = 0 picks the first positive token
    assert got[1].item() == last  # u -> 1 picks the last positive token
    # Row subset: same answers as on the copied rows.
    sub = torch.tensor([5, 3, 9])
    got_sub = inverse_cdf_blocked(w, sub, bsum[sub], u[sub])
    assert got_sub.tolist() == got[sub].tolist()


def test_inverse_cdf_never_picks_zero_weight() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.zeros(2000, 300)
    w[:, 7] = 1e-30  # tiny but positive
    w[:, 150] = 1.0
    u = torch.rand(2000, generator=gen, dtype=torch.float64)
    u[:10] = 1 - 2.0**-54
    u[10:20] = 0.0
    got = inverse_cdf_blocked(w, None, block_reduce(w, "sum"), u)
    assert set(got.tolist()) <= {7, 150}
    dense = inverse_cdf(w, u)
    assert set(dense.tolist()) <= {7, 150}


# ------------------------------------------------------------------------------ block helpers
@pytest.mark.parametrize("vocab", [1, 63, 64, 65, 1000])
def test_block_reduce(vocab: int) -> None:
    x = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    mx = block_reduce(x, "max")
    sm = block_reduce(x, "sum")
    assert mx.shape == sm.shape == (3, math.ceil(vocab / BLOCK))
    torch.testing.assert_close(mx.amax(1), x.amax(1))
    torch.testing.assert_close(sm.sum(1), x.double().sum(1), atol=1e-4, rtol=0)
    assert sm.dtype == torch.float64


@pytest.mark.parametrize("vocab", [10, 64, 100, 5000, 5003])
def test_row_argmax_matches_torch(vocab: int) -> None:
    x = torch.randn(20, vocab, generator=torch.Generator().manual_seed(vocab))
    x[3] = 1.0  # all ties: index 0
    x[4, vocab // 2] = 100.0
    x[4, vocab - 1] = 100.0  # tie across blocks: the first
    x[5, vocab - 1] = 1e9  # maximum in the (possibly short) last block
    assert row_argmax(x).tolist() == torch.argmax(x, dim=1).tolist()
    rows = torch.tensor([5, 0, 4])
    assert row_argmax(x, rows).tolist() == torch.argmax(x[rows], dim=1).tolist()
    bmax = block_reduce(x, "max")
    assert row_argmax(x, rows, bmax).tolist() == torch.argmax(x[rows], dim=1).tolist()


@pytest.mark.parametrize(
    ("vocab", "k"), [(5000, 1), (5000, 7), (5000, 39), (5003, 20), (5000, 200), (50, 50)]
)
def test_topk_desc_matches_torch(vocab: int, k: int) -> None:
    x = torch.randn(12, vocab, generator=torch.Generator().manual_seed(k))
    x[2, :] = -1.0
    x[2, 100:110] = 3.0  # ties inside the top-k
    for rows in (None, torch.tensor([7, 2, 11])):
        src = x if rows is None else x[rows]
        vals, ids = topk_desc(x, k, rows)
        ref = torch.topk(src, k, dim=1).values
        torch.testing.assert_close(vals, ref)
        torch.testing.assert_close(src.gather(1, ids), vals)  # ids point at the values
        assert all(len(set(r)) == k for r in ids.tolist())  # no duplicate columns
    vals_b, _ = topk_desc(x, k, None, block_reduce(x, "max"))
    torch.testing.assert_close(vals_b, torch.topk(x, k, dim=1).values)


def test_sort_values_desc() -> None:
    x = torch.randn(4, 333, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(sort_values_desc(x), torch.sort(x, dim=1, descending=True).values)


def test_exp_rows_and_exp_sum() -> None:
    gen = torch.Generator().manual_seed(2)
    src = torch.randn(40, 300, generator=gen) * 3
    rows = torch.tensor([3, 39, 0, 17] * 5)
    shift = src[rows].amax(1)
    temp = torch.rand(20, generator=gen) + 0.3
    out = torch.empty(20, 300)
    scratch = torch.empty(20, 300)
    bsum, bmax, plain = exp_rows(src, rows, shift, temp, out, scratch)
    ref = torch.exp((src[rows].double() - shift[:, None].double()) / temp[:, None].double())
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(bsum.sum(1), ref.sum(1), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(bmax.amax(1), out.amax(1))
    torch.testing.assert_close(
        plain, torch.exp(src[rows].double() - shift[:, None]).sum(1), atol=1e-5, rtol=1e-6
    )
    keep = torch.rand(20, 300, generator=gen)
    got = exp_sum(src, rows, shift, torch.empty(3, 300), keep=keep, keep_above=0.5)
    ref_keep = (torch.exp(src[rows].double() - shift[:, None]) * (keep > 0.5)).sum(1)
    torch.testing.assert_close(got, ref_keep, atol=1e-5, rtol=1e-6)


# ------------------------------------------------------------------------------ truncation
def reference_survivors(logits: np.ndarray, temperature: float, k: int, p: float, min_p: float) -> np.ndarray:
    x = logits.astype(np.float64) / temperature
    if 0 < k < len(x):
        x[x < np.sort(x)[::-1][k - 1]] = -np.inf

    def softmax(v: np.ndarray) -> np.ndarray:
        e = np.exp(v - v[np.isfinite(v)].max())
        return e / e.sum()

    if p < 1:
        probs = softmax(x)
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        x[order[before >= p]] = -np.inf
    if min_p > 0:
        probs = softmax(x)
        x[probs < min_p * probs.max()] = -np.inf
    return np.isfinite(x)


@pytest.mark.parametrize("vocab", [300, 5000])
def test_truncation_thresholds_match_reference(vocab: int) -> None:
    rng = np.random.RandomState(vocab)
    settings = [
        (1.0, 5, 1.0, 0.0),
        (0.7, 0, 0.8, 0.0),
        (1.0, 0, 0.99, 0.0),  # wide nucleus: the candidate list is widened or the row is sorted
        (1.3, 0, 0.0 + 0.3, 0.0),
        (1.0, 0, 1.0, 0.1),
        (0.9, 40, 0.9, 0.02),
        (1.0, 100, 0.95, 0.0),
        (2.0, 0, 1.0, 0.001),  # min-p with many survivors: the list is incomplete
    ]
    logits = (rng.randn(len(settings), vocab) * 1.2).astype(np.float32)
    x = torch.from_numpy(logits)
    temp = torch.tensor([s[0] for s in settings])
    m = x.amax(1)
    e = torch.empty_like(x)
    bsum, bmax, _ = exp_rows(x, None, m, temp, e)
    rows = torch.arange(len(settings))
    tr = truncation_thresholds(
        e,
        rows,
        bsum.sum(1),
        torch.tensor([s[1] for s in settings]),
        torch.tensor([s[2] for s in settings], dtype=torch.float64),
        torch.tensor([s[3] for s in settings], dtype=torch.float32),
        bmax,
    )
    for i, (t, k, p, mp) in enumerate(settings):
        got = (e[i] >= tr.tau[i]).numpy()
        ref = reference_survivors(logits[i], t, k, p, mp)
        assert np.array_equal(got, ref), (i, got.sum(), ref.sum())
        if tr.complete[i]:
            listed = set(tr.ids[i][tr.values[i] >= tr.tau[i]].tolist())
            assert listed == set(np.nonzero(ref)[0].tolist())
    assert not bool(tr.complete[7])


# ------------------------------------------------------------------------------ stage 0/1
def test_penalties_and_bias_match_definitions() -> None:
    vocab = 30
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, vocab, generator=gen) * 2
    reqs = [
        make_request(SamplingParams(repetition_penalty=1.7), prompt=[1, 2, 2, 29], output=[4, 4, 1]),
        make_request(
            SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=[3], output=[3, 7, 7, 7]
        ),
        make_request(SamplingParams(), prompt=[0], output=[0]),
    ]
    out = logits.clone()
    apply_repetition_penalty(out, reqs, [0], [1.7])
    apply_frequency_presence(out, reqs, [1], [0.25], [0.5])
    apply_logit_bias(out, [2, 2], [5, 6], [1.5, float("-inf")])
    apply_banned_tokens(out, [1], [9])
    ref = logits.clone()
    for t in {1, 2, 29, 4}:
        ref[0, t] = ref[0, t] / 1.7 if ref[0, t] > 0 else ref[0, t] * 1.7
    ref[1, 3] -= 0.25 + 0.5
    ref[1, 7] -= 0.25 * 3 + 0.5
    ref[1, 9] = float("-inf")
    ref[2, 5] += 1.5
    ref[2, 6] = float("-inf")
    torch.testing.assert_close(out, ref)


def test_batch_params_flags() -> None:
    reqs = [
        make_request(SamplingParams(temperature=0, logprobs=3)),
        make_request(SamplingParams(top_k=100, seed=4), output=[1]),
        make_request(SamplingParams(top_k=5, min_tokens=2, stop_token_ids=[9, 999])),
        make_request(SamplingParams(presence_penalty=1.0)),  # no output yet: nothing to penalise
        make_request(
            SamplingParams(logit_bias={3: float("-inf")}, logits_processor_args={"x": 1}, logprobs=5)
        ),
        make_request(SamplingParams(temperature=0.5, top_p=0.9)),
    ]
    bp = BatchParams.from_requests(reqs, 50)
    assert bp.greedy_rows == [0] and bp.sampled_rows == [1, 2, 3, 4, 5]
    assert bp.top_k.tolist() == [0, 0, 5, 0, 0, 0]  # top_k >= V disables it
    assert bp.seeded_rows == [1] and bp.seeded_u == [seeded_uniform(4, 0, 1)]
    assert bp.unseeded_rows == [2, 3, 4, 5]
    assert sorted(zip(bp.banned_rows, bp.banned_cols)) == [(2, 2), (2, 9)]
    assert bp.modified == [False, False, True, False, True, False]
    assert bp.masked == [False, False, True, False, True, False]
    assert bp.identity == [False, True, False, True, False, False]
    assert bp.num_top_logprobs == 5 and bp.logprob_rows == [0, 4]
    assert bp.processor_rows == {"x": [4]} and bp.processor_args == {"x": [1]}
    assert bp.any_temperature and bp.any_truncation
