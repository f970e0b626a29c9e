"""bf16 held to the oracle on every supported architecture.

* Greedy tokens against ``generate()`` in bf16, under ``tests/oracle.py``'s bf16 near-tie rule: a
  divergence must be between the exact top two tokens (float32 forward of the same bf16 weights),
  within 8 bf16 ulps of the row's largest logit, and near-ties may be at most 10% of the checked
  tokens; after each one the check goes on from cbgen's own tokens.
* Every step's logprobs (the sampled token's raw logprob and the top-3) against the model's own bf16
  forward over prompt + generated tokens, to the same tolerance (``oracle.bf16_tolerance``: why 8
  ulps is written there).

Each test prints its numbers (near-ties, largest logprob difference in absolute terms and in ulps).
"""

from __future__ import annotations

import pytest
import torch

from cbgen import LLM, SamplingParams
from oracle import BF16, bf16_tolerance, bf16_ulp, compare, hf_greedy
from tiny_models import ARCHS, make_model, make_prompts

NUM_PROMPTS, NEW_TOKENS = 10, 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)


@pytest.fixture(autouse=True)
def _one_thread():
    # The suite shares a small machine; one thread also keeps the reductions in a fixed order.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _routers(model) -> list[torch.nn.Module]:
    """The mixture-of-experts routers of ``model`` (modules returning router logits first)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def _first_routing_tie(router_logits: list[torch.Tensor], top_k: int) -> int | None:
    """The first position at which some layer's k-th and (k+1)-th router logits are within the
    bf16 tolerance of that token's router row (where two computations may pick other experts)."""
    first = None
    for logits in router_logits:
        ordered = logits.float().sort(-1, descending=True).values
        for pos in range(ordered.shape[0]):
            if ordered[pos, top_k - 1] - ordered[pos, top_k] <= bf16_tolerance(ordered[pos]):
                first = pos if first is None else min(first, pos)
                break
    return first


def check_logprobs(model, prompts: list[list[int]], outputs) -> tuple[float, float, int]:
    """Asserts that each step's raw logprob and top logprobs equal ``log_softmax`` of the model's own
    forward over prompt + tokens, within :func:`oracle.bf16_tolerance` of that row; returns the
    largest difference (absolute, and in ulps of the row's largest logit) and the number of steps
    allowed past the tolerance.

    Mixture-of-experts routing is not continuous: where a token's k-th and (k+1)-th router logits are
    within rounding, the two computations can send it to other experts, and every later position of
    the sequence then differs by more than rounding.  Steps of such a model may exceed the tolerance
    only at or after a routing near-tie of the reference, and at most 3% of them."""
    routers = _routers(model)
    captured: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, i, o: captured.append(o[0])) for r in routers]
    worst = worst_ulps = 0.0
    beyond = steps = 0
    try:
        for prompt, out in zip(prompts, outputs, strict=True):
            tokens = out.token_ids
            captured.clear()
            with torch.no_grad():
                logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
            tie = _first_routing_tie(captured, routers[0].top_k) if routers else None
            want = torch.log_softmax(logits.double(), -1)
            assert len(out.raw_logprobs) == len(out.top_logprobs) == len(tokens)
            for step, (token, raw, top) in enumerate(zip(tokens, out.raw_logprobs, out.top_logprobs)):
                steps += 1
                tol = bf16_tolerance(logits[step])
                diff = max(abs(lp - float(want[step, t])) for t, lp in [(token, raw), *top.items()])
                if diff > tol:
                    routed = tie is not None and tie <= len(prompt) - 1 + step
                    assert routed, (
                        f"step {step}: logprobs differ from the bf16 forward by {diff:.4f} > {tol:.4f}"
                    )
                    beyond += 1
                    continue
                worst = max(worst, diff)
                worst_ulps = max(worst_ulps, diff / bf16_ulp(float(logits[step].abs().max())))
    finally:
        for hook in hooks:
            hook.remove()
    assert beyond <= 0.03 * steps, f"{beyond} of {steps} steps past the tolerance after routing near-ties"
    return worst, worst_ulps, beyond


@pytest.mark.parametrize("arch", list(ARCHS))
def test_bf16_greedy_and_logprobs_match_generate(arch: str) -> None:
    model = make_model(arch, dtype=torch.bfloat16)
    prompts = make_prompts(NUM_PROMPTS, lengths=(3, 90))
    refs = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    outs = [o.outputs[0] for o in LLM(model, block_size=8).generate(prompts, GREEDY, use_tqdm=False)]
    near_ties = compare(model, prompts, [o.token_ids for o in outs], refs, rule=BF16)
    worst, ulps, beyond = check_logprobs(model, prompts, outs)
    print(
        f"\n{arch} bf16: {near_ties} near-ties in {NUM_PROMPTS * NEW_TOKENS} tokens; largest logprob "
        f"difference {worst:.4f} ({ulps:.2f} ulps of the row's largest logit; tolerance 8)"
        + (f"; {beyond} steps past it after expert-routing near-ties" if beyond else "")
    )
