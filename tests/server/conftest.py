"""Fixtures of the server tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def model_path(request) -> Path:
    try:
        return request.getfixturevalue("smollm2_path")
    except pytest.FixtureLookupError:
        from cbgen.model.loading.loader import ensure_default_model

        return ensure_default_model()
