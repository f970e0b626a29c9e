"""The sampler's processing order against transformers' own logits processors.

``test_sampler.py`` holds the sampler to a float64 reference written from the definitions; this file
holds it to the code ``generate()`` runs: a ``LogitsProcessorList`` of transformers'
``RepetitionPenaltyLogitsProcessor``, ``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
``TopPLogitsWarper`` and ``MinPLogitsWarper``, in the order ``generate()`` builds them (asserted
below from ``GenerationMixin._get_logits_processor``), on random logits.  The processed distribution
must be the same to 1e-6 in every probability, including which tokens are cut.  cbgen's side is the
sampled row's top logprobs over the whole vocabulary, which are the processed distribution.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from cbgen.request import Request
from cbgen.sample.sampler import Sampler
from cbgen.sampling_params import SamplingParams
from tiny_models import make_model

VOCAB = 160
PROMPT = [3, 4, 9, 9, 17, 40]
OUTPUT = [3, 11, 11, 20, 7, 150]
CASES = {
    "temperature": dict(temperature=0.6),
    "top_k": dict(top_k=9),
    "top_p": dict(top_p=0.7),
    "min_p": dict(min_p=0.08),
    "repetition_penalty": dict(repetition_penalty=1.7),
    "all": dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.3),
    "all_hot": dict(temperature=1.7, top_k=100, top_p=0.6, min_p=0.05, repetition_penalty=0.8),
}
ORDER = [
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
]


def hf_processors(params: dict) -> LogitsProcessorList:
    """The processors ``generate()`` would add for ``params``, in ``generate()``'s order."""
    made = {
        RepetitionPenaltyLogitsProcessor: lambda: RepetitionPenaltyLogitsProcessor(
            params["repetition_penalty"]
        ),
        TemperatureLogitsWarper: lambda: TemperatureLogitsWarper(params["temperature"]),
        TopKLogitsWarper: lambda: TopKLogitsWarper(params["top_k"]),
        TopPLogitsWarper: lambda: TopPLogitsWarper(params["top_p"]),
        MinPLogitsWarper: lambda: MinPLogitsWarper(params["min_p"]),
    }
    needed = {
        RepetitionPenaltyLogitsProcessor: "repetition_penalty",
        TemperatureLogitsWarper: "temperature",
        TopKLogitsWarper: "top_k",
        TopPLogitsWarper: "top_p",
        MinPLogitsWarper: "min_p",
    }
    return LogitsProcessorList(made[cls]() for cls in ORDER if needed[cls] in params)


def test_generate_builds_the_processors_in_this_order() -> None:
    """The order above is the one ``generate()`` uses (read from transformers, not assumed)."""
    model = make_model("llama")
    config = GenerationConfig(do_sample=True, **CASES["all"])
    built = model._get_logits_processor(config, input_ids_seq_length=len(PROMPT))
    assert [type(p) for p in built] == ORDER


def _top_p_margin(scores: torch.Tensor, top_p: float) -> float:
    """Distance of ``1 - top_p`` from the nearest cumulative mass of the ascending-sorted survivors,
    so that float rounding cannot move the top-p cut in either implementation."""
    probs = torch.softmax(scores, -1).sort().values
    return float((probs.cumsum(-1) - (1 - top_p)).abs().min())


def _cbgen_distribution(logits: torch.Tensor, params: dict, sync_free: bool) -> np.ndarray:
    req = Request(
        request_id="r",
        prompt_token_ids=list(PROMPT),
        params=SamplingParams(logprobs=VOCAB, seed=0, **params),
        eos_token_ids=frozenset({2}),
    )
    for t in OUTPUT:
        req.append_token(t)
    out = Sampler(VOCAB, sync_free=sync_free)(logits[None], [req])
    assert out.failed == {}
    probs = np.zeros(VOCAB)
    ids, logprobs = out.topk_ids[0].numpy(), out.topk_logprobs[0].double().numpy()
    probs[ids] = np.exp(logprobs)
    assert sorted(ids.tolist()) == list(range(VOCAB))  # the whole distribution came back
    return probs


@pytest.mark.parametrize("sync_free", [False, True], ids=["sync", "sync_free"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_processed_distribution_matches_transformers(case: str, seed: int, sync_free: bool) -> None:
    """Both sampled-row algorithms (``Sampler(sync_free=...)``)."""
    params = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(VOCAB, generator=gen) * 2.5).float()
    ids = torch.tensor([PROMPT + OUTPUT])
    scores = logits.double()[None]
    for proc in hf_processors(params):
        if isinstance(proc, TopPLogitsWarper):
            assert _top_p_margin(scores[0], params["top_p"]) > 1e-5
        scores = proc(ids, scores)
    want = torch.softmax(scores[0], -1).numpy()
    got = _cbgen_distribution(logits, params, sync_free)
    np.testing.assert_array_equal(got > 0, want > 0)  # the same tokens cut
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert (want > 0).sum() > 1  # a distribution, not a point mass
