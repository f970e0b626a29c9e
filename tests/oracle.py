"""The correctness oracle: compare cbgen's greedy tokens with transformers' ``generate()``.

Two computations of the same model round differently (packed vs padded batches, other kernels), so
a greedy choice between two tokens whose logits are closer than that rounding can go either way.
One kind of divergence is therefore allowed, a *near-tie*, and only under a :class:`NearTieRule`:

* the two tokens the runs disagree on are the top two of the *exact* next-token logits (the model's
  forward in float32 on the same context: the quantity both runs approximate), so cbgen's token is
  the runner-up, or the winner where the reference itself took the runner-up;
* their exact gap is within the rule's margin.  Where three or more tokens lie within the margin of
  the exact maximum, "runner-up" has no meaning at that precision: both tokens must then lie within
  it (a multi-way near-tie, recorded as such);
* at most ``rule.limit`` near-ties in one test (the counter is reset before each test by
  ``tests/conftest.py``, so several ``compare()`` calls in one test share it).

After a divergence the check goes on: ``generate()`` is fed cbgen's tokens up to and including the
diverging one and continues from there, and cbgen's remaining tokens are held to that continuation,
so every token of the run under test is checked (a second divergence is a second near-tie).

Rules: :data:`FP32` (relative gap < 1e-5, at most one per test) and :data:`BF16` (see
:func:`bf16_tolerance` for the margin and :data:`BF16_NEAR_TIE_SHARE` for the bound).  :data:`BF16`
compares two bf16 computations with each other (the fused against the module path); bf16 results
are held to the exact reference, the float32 forward of the same weights, by
``tests/bf16_reference.py`` under a bound derived from bf16 rounding.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

NEAR_TIE = 1e-5
# bf16 keeps 8 significant bits: one ulp of x is 2**(floor(log2|x|) - 7).
BF16_MANTISSA_BITS = 8
# The bf16 tolerance in ulps of the row's largest |logit|; see bf16_tolerance().
BF16_ULPS = 8
# bf16 keeps 8 bits, and a random tiny model's exact top-2 gap is within 2 ulps at ~10% of its
# greedy steps (measured on the 8 architectures), so a bound of one per test would fail on correct
# code: 1-2% of the tiny models' bf16 tokens were near-ties, 3-6% of a 256-wide Llama's.  They may
# be at most this share of a test's checked tokens instead, each still verified one by one.
BF16_NEAR_TIE_SHARE = 0.1


@dataclass(frozen=True)
class NearTieRule:
    """When a divergence from ``generate()`` is allowed: ``margin(logits)`` is the largest exact
    top-2 gap (float32 next-token logits of one position) that counts as a tie; ``limit(checked)``
    the most near-ties one test may have after checking ``checked`` tokens."""

    name: str
    margin: Callable[[torch.Tensor], float]
    limit: Callable[[int], int]


@dataclass
class NearTie:
    """One allowed divergence, recorded for the test's report."""

    prompt: int
    position: int
    cbgen: int
    reference: int
    gap: float
    margin: float
    ways: int  # tokens within the margin of the exact maximum (2: a plain near-tie)


def bf16_ulp(x: float) -> float:
    """The spacing of bf16 numbers at ``|x|`` (its unit in the last place)."""
    x = abs(x)
    if x == 0 or not math.isfinite(x):
        return 0.0
    return 2.0 ** (math.floor(math.log2(x)) - (BF16_MANTISSA_BITS - 1))


def bf16_tolerance(logits: torch.Tensor) -> float:
    """Largest difference allowed between two bf16 computations of a logprob of one position, and
    the near-tie margin of :data:`BF16`: ``BF16_ULPS`` (8) ulps of the row's largest ``|logit|``.

    Why it scales with that ulp: a logprob is ``z_t - logsumexp(z)``, and each computation ends with
    the LM head's output rounded to bf16, half an ulp on ``z_t`` and at most half an ulp through
    logsumexp (it moves by at most the largest change of its inputs): one ulp of the largest logit
    per computation, two for a pair.  Everything before the LM head is bf16 too (rounded after each
    residual add, norm and projection, with sums in other orders in each computation), and moves
    the logits by the same order again; measured, the whole difference reached 3.0 ulps on the 7 dense
    tiny architectures and the fused vs module path, 6.4 on Qwen3-MoE, whose expert routing can flip
    where two router logits are that close (``tests/test_bf16_oracle.py``,
    ``tests/model/test_fused_decode.py`` print it), on a CPU without AVX-512.  AVX-512 and AMX
    kernels add in other orders still, so the tolerance is 8 ulps, not 4.
    """
    return BF16_ULPS * bf16_ulp(float(logits.float().abs().max()))


FP32 = NearTieRule(
    "fp32",
    margin=lambda z: NEAR_TIE * float(z.float().max().abs().clamp_min(1e-6)),
    limit=lambda checked: 1,
)
BF16 = NearTieRule(
    "bf16",
    margin=bf16_tolerance,
    limit=lambda checked: max(1, int(BF16_NEAR_TIE_SHARE * checked)),
)

_seen: list[NearTie] = []
_checked = [0]


def reset_near_ties() -> None:
    """Starts a new test's near-tie count (called by an autouse fixture in ``tests/conftest.py``)."""
    _seen.clear()
    _checked[0] = 0


def near_ties_seen() -> list[NearTie]:
    """The near-ties the current test has had so far."""
    return list(_seen)


def hf_greedy(model, prompt: list[int], max_new_tokens: int, ignore_eos: bool = True) -> list[int]:
    """``model.generate()`` greedy continuation of one prompt (no padding involved)."""
    if max_new_tokens <= 0:
        return []
    gc = copy.deepcopy(model.generation_config)
    if ignore_eos:
        gc.eos_token_id = []
    gc.max_new_tokens = max_new_tokens
    gc.do_sample = False
    gc.temperature = None
    gc.top_p = None
    gc.top_k = None
    ids = torch.tensor([prompt], device=model.device)
    # An explicit all-ones mask: without it generate() infers one from pad_token_id, and SmolLM2's pad
    # token (<|im_end|>, id 2) occurs inside every chat prompt, so generate() would mask it out.
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    return out[0, len(prompt) :].tolist()


def next_logits(model, tokens: list[int]) -> torch.Tensor:
    """float32 next-token logits of ``model`` after ``tokens`` (one plain forward)."""
    with torch.no_grad():
        return model(torch.tensor([tokens], device=model.device)).logits[0, -1].float().cpu()


def top2_gap(model, tokens: list[int]) -> float:
    """Relative gap between the two largest next-token logits after ``tokens``."""
    top = next_logits(model, tokens).topk(2).values
    return float((top[0] - top[1]).abs() / top[0].abs().clamp_min(1e-6))


def exact_model(model):
    """The model whose float32 forward gives the exact logits: itself in float32, else a float32
    copy (the weights as they are; only the arithmetic is exact)."""
    dtype = next(model.parameters()).dtype
    return model if dtype == torch.float32 else copy.deepcopy(model).float()


def check_divergence(
    exact, context: list[int], cbgen: int, reference: int, rule: NearTieRule = FP32
) -> tuple[float, float, int]:
    """Asserts that choosing ``cbgen`` instead of ``reference`` after ``context`` is a near-tie under
    ``rule`` (``exact``: see :func:`exact_model`); returns ``(gap, margin, ways)``: the exact gap
    between the two tokens, the margin, and how many tokens lie within the margin of the maximum."""
    z = next_logits(exact, context)
    margin = rule.margin(z)
    top = z.max()
    # Within the margin of the maximum: the top two for a plain near-tie, more for a multi-way one,
    # so "both within it" is "the exact top two" whenever the runner-up is well defined.
    tied = (top - z <= margin).nonzero().squeeze(1).tolist()
    gap = float((z[cbgen] - z[reference]).abs())
    rank = int((z > z[cbgen]).sum()) + 1
    assert {cbgen, reference} <= set(tied), (
        f"after {len(context)} tokens: cbgen {cbgen} vs generate() {reference} is not a near-tie under "
        f"the {rule.name} rule: cbgen's token ranks {rank}, {float(top - z[cbgen]):.3g} below the "
        f"exact maximum, generate()'s {float(top - z[reference]):.3g} below (margin {margin:.3g})"
    )
    return gap, margin, len(tied)


def compare(
    model, prompts: list[list[int]], got: list[list[int]], refs: list[list[int]], rule: NearTieRule = FP32
) -> int:
    """Asserts that ``got`` equals ``refs`` except at near-ties allowed by ``rule`` (module docstring);
    returns the number of near-ties this call found."""
    exact = None
    before = len(_seen)
    _checked[0] += sum(len(a) for a in got)
    limit = rule.limit(_checked[0])
    for i, (prompt, a, b) in enumerate(zip(prompts, got, refs, strict=True)):
        assert len(a) == len(b), f"prompt {i}: {len(a)} tokens, generate() made {len(b)}"
        context, start = list(prompt), 0
        while a[start:] != b:
            j = start + next(k for k in range(len(b)) if a[start + k] != b[k])
            if exact is None:
                exact = exact_model(model)
            gap, margin, ways = check_divergence(exact, context + a[start:j], a[j], b[j - start], rule)
            _seen.append(NearTie(i, j, a[j], b[j - start], gap, margin, ways))
            print(
                f"near-tie ({rule.name}): prompt {i} token {j} gap {gap:.2e} (margin {margin:.2e}, {ways}-way)"
            )
            assert len(_seen) <= limit, f"{len(_seen)} near-ties in one test, more than {limit}: {_seen}"
            # generate() continues from cbgen's own tokens, so the rest of the run is still checked.
            context += a[start : j + 1]
            start = j + 1
            b = hf_greedy(model, context, len(a) - start)
    return len(_seen) - before
