"""bf16 results held to the float32 reference of the same weights, under a bound derived from bf16
rounding (not tuned from a run).

The reference is the model's forward in float32 on weights that are already bf16 values
(:func:`oracle.exact_model`): the quantity every bf16 computation of the model approximates.  A bf16
forward differs from it only by the rounding of intermediate results to bf16; two bf16 computations
(``generate()`` and cbgen) round at different places, so neither is the other's reference.

**The rounding model** (first order, as in Higham & Mary, "A new approach to probabilistic rounding
error analysis", SIAM J. Sci. Comput. 2019).  Each rounding of a value ``a`` to bf16 gives
``a (1 + d)`` with ``|d| <= u = 2**-8`` (bf16 keeps 8 significant bits, round to nearest), and for
values whose low bits are not special ``d`` has mean 0 and variance at most ``u**2 / 3`` (the
absolute error is uniform in half an ulp), independently of the other roundings.

**What one logprob can move by.**  To first order, a logprob ``l_t = z_t - logsumexp(z)`` of the
logits ``z = W h`` (``h``: the LM head's input, ``W``: its weight) moves by

* ``(w_t - w_bar) . dh``, where ``w_bar = sum_j p_j w_j`` (``p = softmax(z)``) and ``dh`` the error
  of ``h``.  ``R`` roundings along the forward (counted by :func:`rounding_count`) each perturb the
  residual stream by a relative error of variance ``u**2 / 3``; assuming a unit gain from where a
  rounding happens to ``h`` (pre-norm residual stacks are scale-invariant in their branch inputs),
  ``h_i`` carries relative variance ``R u**2 / 3``, so this term has variance
  ``R u**2 / 3 * S_t**2`` with ``S_t = ||(w_t - w_bar) * h||_2``: the standard scale of a dot product
  with relatively perturbed inputs;
* the bf16 rounding of the logits themselves, ``z_j (1 + d_j)``: the logprob moves by
  ``d_t z_t - sum_j p_j d_j z_j``, of variance ``u**2 / 3 * ((1 - p_t)**2 z_t**2 + sum_(j != t)
  p_j**2 z_j**2)``.

So ``sigma_t**2`` is the sum of the two variances.  Two checks follow:

* **each value** within ``TAIL * GAIN * sigma_t``.  ``TAIL = 6.5``: the error is a sum of many small
  independent terms, so by Bernstein's inequality a value is off by more than ``TAIL`` standard
  deviations with probability at most ``2 exp(-TAIL**2 / 2)``, 1.3e-9: under ``1e-4`` for the
  ~1e5 values the whole suite checks.  ``GAIN = 2`` allows first-order errors to grow up to 2x
  between where they arise and the logits (the unit gain above is an assumption, not a theorem);
* **the root mean square** of all differences of one run within ``GAIN`` times the root mean square
  of the ``sigma_t``: the tight check.  A systematic error ``b`` (a bf16-only bug that shifts many
  values) adds in quadrature and fails it once ``b`` exceeds about ``2 sigma``, ~0.05 nats on the
  wide test models, where a single value is only bounded to ``13 sigma``.

The constants come from this argument, not from runs; the tests print how close each run comes
(on the tiny models: the largest difference at 0.1-0.35 of its bound, the RMS at 0.25-0.5 of its).

Greedy tokens are checked the same way, on the logits: where cbgen's token is not the reference's
argmax ``m``, ``z_m - z_token`` must be within the sum of the two logits' bounds (each with
``S = ||w * h||_2``); every divergence is checked this way, none is exempt.

Mixture-of-experts routing is not continuous: where two router logits are within rounding of each
other, two computations pick different experts, and no rounding bound holds after that.  bf16 tests
of such a model route every token to every expert (``num_experts_per_tok = num_experts``), which
keeps the routing weights continuous; top-k routing itself is held to ``generate()`` in float32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from oracle import exact_model

UNIT_ROUNDOFF = 2.0**-8  # u of bf16: 8 significant bits, round to nearest
TAIL = 6.5  # standard deviations a single value may reach (module docstring)
GAIN = 2.0  # growth allowed for first-order errors between where they arise and the logits

# Aten ops whose bf16 result is exact: they move, select or copy values (or make constants) without
# arithmetic.  Every other op with a bf16 result counts as one rounding (unknown ops included, so
# the count errs on the large side).
_EXACT_OPS = frozenset(
    {
        "_unsafe_view",
        "alias",
        "as_strided",
        "cat",
        "clone",
        "contiguous",
        "copy_",
        "detach",
        "embedding",
        "empty",
        "empty_like",
        "expand",
        "fill_",
        "full",
        "gather",
        "index",
        "index_select",
        "lift_fresh",
        "masked_fill",
        "max",
        "neg",
        "new_empty",
        "new_zeros",
        "ones",
        "permute",
        "repeat",
        "scalar_tensor",
        "select",
        "slice",
        "sort",
        "split",
        "split_with_sizes",
        "squeeze",
        "stack",
        "t",
        "topk",
        "transpose",
        "unbind",
        "unsqueeze",
        "view",
        "where",
        "zeros",
        "zeros_like",
    }
)


class _RoundingCounter(TorchDispatchMode):
    """Counts the aten ops that produce a bf16 tensor by arithmetic (see :data:`_EXACT_OPS`)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        bf16 = any(isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16 for o in outs)
        if bf16 and func.overloadpacket.__name__ not in _EXACT_OPS:
            self.count += 1
        return out


def rounding_count(model: torch.nn.Module) -> int:
    """``R``: how many results the model's own bf16 forward rounds to bf16 for one token, every
    branch counted (q, k and v each; all experts of a mixture).  cbgen's fused kernels round fewer
    times (one rounding for a fused residual add + RMSNorm), so this counts the longer of the two
    paths."""
    with torch.no_grad(), _RoundingCounter() as counter:
        model(torch.tensor([[3]], device=model.device))
    return counter.count


@dataclass
class Bf16Report:
    """What :func:`check_against_fp32` found over one run: values checked, the largest difference in
    units of its own bound, the RMS of the differences against its bound, and the greedy tokens that
    were not the reference's argmax (each within its bound)."""

    values: int
    worst: float  # max |difference| / bound, <= 1
    rms: float
    rms_bound: float
    divergences: int
    roundings: int

    def __str__(self) -> str:
        return (
            f"{self.values} logprobs (R={self.roundings} roundings): largest difference "
            f"{self.worst:.2f} of its bound; RMS {self.rms:.4f} (bound {self.rms_bound:.4f}); "
            f"{self.divergences} greedy tokens off the float32 argmax, each within its bound"
        )


@dataclass
class _Accumulator:
    values: int = 0
    worst: float = 0.0
    squares: float = 0.0
    sigma_squares: float = 0.0
    divergences: int = 0


def _sigma(roundings: int, scale: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """Standard deviation of a value's error under the model (module docstring): ``scale`` the ``S``
    of each value, ``final`` the sum of squares its final rounding weighs ``d_j`` with."""
    return UNIT_ROUNDOFF * torch.sqrt((roundings * scale**2 + final) / 3)


def _check_step(acc: _Accumulator, roundings: int, z, h, weight, token: int, logprobs: dict[int, float]):
    """One generated position: ``z`` float64 reference logits, ``h`` the LM head's input, ``weight``
    its weight; ``logprobs`` cbgen's values by token (the sampled one and the top ones)."""
    p = torch.softmax(z, -1)
    ref = torch.log_softmax(z, -1)
    ids = torch.tensor(list(logprobs))
    scale = ((weight[ids] - p @ weight) * h).norm(dim=1)
    # (1 - p_t)^2 z_t^2 + sum_(j != t) p_j^2 z_j^2, from the sum over all j
    final = (1 - p[ids]) ** 2 * z[ids] ** 2 + float((p**2 * z**2).sum()) - p[ids] ** 2 * z[ids] ** 2
    sigma = _sigma(roundings, scale, final)
    diff = torch.tensor([logprobs[t] for t in ids.tolist()], dtype=torch.float64) - ref[ids]
    bound = TAIL * GAIN * sigma
    worst = int((diff.abs() / bound).argmax())
    assert bool((diff.abs() <= bound).all()), (
        f"logprob of token {int(ids[worst])} differs from the float32 reference by "
        f"{float(diff[worst]):.4f}, past its derived bound {float(bound[worst]):.4f}"
    )
    acc.values += len(ids)
    acc.worst = max(acc.worst, float((diff.abs() / bound).max()))
    acc.squares += float((diff**2).sum())
    acc.sigma_squares += float((sigma**2).sum())
    best = int(z.argmax())
    if token != best:
        pair = torch.tensor([token, best])
        logit_bound = TAIL * GAIN * _sigma(roundings, (weight[pair] * h).norm(dim=1), z[pair] ** 2)
        gap = float(z[best] - z[token])
        assert gap <= float(logit_bound.sum()), (
            f"greedy token {token} is {gap:.4f} below the float32 argmax {best}, past the derived "
            f"bound {float(logit_bound.sum()):.4f}"
        )
        acc.divergences += 1


def check_against_fp32(model: torch.nn.Module, prompts: Sequence[list[int]], outputs) -> Bf16Report:
    """Asserts that cbgen's bf16 greedy ``outputs`` (``CompletionOutput`` with ``logprobs=k``, one per
    prompt) agree with the float32 reference of ``model``'s bf16 weights under the derived bound
    (module docstring), teacher-forced on cbgen's own tokens; returns the numbers."""
    roundings = rounding_count(model)
    exact = exact_model(model)
    captured: list[torch.Tensor] = []
    hook = exact.lm_head.register_forward_pre_hook(lambda m, args: captured.append(args[0]))
    weight = exact.lm_head.weight.detach().double()
    acc = _Accumulator()
    try:
        for prompt, out in zip(prompts, outputs, strict=True):
            tokens = list(out.token_ids)
            assert len(out.raw_logprobs) == len(out.top_logprobs) == len(tokens)
            captured.clear()
            with torch.no_grad():
                logits = exact(torch.tensor([prompt + tokens])).logits[0].double()
            start = len(prompt) - 1
            hidden = captured[0][0].double()
            for step, (token, raw, top) in enumerate(zip(tokens, out.raw_logprobs, out.top_logprobs)):
                values = {**top, token: raw}
                pos = start + step
                _check_step(acc, roundings, logits[pos], hidden[pos], weight, token, values)
    finally:
        hook.remove()
    rms = math.sqrt(acc.squares / max(acc.values, 1))
    rms_bound = GAIN * math.sqrt(acc.sigma_squares / max(acc.values, 1))
    report = Bf16Report(acc.values, acc.worst, rms, rms_bound, acc.divergences, roundings)
    assert rms <= rms_bound, f"RMS difference from the float32 reference past its derived bound: {report}"
    return report
