"""bf16 held to the oracle on every supported architecture.

The reference is the float32 forward of the same (bf16) weights, teacher-forced on cbgen's own
tokens: the quantity every bf16 computation approximates (``generate()`` in bf16 rounds at other
places by design, so it is not one).  ``tests/bf16_reference.py`` derives the bound from bf16
rounding and states it:

* every step's logprobs (the sampled token's raw logprob and the top-3) each within ``13 sigma``
  of the float32 value, ``sigma`` the standard deviation of its rounding error under the first-order
  rounding model, and the root mean square of all differences of the run within ``2 sigma``;
* every greedy token that is not the float32 argmax within the two logits' bounds of it.  No share
  of tokens is exempt, and the mixture-of-experts model routes every token to every expert, which
  keeps it continuous (the docstring there says why).

``tests/test_wide_exactness.py`` applies the same check to wide models through every GEMM candidate.
Each test prints its numbers.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from bf16_reference import check_against_fp32
from cbgen import LLM, SamplingParams
from tiny_models import ARCHS, make_model, make_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUM_PROMPTS, NEW_TOKENS = 10, 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)


def _model(arch: str) -> torch.nn.Module:
    _, extra = ARCHS[arch]
    dense = {"num_experts_per_tok": extra["num_experts"]} if "num_experts" in extra else {}
    return make_model(arch, dtype=torch.bfloat16, **dense)


def _generate(model) -> tuple[list[list[int]], list]:
    prompts = make_prompts(NUM_PROMPTS, lengths=(3, 90))
    outs = LLM(model, block_size=8).generate(prompts, GREEDY, use_tqdm=False)
    return prompts, [o.outputs[0] for o in outs]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_bf16_greedy_and_logprobs_match_generate(arch: str) -> None:
    model = _model(arch)
    prompts, outs = _generate(model)
    print(f"\n{arch} bf16: {check_against_fp32(model, prompts, outs)}")


@pytest.fixture(scope="module")
def llama_run():
    model = _model("llama")
    return (model, *_generate(model))


def _perturbed(outs, change) -> list:
    """Copies of ``outs`` whose logprobs went through ``change(value) -> value``."""
    changed = []
    for out in outs:
        out = copy.deepcopy(out)
        out.raw_logprobs = [change(v) for v in out.raw_logprobs]
        out.top_logprobs = [{t: change(v) for t, v in top.items()} for top in out.top_logprobs]
        changed.append(out)
    return changed


def test_the_check_catches_small_errors_spread_over_the_run(llama_run) -> None:
    """The RMS check has power: logprobs each moved by 0.04 nats (random signs), well inside the old
    rule's 8 ulps of the largest logit, fail it, while every single value stays within its bound."""
    model, prompts, outs = llama_run
    check_against_fp32(model, prompts, outs)
    rng = random.Random(0)
    with pytest.raises(AssertionError, match="RMS difference"):
        check_against_fp32(model, prompts, _perturbed(outs, lambda v: v + rng.choice((-0.04, 0.04))))


def test_the_check_catches_one_value_off(llama_run) -> None:
    """One logprob 0.5 nats off fails the per-value bound, naming the token."""
    model, prompts, outs = llama_run
    broken = copy.deepcopy(outs)
    broken[3].raw_logprobs[5] -= 0.5
    with pytest.raises(AssertionError, match="past its derived bound"):
        check_against_fp32(model, prompts, broken)
