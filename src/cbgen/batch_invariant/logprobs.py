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
