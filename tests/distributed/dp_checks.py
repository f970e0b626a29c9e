"""Checks of a data-parallel run on what each rank's own engine ran (before the all-gather merged
the outputs), so the test can tell a real split from every rank generating everything."""

from __future__ import annotations


def check_dp_share(share: dict, max_tokens: int) -> dict[int, list]:
    """One rank's record (``worker.scenario_dp``): the prompt indices its engine took, the outputs its
    own ``generate`` returned and its generated-token count.  Returns ``{prompt index: tokens}``."""
    local = {int(i): toks for i, toks in share["local"].items()}  # JSON turned the keys into strings
    added = share["added"]
    assert len(added) == len(set(added)), f"the engine took a prompt twice: {added}"
    assert sorted(added) == sorted(local), f"engine took {added}, generate returned {sorted(local)}"
    # Greedy with ignore_eos: every request runs to max_tokens, so the engine's own counter says how
    # many requests it generated, independently of the spies.
    assert share["generated_tokens"] == max_tokens * len(added), share
    return local


def check_dp_split(shares: list[dict[int, list]], alone: list) -> None:
    """The ranks' shares are disjoint, non-empty, cover every prompt, and their union equals one
    engine's outputs on all prompts."""
    seen: dict[int, list] = {}
    for rank, share in enumerate(shares):
        assert share, f"rank {rank} generated nothing"
        overlap = seen.keys() & share.keys()
        assert not overlap, f"prompts {sorted(overlap)} generated on more than one rank"
        seen.update(share)
    assert sorted(seen) == list(range(len(alone))), f"prompts covered: {sorted(seen)}"
    assert [seen[i] for i in range(len(alone))] == alone
