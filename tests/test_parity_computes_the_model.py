"""Parity mode computes the model, not only the same bits on both sides.

``tests/test_parity.py`` holds the engine's logprobs to the trainer's forward under ``cbgen.parity``
bit for bit.  Both sides run parity mode's kernels, so a kernel that dropped a bias or ignored a norm
weight on both sides would pass it.  Here each form of the kernels (``CBGEN_PARITY_KERNELS``: the C
kernels, the torch forms, Triton under its interpreter) is held to the model itself: the trainer's
parity forward is close to the plain forward, and the engine's greedy tokens in parity mode equal
``generate()`` under the float32 oracle.  The test models' biases and norm weights are perturbed
(``tests/tiny_models.py``), so a dropped one changes the logits; the control drops the biases of
parity mode's products and checks that the comparison then fails.
"""

from __future__ import annotations

import pytest
import torch

import cbgen
from cbgen import LLM, SamplingParams
from cbgen.batch_invariant import dispatch
from cbgen.batch_invariant.native import parity_form
from extras import require_extra
from oracle import compare, hf_greedy
from tiny_models import ARCHS, make_model, make_prompts

FORMS = ("c", "torch", "triton")
# The logits of a parity forward and of the plain forward differ by the rounding of other summation
# orders (about 1e-6 here); a dropped bias moves them by more than 1e-2 (the control below).
CLOSE = {"rtol": 1e-4, "atol": 1e-4}


def _use_form(form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forces parity mode's kernels to ``form`` for float32 CPU tensors (skips where it cannot run)."""
    if form == "triton":
        require_extra("triton")
        from cbgen.model.kernels.triton.ops import _interpreting

        if not _interpreting():
            pytest.skip("the Triton form runs on CPU tensors only under the interpreter")
    if form == "c" and parity_form(torch.device("cpu"), torch.float32) != "c":
        pytest.skip("no C parity kernels on this machine")
    monkeypatch.setenv("CBGEN_PARITY_KERNELS", form)
    assert parity_form(torch.device("cpu"), torch.float32) == form


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows, the shorter left-padded, and their attention mask."""
    short, long = make_prompts(2, (9, 17), vocab=vocab, seed=5)
    ids = torch.zeros(2, len(long), dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[0, -len(short) :], mask[0, -len(short) :] = torch.tensor(short), 1
    ids[1], mask[1] = torch.tensor(long), 1
    return ids, mask


def _logits_both_ways(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(parity forward's logits, plain forward's, mask) of :func:`_batch`."""
    ids, mask = _batch(model.config.vocab_size)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        plain = model(ids, attention_mask=mask, position_ids=positions).logits
        with cbgen.parity(model):
            parity = model(ids, attention_mask=mask).logits
    return parity, plain, mask


def _cases() -> list:
    # Every architecture on the C kernels; on the slower forms, the two whose vectors are biases
    # (Qwen2) and q/k norms besides the layer norms (Qwen3).
    return [
        pytest.param(form, arch, id=f"{form}-{arch}")
        for form in FORMS
        for arch in (ARCHS if form == "c" else ("qwen2", "qwen3"))
    ]


@pytest.mark.parametrize(("form", "arch"), _cases())
def test_the_parity_forward_is_the_models_forward(form: str, arch: str, monkeypatch) -> None:
    _use_form(form, monkeypatch)
    model = make_model(arch)
    parity, plain, mask = _logits_both_ways(model)
    real = mask.bool()
    torch.testing.assert_close(parity[real], plain[real], **CLOSE)


@pytest.mark.parametrize("form", FORMS)
def test_parity_mode_greedy_tokens_equal_generate(form: str, monkeypatch) -> None:
    """The engine in parity mode, on Qwen2 (q/k/v biases): its own forward on the C kernels (the
    direct forward), the module forward under the dispatch mode on the others."""
    _use_form(form, monkeypatch)
    model = make_model("qwen2")
    prompts = make_prompts(3 if form == "triton" else 6, (4, 30), vocab=model.config.vocab_size, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(model, block_size=8, num_blocks=64, max_num_batched_tokens=32, batch_invariant=True)
    assert llm.engine.plan.forward == ("direct" if form == "c" else "module")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    compare(model, prompts, got, [hf_greedy(model, p, params.max_tokens) for p in prompts])


def test_control_a_linear_that_drops_its_bias_is_caught(monkeypatch) -> None:
    """The comparison above can fail: with parity mode's products dropping the bias (``linear``,
    which reaches the mode whole under inference mode, and ``addmm``, which it decomposes into
    otherwise), on both sides of the bit-for-bit check, so that check would still pass, the parity
    forward of Qwen2 is no longer close to the plain forward."""
    real_linear, real_addmm = dispatch._linear, dispatch._addmm

    def linear_without_bias(packs, x, weight, bias=None):
        return real_linear(packs, x, weight)

    def addmm_without_bias(packs, base, a, b, *, beta=1, alpha=1):
        return real_addmm(packs, base, a, b, beta=0, alpha=alpha)

    monkeypatch.setitem(dispatch._HANDLERS, torch.ops.aten.linear.default, linear_without_bias)
    monkeypatch.setitem(dispatch._HANDLERS, torch.ops.aten.addmm.default, addmm_without_bias)
    parity, plain, mask = _logits_both_ways(make_model("qwen2"))
    real = mask.bool()
    assert (parity[real] - plain[real]).abs().max() > 100 * CLOSE["atol"]
