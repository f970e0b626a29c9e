"""The correctness oracle: compare cbgen's greedy tokens with transformers' ``generate()``.

fp32 rounding differs between packed and padded batches, so exactly one kind of divergence is
tolerated: at the first differing position the reference's top-two logit gap is a near-tie
(< 1e-5 relative).  Those are counted and printed; any other divergence fails.
"""

from __future__ import annotations

import copy

import torch

NEAR_TIE = 1e-5


def hf_greedy(model, prompt: list[int], max_new_tokens: int, ignore_eos: bool = True) -> list[int]:
    """``model.generate()`` greedy continuation of one prompt (no padding involved)."""
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


def top2_gap(model, tokens: list[int]) -> float:
    """Relative gap between the two largest next-token logits after ``tokens``."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens], device=model.device)).logits[0, -1].float()
    top = logits.topk(2).values
    return float((top[0] - top[1]).abs() / top[0].abs().clamp_min(1e-6))


def compare(model, prompts: list[list[int]], got: list[list[int]], refs: list[list[int]]) -> int:
    """Asserts exactness except at near-ties; returns the number of near-ties seen."""
    near_ties = 0
    for i, (prompt, a, b) in enumerate(zip(prompts, got, refs)):
        if a == b:
            continue
        j = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
        assert j < min(len(a), len(b)), f"prompt {i}: lengths differ ({len(a)} vs {len(b)}) with equal prefix"
        gap = top2_gap(model, prompt + b[:j])
        assert gap < NEAR_TIE, (
            f"prompt {i} (len {len(prompt)}) diverges at token {j}: cbgen {a[j]} vs generate() {b[j]}, "
            f"reference top-2 gap {gap:.2e} is not a near-tie"
        )
        near_ties += 1
        print(f"near-tie: prompt {i} token {j} gap {gap:.2e}")
    return near_ties
