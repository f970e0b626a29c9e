"""A dropped LLM hands the C allocator's free pages back to the OS (issue #47).

After ``del llm`` no tensor was alive, but glibc kept the freed heap for reuse: a process with
SmolLM2 stayed ~0.9 GB above its size before the LLM until ``malloc_trim(0)``.  These tests check
that the trim happens, once, after what the LLM held is gone (a trim before that returns nothing),
and that it asks glibc for exactly that; the RSS numbers themselves are measured, not tested.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

import cbgen.llm
from cbgen import LLM, SamplingParams
from tiny_models import make_model, make_prompts

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _trims(monkeypatch: pytest.MonkeyPatch, gone: list[weakref.ref]) -> list[bool]:
    """Replaces the trim with a probe: each call records whether every ``gone`` was already freed."""
    calls: list[bool] = []
    monkeypatch.setattr(cbgen.llm, "return_free_memory", lambda: calls.append(all(r() is None for r in gone)))
    return calls


@pytest.mark.parametrize("owned", [False, True], ids=["caller's model", "loaded model"])
def test_a_dropped_llm_trims_after_what_it_held_is_freed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, owned: bool
) -> None:
    """The engine and its KV cache, and a model the LLM loaded itself, are freed before the trim; a
    caller's model (shared with a trainer) is left alone."""
    model = make_model("llama")
    if owned:
        model.save_pretrained(tmp_path / "tiny")
    gc.collect()
    gc.disable()
    try:
        llm = LLM(str(tmp_path / "tiny") if owned else model, block_size=8, num_blocks=64)
        assert len(llm.generate(make_prompts(2, lengths=(5, 9), seed=3), GREEDY, use_tqdm=False)) == 2
        gone = [weakref.ref(llm.engine), weakref.ref(llm.engine.kv_cache.layers[0][0])]
        if owned:
            gone.append(weakref.ref(llm.model))
        calls = _trims(monkeypatch, gone)
        del llm
        assert calls == [True], "no trim, or a trim while the LLM's memory was still held"
    finally:
        gc.enable()
    assert next(model.parameters()).abs().sum() > 0  # the caller's model is intact


def test_the_trim_is_glibcs_malloc_trim_of_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []

    class Libc:
        def malloc_trim(self, pad: int) -> int:
            asked.append(pad)
            return 1

    monkeypatch.setattr(cbgen.llm, "_libc", Libc)
    cbgen.llm.return_free_memory()
    assert asked == [0]  # pad 0: keep nothing free at the top of the heap


def test_no_malloc_trim_is_no_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A C library without ``malloc_trim`` (musl, macOS): nothing to ask, and no error."""
    monkeypatch.setattr(cbgen.llm, "_libc", lambda: object())
    cbgen.llm.return_free_memory()
