"""The trainer side of the behaviour-policy record: a generated token's processed logprob, rebuilt
from the trainer's logits, the request's ``SamplingParams`` and the kept-set record the engine
stored with the token (``CompletionOutput.kept_counts``).

The processed distribution is the one a token was drawn from: logit bias, then temperature, then the
truncation (top-k, top-p, min-p), renormalised.  The truncation always keeps the largest processed
logits, so the engine records how many it kept (and the smallest kept logit).  Here the trainer's
kept set is its own ``count`` largest logits:

* in parity mode (``LLM(batch_invariant=True)`` and ``cbgen.parity(model)`` around the trainer's
  forward) the trainer's logits equal the engine's bit for bit, so the set is the engine's and the
  result equals ``CompletionOutput.token_logprobs`` bit for bit (one function computes both:
  :func:`cbgen.batch_invariant.logprobs.truncated_logprobs`);
* outside parity mode it is the trainer's logprob under a truncation of the same size, what
  truncated/masked importance sampling (TIS, MIS) needs; a sampled token that falls outside the
  trainer's set gets ``-inf``.

Penalties that depend on the token history (repetition, presence, frequency), ``min_tokens``
suppression, structured output and custom logits processors change logits in ways the record does
not capture; requests using them are refused with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cbgen.batch_invariant.logprobs import truncated_logprobs
from cbgen.sampling_params import SamplingParams


def _unsupported(params: SamplingParams) -> list[str]:
    reasons = []
    if params.repetition_penalty != 1.0:
        reasons.append("repetition_penalty")
    if params.presence_penalty or params.frequency_penalty:
        reasons.append("presence/frequency penalties")
    if params.min_tokens and (not params.ignore_eos or params.stop_token_ids):
        reasons.append("min_tokens (it suppresses EOS and stop tokens early)")
    if params.structured_output is not None:
        reasons.append("structured_output")
    if params.logits_processor_args:
        reasons.append("logits processors")
    return reasons


def processed_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    params: SamplingParams,
    kept_counts: Sequence[int] | torch.Tensor,
) -> torch.Tensor:
    """Processed logprobs of ``tokens [N]`` from the trainer's ``logits [N, V]`` (row ``i`` the
    logits that predicted ``tokens[i]``, e.g. ``logits[t - 1]`` for the completion token at ``t``),
    under ``params`` and the engine's ``kept_counts [N]`` for those tokens; float32 ``[N]``,
    differentiable in ``logits``.  Greedy requests (temperature 0) give 0.0, as the engine reports.
    See the module docstring for what it equals in and outside parity mode."""
    if logits.dim() != 2 or tokens.dim() != 1 or logits.shape[0] != tokens.shape[0]:
        raise ValueError(
            f"expected logits [N, V] and tokens [N], got {tuple(logits.shape)} and {tuple(tokens.shape)}"
        )
    counts = torch.as_tensor(kept_counts, dtype=torch.int64).cpu()
    if counts.shape != tokens.shape:
        raise ValueError(f"kept_counts holds {counts.numel()} entries for {tokens.numel()} tokens")
    if (counts < 0).any() or (counts > logits.shape[1]).any():
        raise ValueError(f"kept_counts must lie in [0, {logits.shape[1]}] (0: no truncation)")
    reasons = _unsupported(params)
    if reasons:
        raise ValueError(f"processed_logprobs cannot rebuild a distribution changed by {', '.join(reasons)}")
    rows = logits.shape[0]
    if params.temperature == 0.0:
        return torch.zeros(rows, dtype=torch.float32, device=logits.device)
    x = logits.float()
    if params.logit_bias:
        cols = torch.tensor(list(params.logit_bias), dtype=torch.int64, device=x.device)
        bias = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=x.device)
        x = x.index_copy(1, cols, x.index_select(1, cols) + bias)
    cut = torch.full((rows,), float("-inf"), dtype=torch.float32)
    with torch.no_grad():
        for i in counts.nonzero().squeeze(1).tolist():
            # The count-th largest logit: in parity mode exactly the engine's smallest kept one.
            cut[i] = torch.topk(x[i], int(counts[i])).values[-1]
    temperature = torch.full((rows,), float(params.temperature), dtype=torch.float32)
    return truncated_logprobs(x, tokens.to(x.device), temperature, cut)
