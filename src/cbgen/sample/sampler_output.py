"""What one sampler step hands back: :class:`SamplerOutput`, and the device-side failure flags."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cbgen.core.update import SampledTokens

FLAG_OK, FLAG_NOTHING_CHOOSABLE, FLAG_BAD_LOGITS = 0, 1, 2
_FLAG_MESSAGES = {
    FLAG_NOTHING_CHOOSABLE: "no token can be chosen: every logit is -inf or the logits hold NaN/inf",
    FLAG_BAD_LOGITS: "the model logits hold NaN or inf",
}


@dataclass
class SamplerOutput:
    """One step's sampling result; all tensors are on the CPU, row ``i`` belongs to ``requests[i]``.

    * ``token_ids`` ``[B]`` int64: the sampled tokens.
    * ``logprobs`` ``[B]`` float32: log-probability of the token under the processed distribution it
      was drawn from (stage 0/1 changes, temperature, truncation, renormalised).  0.0 for greedy rows.
    * ``raw_logprobs`` ``[B]`` float32: ``log_softmax`` of the raw model logits (temperature 1, no
      penalties) at the token.
    * ``log_kept_mass`` ``[B]`` float32: log of the raw (temperature 1) probability mass of the tokens
      that stayed eligible: not set to ``-inf`` by stage 0/1 and not cut by top-k/top-p/min-p.  For a
      greedy row only the argmax counts, so it equals ``raw_logprobs``.  With temperature 1 and no
      penalties or bias, ``logprobs == raw_logprobs - log_kept_mass``.
    * ``topk_ids``/``topk_logprobs`` ``[B, K]``: ``K`` is the largest ``logprobs`` requested in the
      batch (``None`` when that is 0 or nobody asked).  Sampled rows report processed logprobs
      (``-inf`` for tokens cut by truncation; the ids of ``-inf`` entries are arbitrary).  Greedy rows
      report ``log_softmax`` of the stage-1 logits at temperature 1, because the processed
      distribution is a point mass and says nothing.  Rows that did not ask hold id -1 and NaN;
      a row that asked for fewer than ``K`` uses its first entries (sorted best first).
    * ``kept_counts`` ``[B]`` int64 / ``kept_thresholds`` ``[B]`` float32: the behaviour-policy record
      of each row's kept set.  Top-k, top-p and min-p keep the largest processed logits (before
      temperature), so the set is every token whose processed logit is at least the threshold, and
      the count says how many there were.  A row without truncation has count 0 and threshold
      ``-inf`` (every token); a greedy row has count 1 and its largest processed logit.
      :func:`cbgen.processed_logprobs` rebuilds a row's processed logprob from the trainer's logits.
    * ``failed``: row -> message for rows that could not be processed (a custom processor raised,
      an unknown processor was named, every token was banned, or the logits hold NaN/inf).  Their
      other fields are meaningless; the engine should fail those requests.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    raw_logprobs: torch.Tensor
    log_kept_mass: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    host_failed: dict[int, str] = field(default_factory=dict)  # found on the host (processors, ...)
    row_flags: torch.Tensor | None = None  # int8 [B], FLAG_*: failures found on the device
    device_token_ids: torch.Tensor | None = None  # token_ids where the logits live (next step's inputs)
    kept_counts: torch.Tensor | None = None  # None: no row was truncated
    kept_thresholds: torch.Tensor | None = None

    @property
    def failed(self) -> dict[int, str]:
        """Row -> message for every failed row (host findings win); reads ``row_flags``."""
        out = dict(self.host_failed)
        if self.row_flags is not None:
            for row, flag in enumerate(self.row_flags.tolist()):
                if flag != FLAG_OK:
                    out.setdefault(row, _FLAG_MESSAGES[flag])
        return dict(sorted(out.items()))

    @classmethod
    def from_device(
        cls,
        token: torch.Tensor,
        columns: list[torch.Tensor],
        topk_ids: torch.Tensor | None,
        topk_lp: torch.Tensor | None,
        host_failed: dict[int, str],
    ) -> SamplerOutput:
        """The step's result from its device tensors: ``token`` and ``columns`` (logprob, raw logprob,
        log kept mass, flags, kept count and kept threshold, each ``[B]`` float64) plus the top
        logprobs, in one host copy."""
        # One device-to-host copy for everything the step reports (ids are exact in float64).
        cols = [token.double(), *columns]
        k = 0 if topk_ids is None else topk_ids.shape[1]
        host = torch.cat(
            [c.unsqueeze(1) for c in cols] + ([topk_ids.double(), topk_lp.double()] if k else []), 1
        )
        host = host.cpu()
        return cls(
            token_ids=host[:, 0].long(),
            logprobs=host[:, 1].float(),
            raw_logprobs=host[:, 2].float(),
            log_kept_mass=host[:, 3].float(),
            topk_ids=host[:, 7 : 7 + k].long() if k else None,
            topk_logprobs=host[:, 7 + k :].float() if k else None,
            host_failed=host_failed,
            row_flags=host[:, 4].to(torch.int8),
            device_token_ids=token,
            kept_counts=host[:, 5].long(),
            kept_thresholds=host[:, 6].float(),
        )

    def to_host(self) -> SampledTokens:
        """The results as the plain lists the step's update rules take (one device-to-host read)."""
        rows = self.token_ids.shape[0]
        counts = self.kept_counts if self.kept_counts is not None else torch.zeros(rows, dtype=torch.int64)
        thresholds = self.kept_thresholds
        if thresholds is None:
            thresholds = torch.full((rows,), float("-inf"))
        return SampledTokens(
            token_ids=self.token_ids.tolist(),
            kept_counts=counts.tolist(),
            kept_thresholds=thresholds.tolist(),
            logprobs=self.logprobs.tolist(),
            raw_logprobs=self.raw_logprobs.tolist(),
            log_kept_mass=self.log_kept_mass.tolist(),
            top_ids=self.topk_ids.tolist() if self.topk_ids is not None else None,
            top_logprobs=self.topk_logprobs.tolist() if self.topk_logprobs is not None else None,
            failed=self.failed,
        )


__all__ = ["FLAG_BAD_LOGITS", "FLAG_NOTHING_CHOOSABLE", "FLAG_OK", "SamplerOutput"]
