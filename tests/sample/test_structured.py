"""Structured output in the sampler: the batch mask, the matcher bookkeeping and the backend seam.

A fake backend (allowed tokens are a pure function of how many tokens a matcher consumed) checks
the seam and the bookkeeping without a grammar library; llguidance is checked on the tiny tokenizer.
"""

from __future__ import annotations

import pytest
import torch

from cbgen.request import Request, RequestStatus
from cbgen.sample.sampler import Sampler
from cbgen.sample.structured import BACKENDS, StructuredOutputs
from cbgen.sampling_params import SamplingParams
from cbgen.structured_params import StructuredOutputParams
from extras import require_extra
from tiny_tokenizer import make_tokenizer

V = 100
EOS = (2, 7)


class _FakeMatcher:
    """Allows token ``10 + consumed`` then, after ``length`` tokens, only EOS."""

    def __init__(self, length: int) -> None:
        self.length, self.tokens, self.failed = length, [], False

    def consume(self, tokens: list[int]) -> bool:
        for t in tokens:
            if self.failed or len(self.tokens) >= self.length or t != 10 + len(self.tokens):
                self.failed = True
                return False
            self.tokens.append(t)
        return True

    def error(self) -> str:
        return "token not allowed" if self.failed else ""


class _FakeBackend:
    name = "fake"
    made = 0

    def __init__(self, tokenizer, vocab_size, eos_token_ids) -> None:
        self.eos = list(eos_token_ids)

    def compile(self, spec: StructuredOutputParams) -> int:
        if spec.kind != "regex":
            raise ValueError("fake backend: regex only")
        return len(spec.regex)

    def new_matcher(self, compiled: int) -> _FakeMatcher:
        _FakeBackend.made += 1
        return _FakeMatcher(compiled)

    def fill(self, matchers, bitmask: torch.Tensor) -> None:
        bits = torch.zeros(bitmask.shape[0], bitmask.shape[1] * 32, dtype=torch.bool)
        for m, i in matchers:
            bits[i] = False
            allowed = self.eos if len(m.tokens) >= m.length else [10 + len(m.tokens)]
            bits[i, allowed] = True
        packed = (bits.view(bits.shape[0], -1, 32).int() << torch.arange(32, dtype=torch.int32)).sum(-1)
        for _, i in matchers:
            bitmask[i] = packed[i].to(torch.int32)


@pytest.fixture
def fake():
    BACKENDS["fake"] = _FakeBackend
    yield StructuredOutputs(object(), V, EOS, backend="fake")
    del BACKENDS["fake"]


def _request(params: SamplingParams, rid: str = "r") -> Request:
    return Request(rid, [1, 3, 4], params, eos_token_ids=frozenset(EOS))


def _constrained(length: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=50, structured_output={"regex": "x" * length}, **kw)


def test_mask_follows_the_tokens_and_a_finished_grammar_allows_only_eos(fake):
    req = _request(_constrained(3))
    for step in range(3):
        logits = torch.zeros(1, V)
        fake.apply(logits, [0], [req], {})
        assert logits[0].isfinite().nonzero().flatten().tolist() == [10 + step]
        req.append_token(10 + step)
    logits = torch.zeros(1, V)
    fake.apply(logits, [0], [req], {})
    assert logits[0].isfinite().nonzero().flatten().tolist() == sorted(EOS)


def test_restart_and_rewrite_give_a_fresh_matcher(fake):
    req = _request(_constrained(5))
    fake.apply(torch.zeros(1, V), [0], [req], {})
    req.append_token(10)
    req.append_token(11)
    fake.apply(torch.zeros(1, V), [0], [req], {})
    state = req.structured_state
    assert state.consumed == 2
    req.reset_outputs()  # weight change: back to the prompt
    assert req.structured_state is None
    req.append_token(10)
    fake.apply(torch.zeros(1, V), [0], [req], {})
    assert req.structured_state is not state and req.structured_state.consumed == 1
    # Tokens rewritten behind the matcher's back (same count, other last token): replayed from scratch.
    state = req.structured_state
    req.token_ids[-1] = 11
    made, failed = _FakeBackend.made, {}
    fake.apply(torch.zeros(1, V), [0], [req], failed)
    assert _FakeBackend.made == made + 1 and req.structured_state is not state
    assert list(failed) == [0]  # and the replay finds 11 is not allowed first


def test_rejected_token_fails_the_row_and_ended_rows_are_left_alone(fake):
    bad, done = _request(_constrained(4), "bad"), _request(_constrained(4), "done")
    bad.append_token(55)
    done.status = RequestStatus.FINISHED_STOPPED
    failed: dict[int, str] = {}
    logits = torch.randn(2, V)
    before = logits.clone()
    fake.apply(logits, [0, 1], [bad, done], failed)
    assert list(failed) == [0] and "not allowed" in failed[0]
    assert torch.equal(logits, before)


@pytest.mark.parametrize("sync_free", [False, True])
def test_unconstrained_rows_bit_for_bit(fake, sync_free):
    """The same logits sampled with and without constrained neighbours: the free rows' tokens and
    all three logprobs are identical, and the constrained rows take their allowed token."""
    torch.manual_seed(0)
    logits = torch.randn(6, V) * 3
    free = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1),
        SamplingParams(temperature=1.0, seed=2, logprobs=2),
    ]
    alone = Sampler(V, structured=fake, sync_free=sync_free)(logits[:3].clone(), [_request(p) for p in free])
    reqs = [_request(p) for p in free] + [
        _request(_constrained(3, temperature=t, seed=5)) for t in (0.0, 1.0, 0.7)
    ]
    order = [3, 0, 4, 1, 5, 2]  # interleaved
    mixed = Sampler(V, structured=fake, sync_free=sync_free)(logits[order].clone(), [reqs[i] for i in order])
    for j, i in enumerate(order):
        if i >= 3:
            assert int(mixed.token_ids[j]) == 10
            continue
        assert int(mixed.token_ids[j]) == int(alone.token_ids[i])
        for name in ("logprobs", "raw_logprobs", "log_kept_mass"):
            assert torch.equal(getattr(mixed, name)[j], getattr(alone, name)[i]), name


def test_sampler_without_structured_fails_the_rows():
    out = Sampler(V)(torch.randn(2, V), [_request(SamplingParams()), _request(_constrained(2))])
    assert list(out.failed) == [1]


def test_llguidance_on_the_tiny_tokenizer_wider_logits():
    """Logits wider than the vocabulary (padding columns) are never allowed."""
    require_extra("llguidance")
    tok = make_tokenizer()
    so = StructuredOutputs(tok, 512, [2])
    req = Request("r", [5, 6], SamplingParams(structured_output={"choice": ["yes", "no"]}), frozenset({2}))
    logits = torch.zeros(1, 520)
    so.apply(logits, [0], [req], {})
    allowed = logits[0].isfinite().nonzero().flatten().tolist()
    assert allowed and all(tok.decode([t]) in ("y", "ye", "yes", "n", "no") for t in allowed), allowed
    # A cached compile: the same constraint object is not compiled twice.
    assert so.compiled(req.params.structured_output) is so.compiled(
        StructuredOutputParams(choice=["yes", "no"])
    )


def test_params_shape():
    spec = SamplingParams(structured_output={"choice": ["a", "b"]}).structured_output
    assert isinstance(spec, StructuredOutputParams) and spec.kind == "choice" and spec.choice == ("a", "b")
    assert (
        StructuredOutputParams(json={"b": 1, "a": 2}).key()
        == StructuredOutputParams(json={"a": 2, "b": 1}).key()
    )
    assert StructuredOutputParams(json_object=True).kind == "json_object"
    for bad in ({}, {"regex": ""}, {"choice": "ab"}, {"json": [1]}, {"grammar": 3}, {"foo": 1}):
        with pytest.raises(ValueError, match="structured_output"):
            SamplingParams(structured_output=bad)
    with pytest.raises(ValueError, match="structured_output"):
        SamplingParams(structured_output="json")
