"""Shared fixtures.

The real SmolLM2-135M-Instruct model is converted from its bundled GGUF once, into the default
location (``$CBGEN_MODEL_DIR`` or the user cache), so every test module and every later run
reuses the same folder instead of paying for the conversion again.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """Folder holding the converted SmolLM2-135M-Instruct model (float32 safetensors + tokenizer)."""
    from cbgen.model.loader import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def default_model_path(smollm2_path: Path) -> Path:
    """Alias of ``smollm2_path``: the default model folder that ``load_model(None)`` uses."""
    return smollm2_path
