"""The oracle's near-tie rule can fail: each of its conditions rejects a run that breaks only it.

Runs are built by hand from ``generate()``'s own tokens, with one token replaced, so each test knows
exactly which condition is at stake.  ``TOP_TWO`` puts its margin between the second and the third
exact logit of every row, so the runner-up is a near-tie there and nothing else is: that isolates
the runner-up, continuation and budget conditions from the size of the real rules' margins.
"""

from __future__ import annotations

import pytest

import oracle
from oracle import FP32, NearTieRule, compare, hf_greedy, next_logits
from tiny_models import make_model, make_prompts

NEW = 10


def _between_second_and_third(z) -> float:
    top = z.topk(3).values
    return float(top[0] - (top[1] + top[2]) / 2)


TOP_TWO = NearTieRule("top-two", margin=_between_second_and_third, limit=lambda checked: 1)


@pytest.fixture(scope="module")
def case():
    model = make_model("llama")
    prompts = make_prompts(2, lengths=(6, 30), seed=3)
    return model, prompts, [hf_greedy(model, p, NEW) for p in prompts]


def _diverge(model, prompt: list[int], ref: list[int], at: int, rank: int) -> list[int]:
    """A run equal to the reference up to ``at``, which then takes the token of ``rank`` (1 = best)
    in the exact logits and continues greedily from there (as an engine would)."""
    token = next_logits(model, prompt + ref[:at]).topk(rank).indices[-1].item()
    return [*ref[:at], token, *hf_greedy(model, prompt + ref[:at] + [token], NEW - at - 1)]


def test_identical_runs_have_no_near_ties(case) -> None:
    model, prompts, refs = case
    assert compare(model, prompts, refs, refs) == 0


def test_runner_up_is_allowed_within_the_margin(case) -> None:
    model, prompts, refs = case
    run = _diverge(model, prompts[0], refs[0], 3, rank=2)
    assert compare(model, prompts[:1], [run], refs[:1], rule=TOP_TWO) == 1
    (tie,) = oracle.near_ties_seen()
    assert (tie.position, tie.cbgen, tie.reference) == (3, run[3], refs[0][3])


def test_margin_is_enforced(case) -> None:
    """The same runner-up divergence is no near-tie under the fp32 margin (a real gap)."""
    model, prompts, refs = case
    run = _diverge(model, prompts[0], refs[0], 3, rank=2)
    with pytest.raises(AssertionError, match="not a near-tie under the fp32 rule"):
        compare(model, prompts[:1], [run], refs[:1], rule=FP32)


def test_only_the_runner_up(case) -> None:
    model, prompts, refs = case
    run = _diverge(model, prompts[0], refs[0], 3, rank=3)
    with pytest.raises(AssertionError, match="cbgen's token ranks 3"):
        compare(model, prompts[:1], [run], refs[:1], rule=TOP_TWO)


def test_checking_goes_on_after_a_divergence(case) -> None:
    """A wrong token after an allowed near-tie is caught: generate() continues from the run's own
    tokens, so the rest of the run is still held to it."""
    model, prompts, refs = case
    run = _diverge(model, prompts[0], refs[0], 2, rank=2)
    wrong = [*run[:6], _diverge(model, prompts[0] + run[:6], run[6:], 0, rank=3)[0], *run[7:]]
    with pytest.raises(AssertionError, match="cbgen's token ranks 3"):
        compare(model, prompts[:1], [wrong], refs[:1], rule=TOP_TWO)


def test_at_most_one_per_test(case) -> None:
    """Two near-ties in one test fail, also when they come from two compare() calls."""
    model, prompts, refs = case
    runs = [_diverge(model, p, r, 4, rank=2) for p, r in zip(prompts, refs)]
    with pytest.raises(AssertionError, match="2 near-ties in one test, more than 1"):
        compare(model, prompts, runs, refs, rule=TOP_TWO)
    oracle.reset_near_ties()
    compare(model, prompts[:1], runs[:1], refs[:1], rule=TOP_TWO)
    with pytest.raises(AssertionError, match="more than 1"):
        compare(model, prompts[1:], runs[1:], refs[1:], rule=TOP_TWO)


def test_lengths_and_pairing_are_checked(case) -> None:
    model, prompts, refs = case
    with pytest.raises(AssertionError, match="tokens, generate"):
        compare(model, prompts[:1], [refs[0][:-1]], refs[:1])
    with pytest.raises(ValueError):
        compare(model, prompts, refs[:1], refs[:1])  # a prompt without an output
