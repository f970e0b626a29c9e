"""The data-parallel split checks reject the failures they exist for (no torchrun needed)."""

from __future__ import annotations

import pytest
from dp_checks import check_dp_share, check_dp_split

ALONE = [[[1, 2]], [[3, 4]], [[5, 6]]]


def _share(indices: list[int], max_tokens: int = 2) -> dict:
    local = {str(i): ALONE[i] for i in indices}
    return {"added": indices, "local": local, "generated_tokens": max_tokens * len(indices)}


def test_a_disjoint_covering_split_passes():
    check_dp_split([check_dp_share(_share([0, 2]), 2), check_dp_share(_share([1]), 2)], ALONE)


@pytest.mark.parametrize(
    "shares",
    [
        [[0, 1, 2], [0, 1, 2]],  # every rank generated everything (the old test passed this)
        [[0, 1, 2], []],  # one rank did all the work
        [[0], [1]],  # a prompt nobody generated
    ],
)
def test_a_bad_split_fails(shares):
    with pytest.raises(AssertionError):
        check_dp_split([check_dp_share(_share(s), 2) for s in shares], ALONE)


def test_a_wrong_output_fails():
    bad = _share([1])
    bad["local"]["1"] = [[9, 9]]
    with pytest.raises(AssertionError):
        check_dp_split([check_dp_share(_share([0, 2]), 2), check_dp_share(bad, 2)], ALONE)


def test_an_engine_that_ran_more_than_it_returned_fails():
    extra = _share([1])
    extra["generated_tokens"] += 2
    with pytest.raises(AssertionError):
        check_dp_share(extra, 2)
