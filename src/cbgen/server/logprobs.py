"""Log-probabilities of generated tokens in OpenAI's two shapes (completions and chat).

The engine records two log-probabilities per sampled token: ``raw_logprobs`` (log-softmax of the
model's logits at temperature 1, before any penalty or truncation) and ``token_logprobs`` (under the
processed distribution actually sampled from).  For greedy requests (``temperature == 0``) the
processed distribution is a point mass, so its logprob is always 0 and says nothing; the server then
reports the raw model logprob of the chosen token.  For ``temperature > 0`` it reports the processed
logprob, i.e. the probability with which the token was really drawn.  The top candidates
(``top_logprobs``) are the engine's per-position top-k (``CompletionOutput.top_logprobs``) as they
are, most likely first; should any value be non-finite it is sent as ``-9999.0``, because JSON has
no infinity.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from cbgen.outputs import CompletionOutput

MISSING_LOGPROB = -9999.0  # stands in for -inf, which JSON cannot carry

TopLogprobs = list[tuple[str, float]]
"""One position's candidates as (token text, logprob), most likely first."""


def _finite(value: float) -> float:
    if math.isnan(value):
        return MISSING_LOGPROB
    return value if math.isfinite(value) else MISSING_LOGPROB


def logprob_entries(
    c: CompletionOutput, greedy: bool, token_text: Callable[[int], str]
) -> tuple[list[str], list[float], list[TopLogprobs]]:
    """The token texts of ``c``, their logprobs and the ranked top candidates at each position."""
    chosen = c.raw_logprobs if greedy else c.token_logprobs
    tokens = [token_text(t) for t in c.token_ids]
    values = [_finite(float(v)) for v in chosen[: len(tokens)]]
    values += [MISSING_LOGPROB] * (len(tokens) - len(values))
    tops: list[TopLogprobs] = []
    for pos in range(len(tokens)):
        top = c.top_logprobs[pos] if c.top_logprobs is not None and pos < len(c.top_logprobs) else {}
        ranked = sorted(
            ((tid, lp) for tid, lp in top.items() if tid >= 0 and not math.isnan(lp)),
            key=lambda kv: -kv[1],
        )
        tops.append([(token_text(tid), _finite(float(lp))) for tid, lp in ranked])
    return tokens, values, tops


def completion_logprobs(
    tokens: list[str], values: list[float], tops: list[TopLogprobs], text_offset: int
) -> tuple[dict[str, Any], int]:
    """The completions ``logprobs`` object for tokens starting at ``text_offset``, and the offset after."""
    offsets = []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(t)
    top_dicts = []
    for top in tops:
        d: dict[str, float] = {}
        for tok, lp in top:
            d.setdefault(tok, lp)  # ranked, so the first occurrence is the most likely
        top_dicts.append(d)
    body = {"tokens": tokens, "token_logprobs": values, "top_logprobs": top_dicts, "text_offset": offsets}
    return body, text_offset


def chat_logprobs(tokens: list[str], values: list[float], tops: list[TopLogprobs]) -> dict[str, Any]:
    """The chat ``logprobs`` object (``content`` entries with UTF-8 ``bytes``) for the tokens."""
    content = []
    for tok, lp, top in zip(tokens, values, tops):
        content.append(
            {
                "token": tok,
                "logprob": lp,
                "bytes": list(tok.encode("utf-8")),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))} for t, v in top
                ],
            }
        )
    return {"content": content, "refusal": None}
