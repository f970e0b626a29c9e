"""The trainer side of parity mode, timed: the model's forward over the sequences a run generated
(prompt + completion, left-padded batches of 8), plain and inside ``cbgen.parity(model)``, the
forward a GRPO/PPO trainer runs to recompute logprobs.  Reported with the ``cbgen-parity`` engine as
``trainer_forward``: medians of ``repeats`` timed passes after one untimed one, and their ratio."""

from __future__ import annotations

import statistics
import time
from typing import Any

BATCH = 8


def _batches(model: Any, sequences: list[list[int]]) -> list[tuple[Any, Any]]:
    import torch

    device = next(model.parameters()).device
    out = []
    for i in range(0, len(sequences), BATCH):
        rows = sequences[i : i + BATCH]
        width = max(map(len, rows))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, row in enumerate(rows):
            ids[j, width - len(row) :] = torch.tensor(row)
            mask[j, width - len(row) :] = 1
        out.append((ids.to(device), mask.to(device)))
    return out


def time_trainer_forward(model: Any, sequences: list[list[int]], repeats: int) -> dict[str, Any]:
    """Median seconds of one pass over ``sequences``, plain and under ``cbgen.parity``, and
    ``parity/default`` as a throughput ratio (default seconds over parity seconds)."""
    import torch

    import cbgen

    batches = _batches(model, sequences)

    def one_pass(parity: bool) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            for ids, mask in batches:
                if parity:
                    with cbgen.parity(model):
                        _ = model(ids, attention_mask=mask).logits
                else:
                    positions = (mask.cumsum(-1) - 1).clamp(min=0)
                    _ = model(ids, attention_mask=mask, position_ids=positions).logits
        return time.perf_counter() - t0

    times: dict[bool, list[float]] = {False: [], True: []}
    for parity in (False, True):
        one_pass(parity)  # warm-up
    for _ in range(max(repeats, 1)):
        for parity in (False, True):  # alternated, so drift hits both
            times[parity].append(one_pass(parity))
    default_s, parity_s = statistics.median(times[False]), statistics.median(times[True])
    return {
        "sequences": len(sequences),
        "tokens": sum(map(len, sequences)),
        "default_s": default_s,
        "parity_s": parity_s,
        "parity/default": default_s / parity_s,
    }
