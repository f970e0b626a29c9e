"""Sampler tests against an independent float64 reference written from the definitions.

The reference below re-derives every processing step with numpy in float64 (penalties, bias,
temperature, top-k, top-p, min-p, renormalisation) and shares no code with ``cbgen.sample``.
Statistical tests draw 20,000 samples and use a chi-square test at p ~ 5e-4 (critical value from
the Wilson-Hilferty approximation), a total-variation bound, and a hard check that tokens of zero
target probability are never drawn.  The sampler's private generator is seeded, so every test is
deterministic.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
import pytest
import torch

from cbgen.request import Request
from cbgen.sample import row_ops
from cbgen.sample import sampler as sampler_module
from cbgen.sample.sampler import SamplerOutput, prompt_logprobs
from cbgen.sampling_params import SamplingParams

EOS = 2
N_SAMPLES = 20_000
Sampler = sampler_module.Sampler  # replaced per test by the fixture below


@pytest.fixture(autouse=True, params=["sync", "sync_free"])
def sampler_mode(request, monkeypatch) -> str:
    """Every test runs against both sampled-row algorithms (see ``Sampler``'s ``sync_free``)."""
    sync_free = request.param == "sync_free"

    def make(*args, **kwargs):
        kwargs.setdefault("sync_free", sync_free)
        return sampler_module.Sampler(*args, **kwargs)

    monkeypatch.setitem(globals(), "Sampler", make)
    return request.param


# ------------------------------------------------------------------------------ reference (float64)
def _softmax(x: np.ndarray) -> np.ndarray:
    finite = np.isfinite(x)
    m = x[finite].max()
    e = np.where(finite, np.exp(np.where(finite, x, m) - m), 0.0)
    return e / e.sum()


def penalised_logits(
    logits: np.ndarray, params: SamplingParams, prompt: list[int], output: list[int]
) -> np.ndarray:
    """Stage 0 (min_tokens) and stage 1 (penalties, bias) from their definitions, in float64."""
    x = logits.astype(np.float64).copy()
    if len(output) < params.min_tokens:
        banned = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            banned.add(EOS)
        for t in banned:
            x[t] = -np.inf
    if params.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t, c in Counter(output).items():
        x[t] -= params.frequency_penalty * c + params.presence_penalty
    for t, b in (params.logit_bias or {}).items():
        x[t] += b
    return x


def reference_distribution(
    logits: np.ndarray, params: SamplingParams, prompt: list[int] = (), output: list[int] = ()
) -> tuple[np.ndarray, np.ndarray]:
    """(final probabilities, survivor mask) of the processed distribution, in float64."""
    x = penalised_logits(logits, params, list(prompt), list(output))
    if params.temperature == 0:
        p = np.zeros_like(x)
        p[int(np.argmax(x))] = 1.0
        return p, p > 0
    x = x / params.temperature
    vocab = len(x)
    if 0 < params.top_k < vocab:
        kth = np.sort(x)[::-1][params.top_k - 1]
        x[x < kth] = -np.inf
    if params.top_p < 1.0:
        p = _softmax(x)
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        x[order[before >= params.top_p]] = -np.inf
    if params.min_p > 0:
        p = _softmax(x)
        x[p < params.min_p * p.max()] = -np.inf
    p = _softmax(x)
    return p, np.isfinite(x)


def top_p_margin(logits: np.ndarray, params: SamplingParams, prompt=(), output=()) -> float:
    """Distance of top_p from the nearest cumulative-mass boundary (so float32 cannot flip the cut)."""
    x = penalised_logits(logits, params, list(prompt), list(output)) / params.temperature
    if 0 < params.top_k < len(x):
        kth = np.sort(x)[::-1][params.top_k - 1]
        x[x < kth] = -np.inf
    p = np.sort(_softmax(x))[::-1]
    return float(np.min(np.abs(np.cumsum(p) - p - params.top_p)))


def chi2_critical(dof: int, z: float = 3.29) -> float:
    """Upper critical value of chi-square with ``dof`` degrees of freedom (Wilson-Hilferty), p ~ 5e-4."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_statistic(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Chi-square over the support, pooling cells with an expected count below 5."""
    n = counts.sum()
    support = probs > 0
    expected = probs[support] * n
    observed = counts[support].astype(np.float64)
    big = expected >= 5
    exp_cells = list(expected[big])
    obs_cells = list(observed[big])
    if (~big).any():
        exp_cells.append(expected[~big].sum())
        obs_cells.append(observed[~big].sum())
    e = np.array(exp_cells)
    o = np.array(obs_cells)
    return float(((o - e) ** 2 / e).sum()), len(e) - 1


def assert_matches(counts: np.ndarray, probs: np.ndarray) -> None:
    assert counts[probs == 0].sum() == 0, (
        f"drew tokens of zero probability: {np.nonzero(counts * (probs == 0))}"
    )
    stat, dof = chi2_statistic(counts, probs)
    assert dof >= 1
    assert stat < chi2_critical(dof), f"chi2={stat:.1f} dof={dof} crit={chi2_critical(dof):.1f}"
    tv = 0.5 * np.abs(counts / counts.sum() - probs).sum()
    assert tv < 0.03, tv


# ------------------------------------------------------------------------------ helpers
def make_request(
    params: SamplingParams,
    prompt: list[int] | None = None,
    output: list[int] = (),
    sample_index: int = 0,
    request_id: str = "r",
) -> Request:
    req = Request(
        request_id=request_id,
        prompt_token_ids=list(prompt or [5, 6]),
        params=params,
        eos_token_ids=frozenset({EOS}),
        sample_index=sample_index,
    )
    for t in output:
        req.append_token(t)
    return req


def fixed_logits(vocab: int = 50, seed: int = 0, scale: float = 1.5) -> np.ndarray:
    return (np.random.RandomState(seed).randn(vocab) * scale).astype(np.float32)


def draw(logits: np.ndarray, req: Request, n: int = N_SAMPLES, seed: int = 1) -> np.ndarray:
    sampler = Sampler(len(logits), seed=seed)
    batch = torch.from_numpy(logits).unsqueeze(0).expand(n, -1).contiguous()
    out = sampler(batch, [req] * n)
    assert out.failed == {}
    return np.bincount(out.token_ids.numpy(), minlength=len(logits))


PROMPT = [0, 3, 4, 9, 9, 17]
OUTPUT = [3, 11, 11, 11, 20, 7]

STAT_CASES = {
    "temperature": SamplingParams(temperature=0.7),
    "high_temperature": SamplingParams(temperature=1.8),
    "top_k": SamplingParams(top_k=7),
    "top_p": SamplingParams(top_p=0.62),
    "min_p": SamplingParams(min_p=0.15),
    "repetition_penalty": SamplingParams(repetition_penalty=1.8),
    "presence_penalty": SamplingParams(presence_penalty=1.5),
    "frequency_penalty": SamplingParams(frequency_penalty=0.9),
    "logit_bias": SamplingParams(logit_bias={1: 3.0, 4: -2.5, 30: float("-inf"), 12: 1.0}),
    "combination": SamplingParams(
        temperature=0.8,
        top_k=20,
        top_p=0.87,
        min_p=0.04,
        repetition_penalty=1.3,
        presence_penalty=0.4,
        frequency_penalty=0.3,
        logit_bias={8: 1.5, 13: -1.0},
    ),
}


@pytest.mark.parametrize("name", list(STAT_CASES))
def test_distribution_matches_reference(name: str) -> None:
    params = STAT_CASES[name]
    logits = fixed_logits()
    if params.top_p < 1.0:
        assert top_p_margin(logits, params, PROMPT, OUTPUT) > 1e-3
    req = make_request(params, PROMPT, OUTPUT)
    probs, _ = reference_distribution(logits, params, PROMPT, OUTPUT)
    assert_matches(draw(logits, req), probs)


def test_statistical_check_has_power() -> None:
    """Negative control: samples at temperature 0.7 must be rejected against the temperature-1 target."""
    logits = fixed_logits()
    counts = draw(logits, make_request(SamplingParams(temperature=0.7)))
    wrong, _ = reference_distribution(logits, SamplingParams())
    stat, dof = chi2_statistic(counts, wrong)
    assert stat > 5 * chi2_critical(dof)


def test_seeded_stream_distribution() -> None:
    """Seeded rows (one per sample_index) follow the same distribution: the hash is uniform."""
    logits = fixed_logits(seed=3)
    params = SamplingParams(temperature=0.9, top_k=25, seed=1234)
    reqs = [make_request(params, sample_index=i) for i in range(N_SAMPLES)]
    batch = torch.from_numpy(logits).unsqueeze(0).expand(N_SAMPLES, -1).contiguous()
    out = Sampler(len(logits))(batch, reqs)
    probs, _ = reference_distribution(logits, params)
    assert_matches(np.bincount(out.token_ids.numpy(), minlength=len(logits)), probs)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_p=0.9),  # wide nucleus: longer candidate lists, then whole-row masking
        SamplingParams(temperature=1.3, top_p=0.97, top_k=2500),
        SamplingParams(min_p=0.3),
        SamplingParams(temperature=0.9),
    ],
    ids=["top_p", "top_k_top_p", "min_p", "plain"],
)
def test_large_vocab_distribution(params: SamplingParams) -> None:
    """V=3001 (not a multiple of any block size) with a flat distribution, in batches of 2000."""
    vocab = 3001
    logits = fixed_logits(vocab, seed=5, scale=0.6)
    probs, _ = reference_distribution(logits, params)
    if params.top_p < 1.0:
        assert top_p_margin(logits, params) > 1e-5
    sampler = Sampler(vocab, seed=7)
    req = make_request(params)
    counts = np.zeros(vocab, dtype=np.int64)
    batch = torch.from_numpy(logits).unsqueeze(0).expand(2000, -1).contiguous()
    for _ in range(N_SAMPLES // 2000):
        counts += np.bincount(sampler(batch, [req] * 2000).token_ids.numpy(), minlength=vocab)
    assert counts[probs == 0].sum() == 0
    # Pool tokens (in id order) into ~40 cells of similar expected mass, then chi-square.
    support = np.nonzero(probs)[0]
    edges = np.searchsorted(np.cumsum(probs[support]), np.linspace(0, 1, 41)[1:-1])
    cell_p = np.array([c.sum() for c in np.split(probs[support], edges)])
    cell_n = np.array([c.sum() for c in np.split(counts[support], edges)])
    stat, dof = chi2_statistic(cell_n, cell_p)
    assert stat < chi2_critical(dof), (stat, dof)


# ------------------------------------------------------------------------------ logprobs
LOGPROB_CASES = [
    SamplingParams(),
    SamplingParams(temperature=0.6),
    SamplingParams(top_k=5),
    SamplingParams(top_p=0.55),
    SamplingParams(min_p=0.2),
    SamplingParams(top_k=12, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=1.4, top_k=30, repetition_penalty=1.2, frequency_penalty=0.5),
    SamplingParams(temperature=0.5, presence_penalty=-0.7, logit_bias={2: 4.0, 6: -3.0}),
    SamplingParams(temperature=0.0, repetition_penalty=2.0),
    SamplingParams(temperature=0.0),
]


def test_logprobs_match_reference() -> None:
    vocab = 200
    rng = np.random.RandomState(11)
    rows = []
    reqs = []
    for i, params in enumerate(LOGPROB_CASES * 3):
        logits = (rng.randn(vocab) * 2).astype(np.float32)
        if params.top_p < 1.0:
            assert top_p_margin(logits, params, PROMPT, OUTPUT) > 1e-4
        rows.append(logits)
        reqs.append(make_request(params, PROMPT, OUTPUT, request_id=f"r{i}"))
    out = Sampler(vocab)(torch.from_numpy(np.stack(rows)), reqs)
    assert out.failed == {}
    for i, (logits, req) in enumerate(zip(rows, reqs)):
        tok = int(out.token_ids[i])
        probs, survivors = reference_distribution(logits, req.params, PROMPT, OUTPUT)
        assert probs[tok] > 0
        raw = logits.astype(np.float64)
        raw_lsm = raw - (raw.max() + np.log(np.exp(raw - raw.max()).sum()))
        assert out.raw_logprobs[i].item() == pytest.approx(raw_lsm[tok], abs=1e-5)
        kept = np.log(np.exp(raw_lsm)[survivors].sum())
        assert out.log_kept_mass[i].item() == pytest.approx(kept, abs=1e-5)
        if req.params.temperature == 0:
            assert out.logprobs[i].item() == 0.0
            assert out.log_kept_mass[i].item() == pytest.approx(out.raw_logprobs[i].item(), abs=1e-6)
        else:
            assert out.logprobs[i].item() == pytest.approx(np.log(probs[tok]), abs=1e-5)


def test_logprob_equals_raw_minus_kept_mass_at_temperature_one() -> None:
    vocab = 4099
    rng = np.random.RandomState(2)
    cases = [
        SamplingParams(),
        SamplingParams(top_k=3),
        SamplingParams(top_k=300),
        SamplingParams(top_p=0.9),
        SamplingParams(top_p=0.3),
        SamplingParams(min_p=0.05),
        SamplingParams(top_k=500, top_p=0.95, min_p=0.01),
        SamplingParams(temperature=0.0),
    ]
    logits = torch.from_numpy((rng.randn(len(cases) * 4, vocab) * 2.5).astype(np.float32))
    reqs = [make_request(p, request_id=str(i)) for i, p in enumerate(cases * 4)]
    out = Sampler(vocab)(logits, reqs)
    assert out.failed == {}
    torch.testing.assert_close(out.logprobs, out.raw_logprobs - out.log_kept_mass, atol=1e-5, rtol=0)
    # Sanity: truncation really cut something in the truncated rows.
    assert (out.log_kept_mass[1:7] < -1e-3).all()
    assert out.log_kept_mass[0].item() == 0.0


def test_wide_logit_range_at_low_temperature() -> None:
    """Most exp() results underflow here; probabilities and logprobs must still be exact."""
    vocab = 500
    logits = (np.random.RandomState(9).randn(vocab) * 40).astype(np.float32)
    logits[:5] = logits.max() - np.array([0.0, 0.3, 0.9, 2.0, 150.0], dtype=np.float32)
    params = SamplingParams(temperature=0.4, min_p=1e-30)
    probs, _ = reference_distribution(logits, params)
    counts = draw(logits, make_request(params))
    assert_matches(counts, probs)
    out = Sampler(vocab)(torch.from_numpy(logits).expand(8, -1).contiguous(), [make_request(params)] * 8)
    for i in range(8):
        tok = out.token_ids[i].item()
        assert out.logprobs[i].item() == pytest.approx(np.log(probs[tok]), abs=1e-5)


def test_input_dtype_bf16_and_padding_columns() -> None:
    """bf16 logits (many ties) and V' larger than the tokenizer vocabulary are handled."""
    vocab_padded = 1000
    logits = (torch.randn(4, vocab_padded, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    reqs = [
        make_request(SamplingParams(top_k=4, logprobs=3)),
        make_request(SamplingParams(temperature=0)),
        make_request(SamplingParams(top_p=0.5)),
        make_request(SamplingParams(min_p=0.5, seed=1)),
    ]
    out = Sampler(900)(logits, reqs)
    x = logits.float()
    assert out.token_ids[1].item() == int(torch.argmax(x[1]))
    kth = torch.sort(x[0], descending=True).values[3]
    assert x[0, out.token_ids[0]] >= kth
    ref = torch.log_softmax(x.double(), dim=1)
    torch.testing.assert_close(
        out.raw_logprobs.double(), ref.gather(1, out.token_ids[:, None]).squeeze(1), atol=1e-5, rtol=0
    )


def test_top_k_keeps_ties() -> None:
    """Like transformers (``logits < kth`` is removed), tokens tied with the k-th value survive."""
    logits = torch.full((N_SAMPLES, 10), -5.0)
    logits[:, :5] = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0])
    req = make_request(SamplingParams(top_k=2))
    out = Sampler(10)(logits, [req] * N_SAMPLES)
    counts = np.bincount(out.token_ids.numpy(), minlength=10)
    x = np.array([3.0, 2.0, 2.0, 2.0, -np.inf, *[-np.inf] * 5])
    assert_matches(counts, _softmax(x))


# ------------------------------------------------------------------------------ seeds and RNG
def _seeded_batch_token(
    vocab_logits: torch.Tensor, target: Request, others: list[tuple[torch.Tensor, Request]], at: int
):
    rows = [lg for lg, _ in others]
    reqs = [r for _, r in others]
    rows.insert(at, vocab_logits)
    reqs.insert(at, target)
    out = Sampler(vocab_logits.shape[0], seed=99)(torch.stack(rows), reqs)
    return out.token_ids[at].item(), out.logprobs[at].item()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(seed=42),
        SamplingParams(seed=42, temperature=0.8, top_p=0.9),
        SamplingParams(seed=-7, top_k=50, min_p=0.01, repetition_penalty=1.1),
    ],
)
def test_seeded_row_independent_of_batch(params: SamplingParams) -> None:
    vocab = 3000
    gen = torch.Generator().manual_seed(0)
    other_params = [
        SamplingParams(temperature=0),
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.5, temperature=1.5),
        SamplingParams(min_p=0.2, logprobs=5),
        SamplingParams(seed=1),
        SamplingParams(presence_penalty=1.0, logit_bias={1: 2.0}),
        SamplingParams(top_k=2000),
    ]
    for position in range(12):
        target_logits = torch.randn(vocab, generator=gen) * 0.5
        target = make_request(params, output=list(range(position)))
        others = [(torch.randn(vocab, generator=gen), make_request(p, output=[1])) for p in other_params]
        alone = _seeded_batch_token(target_logits, target, [], 0)
        first = _seeded_batch_token(target_logits, target, others[:3], 0)
        middle = _seeded_batch_token(target_logits, target, others, 4)
        last = _seeded_batch_token(target_logits, target, others[2:], 5)
        assert alone == first == middle == last


def test_sample_index_gives_independent_streams() -> None:
    vocab = 500
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(1)) * 0.3  # high entropy
    streams = []
    for sample_index in (0, 1, 0):
        req = make_request(SamplingParams(seed=5), sample_index=sample_index)
        sampler = Sampler(vocab, seed=sample_index)  # the unseeded generator must not matter
        for _ in range(40):
            req.append_token(sampler(logits[None], [req]).token_ids[0].item())
        streams.append(req.output_token_ids)
    assert streams[0] == streams[2]
    assert streams[0] != streams[1]
    assert len(set(streams[0])) > 20


def test_unseeded_rows_with_identical_logits_are_independent() -> None:
    logits = torch.zeros(64, 1000)
    out = Sampler(1000)(logits, [make_request(SamplingParams())] * 64)
    assert len(set(out.token_ids.tolist())) > 55


def test_global_rng_untouched() -> None:
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(9)
    torch_state = torch.get_rng_state()
    py_state = random.getstate()
    np_state = np.random.get_state()
    sampler = Sampler(300)
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3))
    reqs = [
        make_request(SamplingParams()),
        make_request(SamplingParams(seed=3, top_p=0.9)),
        make_request(SamplingParams(temperature=0)),
        make_request(SamplingParams(top_k=10, logprobs=2)),
        make_request(SamplingParams(min_p=0.1, frequency_penalty=1.0), output=[4, 4]),
        make_request(SamplingParams(temperature=0.3)),
    ]
    for _ in range(3):
        sampler(logits, reqs)
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert random.getstate() == py_state
    np_now = np.random.get_state()
    assert np_now[0] == np_state[0] and np.array_equal(np_now[1], np_state[1]) and np_now[2:] == np_state[2:]


def test_unseeded_sampler_is_reproducible_from_its_seed() -> None:
    logits = torch.randn(32, 400, generator=torch.Generator().manual_seed(4))
    reqs = [make_request(SamplingParams(top_p=0.95))] * 32
    a = Sampler(400, seed=3)(logits, reqs).token_ids
    b = Sampler(400, seed=3)(logits, reqs).token_ids
    c = Sampler(400, seed=4)(logits, reqs).token_ids
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


# ------------------------------------------------------------------------------ greedy, min_tokens
def test_greedy_is_argmax_of_penalised_logits() -> None:
    vocab = 777
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(8))
    logits[2, 700] = 50.0
    logits[2, 10] = 50.0  # tie: the first index wins, like torch.argmax
    logits[3, 42] = 30.0  # penalised below the runner-up by repetition_penalty 100
    reqs = [
        make_request(SamplingParams(temperature=0)),
        make_request(SamplingParams(temperature=0, logprobs=4)),
        make_request(SamplingParams(temperature=0)),
        make_request(SamplingParams(temperature=0, repetition_penalty=100.0), prompt=[42]),
        make_request(SamplingParams(temperature=0, logit_bias={5: 100.0})),
    ]
    out = Sampler(vocab)(logits, reqs)
    expected = torch.argmax(logits, dim=1)
    expected[3] = torch.argmax(torch.cat([logits[3, :42], torch.tensor([-1e9]), logits[3, 43:]]))
    expected[4] = 5
    assert out.token_ids.tolist() == expected.tolist()
    assert out.token_ids[2].item() == 10
    assert (out.logprobs == 0).all()
    torch.testing.assert_close(out.log_kept_mass, out.raw_logprobs)
    lsm = torch.log_softmax(logits.double(), 1)
    torch.testing.assert_close(
        out.raw_logprobs.double(), lsm.gather(1, out.token_ids[:, None]).squeeze(1), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_suppresses_eos_and_stop_tokens(temperature: float) -> None:
    vocab = 100
    logits = torch.zeros(vocab)
    logits[EOS] = 20.0
    logits[7] = 19.0
    logits[8] = 5.0
    params = SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=[7], max_tokens=10)
    sampler = Sampler(vocab)
    for n_out, allowed in ((0, False), (2, False), (3, True)):
        reqs = [make_request(params, output=[9] * n_out)] * 200
        toks = sampler(logits.expand(200, -1).contiguous(), reqs).token_ids
        if allowed:
            assert (toks == EOS).float().mean() > 0.5
        else:
            assert not ((toks == EOS) | (toks == 7)).any()
    ignore = SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=[7], ignore_eos=True)
    toks = sampler(logits.expand(200, -1).contiguous(), [make_request(ignore)] * 200).token_ids
    assert not (toks == 7).any()
    assert (toks == EOS).float().mean() > 0.5


def test_min_tokens_logprob_is_renormalised() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5]])
    req = make_request(SamplingParams(min_tokens=1), output=[])
    out = Sampler(4)(logits, [req])
    assert out.token_ids[0].item() != EOS
    p = np.exp([0.0, 1.0, 0.5]) / np.exp([0.0, 1.0, 0.5]).sum()
    tok = out.token_ids[0].item()
    assert out.logprobs[0].item() == pytest.approx(np.log(p[[0, 1, 3].index(tok)]), abs=1e-6)
    raw = torch.log_softmax(logits.double(), 1)[0]
    kept = math.log(1 - math.exp(raw[EOS].item()))
    assert out.log_kept_mass[0].item() == pytest.approx(kept, abs=1e-6)


# ------------------------------------------------------------------------------ top logprobs
def test_top_logprobs_shape_and_values() -> None:
    vocab = 300
    rng = np.random.RandomState(4)
    params = [
        SamplingParams(logprobs=5, temperature=0.7),
        SamplingParams(),
        SamplingParams(logprobs=3, top_k=2),
        SamplingParams(logprobs=5, temperature=0, repetition_penalty=1.5),
        SamplingParams(logprobs=0),
    ]
    rows = (rng.randn(len(params), vocab) * 2).astype(np.float32)
    reqs = [make_request(p, PROMPT, OUTPUT) for p in params]
    out = Sampler(vocab)(torch.from_numpy(rows), reqs)
    assert out.topk_ids.shape == (5, 5) and out.topk_logprobs.shape == (5, 5)
    assert (out.topk_ids[1] == -1).all() and torch.isnan(out.topk_logprobs[1]).all()
    # Sampled row: processed distribution.
    probs, _ = reference_distribution(rows[0], params[0], PROMPT, OUTPUT)
    order = np.argsort(-probs)[:5]
    assert out.topk_ids[0].tolist() == order.tolist()
    np.testing.assert_allclose(out.topk_logprobs[0].numpy(), np.log(probs[order]), atol=1e-5)
    # Truncated row: survivors first, then -inf.
    probs, _ = reference_distribution(rows[2], params[2], PROMPT, OUTPUT)
    order = np.argsort(-probs)[:2]
    assert out.topk_ids[2, :2].tolist() == order.tolist()
    np.testing.assert_allclose(out.topk_logprobs[2, :2].numpy(), np.log(probs[order]), atol=1e-5)
    assert torch.isneginf(out.topk_logprobs[2, 2:]).all()
    # Greedy row: log_softmax of the penalised logits at temperature 1.
    pen = penalised_logits(rows[3], params[3], PROMPT, OUTPUT)
    lsm = pen - (pen.max() + np.log(np.exp(pen - pen.max()).sum()))
    order = np.argsort(-lsm)[:5]
    assert out.topk_ids[3].tolist() == order.tolist()
    np.testing.assert_allclose(out.topk_logprobs[3].numpy(), lsm[order], atol=1e-5)
    assert out.token_ids[3].item() == order[0]


def test_no_top_logprobs_when_nobody_asks() -> None:
    out = Sampler(10)(torch.randn(2, 10), [make_request(SamplingParams())] * 2)
    assert out.topk_ids is None and out.topk_logprobs is None
    assert isinstance(out, SamplerOutput)
    assert out.token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32


def test_prompt_logprobs_against_float64() -> None:
    logits = torch.randn(7, 123, generator=torch.Generator().manual_seed(6)) * 4
    targets = torch.tensor([0, 5, 122, 7, 7, 64, 1])
    lp, ids, top = prompt_logprobs(logits, targets, 4)
    ref = torch.log_softmax(logits.double(), dim=1)
    torch.testing.assert_close(lp.double(), ref.gather(1, targets[:, None]).squeeze(1), atol=1e-5, rtol=0)
    ref_top = torch.topk(ref, 4, dim=1)
    assert torch.equal(ids, ref_top.indices)
    torch.testing.assert_close(top.double(), ref_top.values, atol=1e-5, rtol=0)
    lp0, ids0, top0 = prompt_logprobs(logits.to(torch.bfloat16), targets, 0)
    assert ids0 is None and top0 is None and lp0.shape == (7,)


# ------------------------------------------------------------------------------ failures, validation
def test_non_finite_logits_fail_only_their_row() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    logits[1, 3] = float("nan")
    logits[2, 7] = float("nan")
    reqs = [
        make_request(SamplingParams()),
        make_request(SamplingParams()),
        make_request(SamplingParams(temperature=0)),
        make_request(SamplingParams(top_p=0.9)),
    ]
    out = Sampler(50)(logits, reqs)
    assert set(out.failed) == {1, 2}
    assert out.token_ids.min() >= 0 and out.token_ids.max() < 50
    assert math.isfinite(out.logprobs[3].item()) and math.isfinite(out.logprobs[0].item())


def test_all_tokens_banned_fails_the_row() -> None:
    logits = torch.randn(3, 4)
    bias = {t: float("-inf") for t in range(4)}
    reqs = [
        make_request(SamplingParams(logit_bias=bias)),
        make_request(SamplingParams()),
        make_request(SamplingParams(temperature=0, logit_bias=bias)),
    ]
    out = Sampler(4)(logits, reqs)
    assert set(out.failed) == {0, 2}


def test_rejects_bad_shapes() -> None:
    sampler = Sampler(10)
    with pytest.raises(ValueError):
        sampler(torch.randn(3, 10), [make_request(SamplingParams())] * 2)
    with pytest.raises(ValueError):
        sampler(torch.randn(1, 9), [make_request(SamplingParams())])
    empty = sampler(torch.randn(0, 10), [])
    assert empty.token_ids.shape == (0,)


def _forbid_device_reads(monkeypatch) -> None:
    """Makes every host read-back of tensor data raise: on CUDA each would be a device sync."""

    def boom(*args, **kwargs):
        raise AssertionError("the sampler read device data back inside a step")

    for name in ("tolist", "item", "__bool__", "nonzero", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    monkeypatch.setattr(row_ops, "CPU_EXP_SHORTCUT", False)  # CPU-only, reads a value back


def test_greedy_batch_needs_no_device_read_back(monkeypatch) -> None:
    """Greedy rows (with top logprobs, bias and a NaN row) are sampled without reading device data;
    failures come back as flags with the tokens and become messages at read-back."""
    torch.manual_seed(0)
    logits = torch.randn(6, 300)
    logits[4] = float("nan")
    reqs = [make_request(SamplingParams(temperature=0, logprobs=3 if i % 2 else None)) for i in range(6)]
    reqs[2] = make_request(SamplingParams(temperature=0, logit_bias={5: 100.0}))
    with monkeypatch.context() as m:
        _forbid_device_reads(m)
        out = Sampler(300)(logits, reqs)
    assert list(out.failed) == [4] and "NaN" in out.failed[4]
    expected = logits.argmax(dim=1)
    expected[2] = 5
    live = [0, 1, 2, 3, 5]
    assert out.token_ids[live].tolist() == expected[live].tolist()
    lp = torch.log_softmax(logits[live].double(), dim=1)
    raw = out.raw_logprobs[live].double()
    assert torch.allclose(raw, lp.gather(1, expected[live].unsqueeze(1)).squeeze(1), atol=1e-5)
    assert out.topk_ids[1].tolist() == logits[1].topk(3).indices.tolist()


def test_sampled_batch_needs_no_device_read_back(monkeypatch, sampler_mode) -> None:
    """The sync-free mode samples truncated, penalised, biased and failing rows without reading any
    device data, and its tokens, logprobs and kept mass follow the float64 reference."""
    vocab = 300
    rng = np.random.RandomState(4)
    cases = [
        *LOGPROB_CASES,
        SamplingParams(top_p=0.9, seed=3, logprobs=4),
        SamplingParams(top_k=3, min_p=0.1, logprobs=2),
        SamplingParams(logit_bias={t: float("-inf") for t in range(vocab)}),  # nothing choosable
        SamplingParams(top_k=4),  # NaN logits below
    ]
    rows = [(rng.randn(vocab) * 2).astype(np.float32) for _ in cases]
    rows[-1][7] = np.nan
    reqs = [make_request(p, PROMPT, OUTPUT, request_id=f"r{i}") for i, p in enumerate(cases)]
    logits = torch.from_numpy(np.stack(rows))
    with monkeypatch.context() as m:
        _forbid_device_reads(m)
        if sampler_mode == "sync":  # control: the read-back check has teeth
            with pytest.raises(AssertionError, match="read device data back"):
                Sampler(vocab)(logits, reqs)
            return
        out = Sampler(vocab)(logits, reqs)
    bad = [len(cases) - 2, len(cases) - 1]
    assert list(out.failed) == bad
    for i, (x, req) in enumerate(zip(rows, reqs)):
        if i in bad:
            continue
        tok = int(out.token_ids[i])
        probs, survivors = reference_distribution(x, req.params, PROMPT, OUTPUT)
        assert probs[tok] > 0, (i, req.params)
        raw = x.astype(np.float64)
        raw_lsm = raw - (raw.max() + np.log(np.exp(raw - raw.max()).sum()))
        assert out.raw_logprobs[i].item() == pytest.approx(raw_lsm[tok], abs=1e-5)
        assert out.log_kept_mass[i].item() == pytest.approx(
            np.log(np.exp(raw_lsm)[survivors].sum()), abs=1e-5
        )
        if req.params.temperature != 0:
            assert out.logprobs[i].item() == pytest.approx(np.log(probs[tok]), abs=1e-5)
        if req.params.logprobs:
            k = req.params.logprobs
            ids = out.topk_ids[i, :k].numpy()
            with np.errstate(divide="ignore"):
                expected = np.log(probs[ids])
            np.testing.assert_allclose(out.topk_logprobs[i, :k].numpy(), expected, atol=1e-5)
            assert sorted(probs[ids], reverse=True) == pytest.approx(sorted(probs, reverse=True)[:k])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_greedy_kernel_matches_general_path(monkeypatch, sampler_mode, dtype) -> None:
    """Unmodified greedy batches on the CPU take the C kernel the plan hands the sampler (bfloat16
    logits read as they are): same tokens (first maximum, NaN as the maximum), raw logprobs and
    failure flags as the general path."""
    from cbgen.model.kernels.cpu import ops as cpu_kernels

    if sampler_mode != "sync" or not cpu_kernels.available():
        pytest.skip("the kernel path is the CPU sync mode's")
    calls = []

    def kernel(x):
        calls.append(1)
        return cpu_kernels.greedy_rows(x)

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 3001, generator=gen) * 4
    logits[1, 17] = float("nan")
    logits[2] = float("-inf")
    logits[3, 5] = float("inf")
    logits[4, 100:103] = 50.0  # a tie: the first index wins
    logits[5, :] = 0.0
    logits = logits.to(dtype)
    reqs = [make_request(SamplingParams(temperature=0)) for _ in range(9)]
    fast = sampler_module.Sampler(3001, sync_free=False, greedy_kernel=kernel)(logits, reqs)
    general = sampler_module.Sampler(3001, sync_free=True, greedy_kernel=kernel)(logits, reqs)
    assert calls == [1], "the C kernel was not used (or used by the sync-free path)"
    assert fast.failed.keys() == general.failed.keys() == {1, 2, 3}
    assert fast.token_ids.tolist() == general.token_ids.tolist()
    assert fast.token_ids[4] == 100 and fast.token_ids[5] == 0
    live = [0, 4, 5, 6, 7, 8]
    torch.testing.assert_close(fast.raw_logprobs[live], general.raw_logprobs[live], atol=1e-5, rtol=0)
    torch.testing.assert_close(fast.log_kept_mass[live], fast.raw_logprobs[live])
    assert fast.logprobs.abs().sum() == 0


def test_greedy_kernel_runs_only_where_handed_in(sampler_mode) -> None:
    """The sampler uses a greedy kernel only when one is handed in (the plan's choice), only for
    batches of plain greedy rows, and never for logits the kernel cannot read."""
    calls = []

    def kernel(x):
        calls.append(x.dtype)
        return x.float().argmax(1), x.float().amax(1), torch.logsumexp(x.double(), 1)

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    greedy = [make_request(SamplingParams(temperature=0)) for _ in range(4)]
    without = Sampler(50)(logits, greedy)
    assert calls == []
    with_kernel = Sampler(50, greedy_kernel=kernel)(logits, greedy)
    assert calls == ([] if sampler_mode == "sync_free" else [torch.float32])
    assert with_kernel.token_ids.tolist() == without.token_ids.tolist() == logits.argmax(1).tolist()
    calls.clear()
    Sampler(50, greedy_kernel=kernel)(logits.double(), greedy)  # not a layout the kernel reads
    penalised = [make_request(SamplingParams(temperature=0, repetition_penalty=1.5)) for _ in range(4)]
    Sampler(50, greedy_kernel=kernel)(logits, penalised)  # not plain greedy rows
    assert calls == []
