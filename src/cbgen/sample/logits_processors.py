"""Batch-level custom logits processors.

A processor is registered with the :class:`~cbgen.sample.sampler.Sampler` under a ``name``.  A
request opts in with ``SamplingParams(logits_processor_args={name: arg})``.  Once per step the
sampler calls each processor a single time with just the rows that opted in, so a processor can
vectorise over them instead of being called once per request.

Processors run first (stage 0, before penalties and temperature), like constraint processors in
``transformers``.  If a processor raises, the sampler retries it row by row and reports only the
rows that still raise; see :class:`~cbgen.sample.sampler.SamplerOutput` ``failed``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from cbgen.request import Request
from cbgen.sample.batch_params import BatchParams


@runtime_checkable
class BatchLogitsProcessor(Protocol):
    """Interface of a batch-level logits processor.

    ``logits`` is a ``[R, V]`` float32 tensor holding the rows that named this processor (a
    copy: modifying it in place is fine), ``rows`` their indices in the step's batch, ``args``
    the per-row argument values and ``requests`` the matching requests, all aligned with
    ``logits`` rows.  It returns the modified ``[R, V]`` logits.  Banning a token means setting it
    to ``-inf``.
    """

    name: str

    def __call__(
        self, logits: torch.Tensor, rows: torch.Tensor, args: list[Any], requests: Sequence[Request]
    ) -> torch.Tensor:
        """Returns the processed ``[R, V]`` logits."""
        ...


def _token_list(value: Any, what: str) -> list[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{what} must be a list of token ids, got {type(value).__name__}")
    out = []
    for t in value:
        if not isinstance(t, int) or isinstance(t, bool):
            raise TypeError(f"{what} must hold integer token ids, got {t!r}")
        out.append(t)
    return out


class AllowedTokensProcessor:
    """Restricts each row to its own list of token ids (``arg``: ``list[int]``); all others get ``-inf``.

    Ids outside ``[0, V)`` are ignored; an empty list is an error (nothing could be sampled).
    """

    name = "allowed_token_ids"

    def __call__(
        self, logits: torch.Tensor, rows: torch.Tensor, args: list[Any], requests: Sequence[Request]
    ) -> torch.Tensor:
        """Keeps only each row's allowed ids."""
        vocab = logits.shape[1]
        flat: list[int] = []
        for j, arg in enumerate(args):
            ids = [t for t in _token_list(arg, "allowed_token_ids") if 0 <= t < vocab]
            if not ids:
                raise ValueError("allowed_token_ids has no token id inside the vocabulary")
            base = j * vocab
            flat.extend(base + t for t in ids)
        idx = torch.tensor(flat, dtype=torch.int64, device=logits.device)
        # Copy the allowed entries into an all -inf tensor: the work is proportional to the number of
        # allowed ids, where a dense mask would cost R * V on every step.
        out = torch.full_like(logits, float("-inf"))
        out.view(-1).index_put_((idx,), logits.reshape(-1).index_select(0, idx))
        return out


class BadWordsProcessor:
    """Bans token sequences (``arg``: ``list[list[int]]``).

    The last token of a sequence is banned whenever the generated output (not the prompt) ends
    with the rest of the sequence; a single-token sequence is always banned.  Words given as
    strings (vLLM's form) never get here: request validation turns them into token-id sequences
    when it has a tokenizer and refuses them otherwise
    (:meth:`~cbgen.sampling_params.SamplingParams.verify_for_model`).
    """

    name = "bad_words"

    def __call__(
        self, logits: torch.Tensor, rows: torch.Tensor, args: list[Any], requests: Sequence[Request]
    ) -> torch.Tensor:
        """Sets the banned next tokens of each row to ``-inf``."""
        vocab = logits.shape[1]
        flat: list[int] = []
        for j, (arg, req) in enumerate(zip(args, requests)):
            if isinstance(arg, (str, bytes)) or not isinstance(arg, Sequence):
                raise TypeError(f"bad_words must be a list of token-id lists, got {type(arg).__name__}")
            output = req.token_ids[req.num_prompt_tokens :]
            for seq in arg:
                words = _token_list(seq, "bad_words entry")
                if not words:
                    raise ValueError("bad_words entries must not be empty")
                *prefix, last = words
                if not 0 <= last < vocab:
                    continue
                if not prefix or (
                    len(output) >= len(prefix) and output[len(output) - len(prefix) :] == prefix
                ):
                    flat.append(j * vocab + last)
        if flat:
            idx = torch.tensor(flat, dtype=torch.int64, device=logits.device)
            logits.view(-1).index_fill_(0, idx, float("-inf"))
        return logits


def run_batch_processors(
    processors: dict[str, BatchLogitsProcessor],
    logits: torch.Tensor,
    params: BatchParams,
    requests: Sequence[Request],
    failed: dict[int, str],
) -> None:
    """Stage 0: runs each processor the batch names once, in place on ``logits``, over its rows.

    ``processors`` maps names to registered processors, in registration order.  A processor that
    raises is retried row by row; rows that still fail, or name an unknown processor, get a
    message in ``failed`` and keep their logits.
    """
    vocab = logits.shape[1]
    # Registration order, not batch order, so the result does not depend on batch composition.
    names = [n for n in processors if n in params.processor_rows]
    names += [n for n in params.processor_rows if n not in processors]
    for name in names:
        rows = params.processor_rows[name]
        processor = processors.get(name)
        if processor is None:
            for r in rows:
                failed[r] = f"unknown logits processor {name!r} (known: {sorted(processors)})"
            continue
        args = params.processor_args[name]
        reqs = [requests[r] for r in rows]
        idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        try:
            out = processor(logits.index_select(0, idx), idx, list(args), reqs)
            _check_processor_output(out, len(rows), vocab)
            logits[idx] = out.to(torch.float32)
        except Exception:
            # Isolate the failure: rerun one row at a time and only fail the rows that raise.
            for j, r in enumerate(rows):
                try:
                    out = processor(logits[r : r + 1].clone(), idx[j : j + 1], [args[j]], [reqs[j]])
                    _check_processor_output(out, 1, vocab)
                    logits[r] = out[0].to(torch.float32)
                except Exception as exc:
                    failed[r] = f"logits processor {name!r} failed: {type(exc).__name__}: {exc}"


def _check_processor_output(out: object, rows: int, vocab: int) -> None:
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (rows, vocab):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"processor returned {shape}, expected a tensor of shape {(rows, vocab)}")


__all__ = ["AllowedTokensProcessor", "BadWordsProcessor", "BatchLogitsProcessor", "run_batch_processors"]
