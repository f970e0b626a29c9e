"""Shared fixtures.

The real SmolLM2-135M-Instruct model is converted from its bundled GGUF once, into the default
location (``$CBGEN_MODEL_DIR`` or the user cache), so every test module and every later run
reuses the same folder instead of paying for the conversion again.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Triton decides between compiling and interpreting when a kernel is first decorated, and other
# tests (torch.compile) may import triton before the kernel tests do.  CI has no GPU, so every
# Triton kernel in this process must run in the interpreter: decide it before anything imports triton.
if os.environ.get("CBGEN_TEST_CUDA") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """Folder holding the converted SmolLM2-135M-Instruct model (float32 safetensors + tokenizer)."""
    from cbgen.model.loader import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def default_model_path(smollm2_path: Path) -> Path:
    """Alias of ``smollm2_path``: the default model folder that ``load_model(None)`` uses."""
    return smollm2_path
