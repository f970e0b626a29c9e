"""Fixtures shared by the model tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def decode_launches(monkeypatch) -> list[tuple[int, bool]]:
    """Records (num_splits, native_dot) of every Triton decode launch while the test runs."""
    from cbgen.model.kernels.triton import ops as triton_ops

    seen: list[tuple[int, bool]] = []
    original = triton_ops._launch_decode

    def spy(*args):
        seen.append((args[-2], args[-1]))
        return original(*args)

    monkeypatch.setattr(triton_ops, "_launch_decode", spy)
    return seen
