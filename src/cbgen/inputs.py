"""Prompt token ids as every entry point takes them: a flat list of Python ints, or a clear error."""

from __future__ import annotations

import operator
from typing import Any


def as_token_ids(prompt: Any) -> list[int]:
    """``prompt`` (a sequence of integers: list, tuple, 1-D tensor or numpy array) as a list of ints.

    Raises ``ValueError`` for anything else: strings and bytes, bools, floats, nested lists, and
    tensors or arrays that are not 1-D (a batch of prompts passed as one prompt is a mistake, not
    something to flatten).  Vocabulary checks are the engine's (:meth:`Engine.validate`)."""
    if isinstance(prompt, (str, bytes, bytearray)):
        raise ValueError(f"expected token ids, got {type(prompt).__name__}")
    ndim = getattr(prompt, "ndim", None)
    if ndim is not None and ndim != 1:
        raise ValueError(f"a prompt tensor or array must be 1-D, got shape {tuple(prompt.shape)}")
    if hasattr(prompt, "tolist") and ndim == 1:
        prompt = prompt.tolist()
    try:
        items = list(prompt)
    except TypeError:
        raise ValueError(f"a prompt must be a sequence of token ids, got {type(prompt).__name__}") from None
    ids = []
    for t in items:
        if isinstance(t, bool):
            raise ValueError(f"prompt token id {t!r} is not an integer")
        try:
            ids.append(operator.index(t))
        except TypeError:
            raise ValueError(f"prompt token id {t!r} is not an integer") from None
    return ids
