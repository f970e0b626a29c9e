"""The one log-softmax both sides of parity mode compute a token's logprob with."""

from __future__ import annotations

import torch

from cbgen.batch_invariant.kernels.cpu_parity import parity_kernels_available, parity_token_logprobs


class _CpuTokenLogprobs(torch.autograd.Function):
    """The C kernel's log-probabilities, differentiable: the backward is log-softmax's own,
    ``g * (onehot(token) - softmax(x))``, through torch (any kernels may run backward)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(logits, tokens)
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)
        if flat.numel() and flat.stride(-1) != 1:
            flat = flat.contiguous()
        return parity_token_logprobs(flat, tokens.reshape(-1).long()).view(tokens.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, tokens = ctx.saved_tensors
        g = grad.float().unsqueeze(-1)
        out = torch.softmax(logits.float(), dim=-1).mul_(-g)
        out.scatter_add_(-1, tokens.long().unsqueeze(-1), g)
        return out.to(logits.dtype), None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The log-softmax of ``logits`` (in float32) gathered at ``tokens``: logits ``[..., V]``, tokens
    ``[...]`` (int64) -> float32 ``[...]``.  Differentiable.

    What the engine reports as ``raw_logprobs`` in parity mode, computed by this same function, so a
    row's value never depends on the rows around it: on the CPU (float32 and bfloat16 logits, where
    cbgen's C kernels are built) one C kernel sums each row's exponentials in an order set by the
    vocabulary size alone and reads only what the token's value needs (no float32 copy of the logits,
    no full log-softmax written); elsewhere torch's ``log_softmax(logits.float())``, whose reduction
    order per row is likewise set by the row's length.  The two can differ in the last bits, so pass
    both sides' logits through this function, not ``torch.log_softmax``.  Give it the trainer's
    logits for the positions that predict the generated tokens (``logits[:, t - 1]`` for the token at
    ``t``).
    """
    if logits.device.type == "cpu" and parity_kernels_available(logits.dtype) and logits.shape[-1] > 0:
        if tokens.shape != logits.shape[:-1]:
            raise ValueError(
                f"token_logprobs: tokens {list(tokens.shape)} do not match logits {list(logits.shape)}"
            )
        return _CpuTokenLogprobs.apply(logits, tokens)
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
