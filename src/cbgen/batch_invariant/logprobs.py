"""The one log-softmax both sides of parity mode compute a token's logprob with."""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits.float())`` gathered at ``tokens``: logits ``[..., V]``, tokens ``[...]``
    (int64) -> float32 ``[...]``.  Differentiable.

    What the engine reports as ``raw_logprobs`` in parity mode, computed the same way: torch's
    float32 log-softmax reduces each row in an order set by the row's length alone, so the value for
    one row does not depend on the rows around it.  Pass the trainer's logits for the positions that
    predict the generated tokens (``logits[:, t - 1]`` for the token at ``t``).
    """
    lp = torch.log_softmax(logits.float(), dim=-1)
    return lp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def truncated_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: torch.Tensor, cut: torch.Tensor
) -> torch.Tensor:
    """The processed logprob both sides of parity mode compute: ``log_softmax(logits / temperature)``
    over the tokens whose logit is at least ``cut`` (the rest count as ``-inf``), at ``tokens``.
    ``logits [N, V]`` (processed: penalties and bias applied, before temperature), ``tokens [N]``,
    ``temperature [N]`` (> 0) and ``cut [N]`` (``-inf``: no truncation) -> float32 ``[N]``.
    Differentiable in ``logits``.

    Every step is a per-element IEEE operation or :func:`token_logprobs`'s per-row log-softmax, so a
    row's value does not depend on the rows around it."""
    x = logits.float()
    scaled = x / temperature.to(device=x.device, dtype=torch.float32).unsqueeze(-1)
    kept = x >= cut.to(device=x.device, dtype=torch.float32).unsqueeze(-1)
    return token_logprobs(torch.where(kept, scaled, torch.full_like(scaled, float("-inf"))), tokens)
