"""The sampler: turns one step's logits into one token per row, with the logprobs RL needs.

Processing order per row (the same as ``transformers`` ``generate()``):

0. custom batch logits processors and ``min_tokens`` suppression (EOS unless ``ignore_eos``, and
   ``stop_token_ids``, get ``-inf`` while fewer than ``min_tokens`` tokens were generated);
1. repetition penalty (prompt + output, ``transformers`` semantics), presence/frequency penalties
   (output only, OpenAI semantics), logit bias;
2. temperature; 3. top-k; 4. top-p; 5. min-p (relative to the largest probability).

Every step renormalises over its survivors.  ``temperature == 0`` is greedy: the argmax of the
stage-1 logits.

Randomness never touches the global torch/numpy/Python generators.  A seeded row draws its single
uniform from a hash of ``(seed, sample_index, output position)``, so its token depends only on
that and on its own logits, not on batch composition or scheduling.  Unseeded rows draw from a
private ``torch.Generator`` seeded with the sampler's ``seed``.  The token is the inverse CDF at that
uniform, computed in two levels (block sums, then one block) in float64, and can never be a token
of zero probability.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from cbgen.request import Request
from cbgen.sample.logits_processors import BatchLogitsProcessor
from cbgen.sample.processors import (
    BLOCK,
    NEG_INF,
    BatchParams,
    apply_banned_tokens,
    apply_frequency_presence,
    apply_logit_bias,
    apply_repetition_penalty,
    block_reduce,
    cpu_chunk_rows,
    exp_rows,
    exp_sum,
    finite_or,
    gather_blocks,
    logsumexp_rows,
    row_argmax,
    seeded_uniform,
    topk_desc,
    truncation_thresholds,
)
from cbgen.sample.prompt_logprobs import prompt_logprobs

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

    @property
    def failed(self) -> dict[int, str]:
        """Row -> message for every failed row (host findings win); reads ``row_flags``."""
        out = dict(self.host_failed)
        if self.row_flags is not None:
            for row, flag in enumerate(self.row_flags.tolist()):
                if flag != FLAG_OK:
                    out.setdefault(row, _FLAG_MESSAGES[flag])
        return dict(sorted(out.items()))


@dataclass
class _SampledRows:
    """Per-row results of the sampled (non-greedy) rows, in their local order."""

    token: torch.Tensor
    logprob: torch.Tensor  # float64
    kept: torch.Tensor  # float64 raw mass in units of exp(raw - raw_max); NaN means "everything"
    mass: torch.Tensor  # float64 sum of exp(raw - raw_max), NaN where not computed
    topk_rows: torch.Tensor | None = None  # local rows that asked for top logprobs
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    bad: torch.Tensor | None = None  # bool: rows with nothing to sample (sync-free path only)
    mass_rows: list[int] | None = None  # local rows whose ``mass`` is set (sync-free path only)


class Sampler:
    """Samples one token per row of a ``[B, V]`` logits tensor; see the module docstring.

    ``vocab_size`` is the model's logits width (padding columns count as tokens).  ``logits_processors``
    are the batch-level custom processors requests can name.  ``seed`` seeds the private generator
    of unseeded rows.  Not thread-safe: on CPU it reuses scratch buffers between calls.

    ``sync_free`` picks the sampled-row algorithm.  ``False`` branches on values it reads back from the
    device (which rows a truncation cuts, whether a row's survivors fit its candidate list, failed
    rows): the cheapest on CPU, where a read-back costs nothing.  ``True`` never reads the device:
    truncated rows are sorted whole and masked, failures become flags read back with the tokens.
    That is what an accelerator needs, because each read-back waits for the whole queue.  ``None``
    (the default) chooses by the logits' device.  Both draw from the same distribution; a seeded row
    can pick a different token in the two modes, because the spill case of ``False`` walks the
    vocabulary in id order instead of by probability.
    """

    def __init__(
        self,
        vocab_size: int,
        logits_processors: Sequence[BatchLogitsProcessor] = (),
        seed: int = 0,
        sync_free: bool | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.sync_free = sync_free
        self._processors: dict[str, BatchLogitsProcessor] = {}
        for proc in logits_processors:
            if proc.name in self._processors:
                raise ValueError(f"two logits processors are named {proc.name!r}")
            self._processors[proc.name] = proc
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(seed)
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def logits_processor_names(self) -> list[str]:
        """Names requests may use in ``SamplingParams.logits_processor_args``."""
        return list(self._processors)

    # ------------------------------------------------------------------------------------ public
    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        """Samples row ``i`` of ``logits`` for ``requests[i]`` (at output position ``num_output_tokens``)."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        if logits.shape[0] != len(requests):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(requests)} requests")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(
                f"logits have {logits.shape[1]} columns, fewer than vocab_size={self.vocab_size}"
            )
        if not logits.is_floating_point():
            raise TypeError(f"logits must be floating point, got {logits.dtype}")
        if logits.shape[0] == 0:
            empty = torch.zeros(0)
            return SamplerOutput(torch.zeros(0, dtype=torch.int64), empty, empty.clone(), empty.clone())
        with torch.no_grad():
            return self._run(logits.detach(), requests)

    # ------------------------------------------------------------------------------------ internals
    def _buffer(self, name: str, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        # On CPU a fresh [B, V] float32 tensor is an mmap plus page faults on every step (it is
        # over glibc's mmap threshold), which costs as much as the math; reuse one buffer instead.
        # Accelerators have caching allocators, so we do not pin memory there.
        if device.type != "cpu":
            return torch.empty((rows, cols), dtype=torch.float32, device=device)
        need = rows * cols
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < need:
            buf = torch.empty(need, dtype=torch.float32)
            self._buffers[name] = buf
        return buf[:need].view(rows, cols)

    def _scratch(self, rows: int, vocab: int, device: torch.device) -> torch.Tensor:
        # Chunked on CPU so a chunk stays in cache across its passes; one chunk on accelerators.
        return self._buffer(
            "scratch", min(rows, cpu_chunk_rows(vocab)) if device.type == "cpu" else rows, vocab, device
        )

    def _run(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        num_rows, vocab = logits.shape
        dev = logits.device
        params = BatchParams.from_requests(requests, vocab)
        failed: dict[int, str] = {}

        sync_free = self.sync_free if self.sync_free is not None else dev.type != "cpu"
        if (
            not sync_free
            and not params.sampled_rows
            and not params.any_modified
            and params.num_top_logprobs == 0
            and _cpu_greedy_kernel(logits)
        ):
            return _greedy_on_cpu(logits)  # reads bfloat16 logits as they are (no float32 copy)
        if logits.dtype == torch.float32 and logits.is_contiguous():
            raw = logits  # read only from here on
        else:
            raw = self._buffer("raw", num_rows, vocab, dev).copy_(logits)
        proc = raw
        if params.any_modified:
            proc = self._buffer("proc", num_rows, vocab, dev).copy_(raw)
            self._apply_custom(proc, params, requests, failed)
            apply_banned_tokens(proc, params.banned_rows, params.banned_cols)
            apply_repetition_penalty(proc, requests, params.repetition_rows, params.repetition_penalty)
            apply_frequency_presence(
                proc, requests, params.freq_pres_rows, params.frequency_penalty, params.presence_penalty
            )
            apply_logit_bias(proc, params.bias_rows, params.bias_cols, params.bias_values)

        # Block maxima give the row maxima and, for greedy rows, the argmax in one pass.
        raw_bmax = block_reduce(raw, "max")
        proc_bmax = raw_bmax if proc is raw else block_reduce(proc, "max")
        raw_shift = finite_or(raw_bmax.amax(dim=1), 0.0)
        proc_max = proc_bmax.amax(dim=1)
        token = torch.zeros(num_rows, dtype=torch.int64, device=dev)
        logprob = torch.zeros(num_rows, dtype=torch.float64, device=dev)
        kept = torch.full((num_rows,), float("nan"), dtype=torch.float64, device=dev)
        mass = torch.full((num_rows,), float("nan"), dtype=torch.float64, device=dev)
        top_k = params.num_top_logprobs
        topk_ids = topk_lp = None
        if top_k > 0:
            topk_ids = torch.full((num_rows, top_k), -1, dtype=torch.int64, device=dev)
            topk_lp = torch.full((num_rows, top_k), float("nan"), dtype=torch.float32, device=dev)

        sampled = None
        if params.sampled_rows:
            s_rows = self._rows(params.sampled_rows, num_rows, dev)
            if sync_free:
                res = self._sample_rows_sync_free(raw, proc, params, s_rows, raw_shift, proc_max)
            else:
                res = self._sample_rows(raw, proc, params, s_rows, raw_shift, proc_max, failed)
            sampled = (s_rows, res)
            self._scatter(token, s_rows, res.token)
            self._scatter(logprob, s_rows, res.logprob)
            self._scatter(kept, s_rows, res.kept)
            self._scatter(mass, s_rows, res.mass)

        # The raw normaliser of every row whose sampled e-values were not already exp(raw - max).
        # Without sampled rows that is every row, known on the host (no device read-back).
        if sampled is None:
            mass = exp_sum(raw, None, raw_shift, self._scratch(num_rows, vocab, dev)).to(mass.dtype)
        else:
            if res.mass_rows is None:
                missing = torch.isnan(mass).nonzero().squeeze(1)
            else:  # which rows lack it is known on the host
                have = {params.sampled_rows[j] for j in res.mass_rows}
                missing = torch.tensor([r for r in range(num_rows) if r not in have], dtype=torch.int64)
                missing = missing.to(dev)
            if missing.numel():
                rows_m = None if missing.numel() == num_rows else missing
                scratch = self._scratch(missing.numel(), vocab, dev)
                mass[missing] = exp_sum(raw, rows_m, raw_shift.index_select(0, missing), scratch)
        raw_lse = raw_shift.double() + torch.log(mass)

        if params.greedy_rows:
            self._greedy_rows(proc, proc_bmax, params, raw_lse, token, topk_ids, topk_lp)
        if sampled is not None and sampled[1].topk_rows is not None:
            s_rows, res = sampled
            glob = res.topk_rows if s_rows is None else s_rows.index_select(0, res.topk_rows)
            topk_ids[glob] = res.topk_ids
            topk_lp[glob] = res.topk_logprobs.float()

        raw_tok = raw.gather(1, token.unsqueeze(1)).squeeze(1).double()
        raw_lp = raw_tok - raw_lse
        log_kept = torch.where(torch.isnan(kept), torch.zeros_like(kept), torch.log(kept) - torch.log(mass))
        # Row failures the device finds are flags, read back with the tokens, not here.
        flags = torch.where(~torch.isfinite(raw_lse), FLAG_BAD_LOGITS, FLAG_OK).to(torch.int8)
        if params.greedy_rows:
            g = torch.tensor(params.greedy_rows, device=dev)
            log_kept[g] = raw_lp.index_select(0, g)
            stuck = ~torch.isfinite(proc_max.index_select(0, g))
            flags[g] = torch.where(stuck, FLAG_NOTHING_CHOOSABLE, flags.index_select(0, g)).to(torch.int8)
        if sampled is not None and sampled[1].bad is not None:
            s_rows, res = sampled
            s_flags = flags if s_rows is None else flags.index_select(0, s_rows)
            s_flags = torch.where(res.bad, FLAG_NOTHING_CHOOSABLE, s_flags).to(torch.int8)
            self._scatter(flags, s_rows, s_flags)
        # One device-to-host copy for everything the step reports (ids are exact in float64).
        cols = [token.double(), logprob.double(), raw_lp.double(), log_kept.double(), flags.double()]
        k = 0 if topk_ids is None else topk_ids.shape[1]
        host = torch.cat(
            [c.unsqueeze(1) for c in cols] + ([topk_ids.double(), topk_lp.double()] if k else []), 1
        )
        host = host.cpu()
        return SamplerOutput(
            token_ids=host[:, 0].long(),
            logprobs=host[:, 1].float(),
            raw_logprobs=host[:, 2].float(),
            log_kept_mass=host[:, 3].float(),
            topk_ids=host[:, 5 : 5 + k].long() if k else None,
            topk_logprobs=host[:, 5 + k :].float() if k else None,
            host_failed=failed,
            row_flags=host[:, 4].to(torch.int8),
            device_token_ids=token,
        )

    @staticmethod
    def _rows(rows: list[int], num_rows: int, device: torch.device) -> torch.Tensor | None:
        # None stands for "every row, in order", which lets the math skip gathers entirely.
        return None if len(rows) == num_rows else torch.tensor(rows, dtype=torch.int64, device=device)

    @staticmethod
    def _scatter(dst: torch.Tensor, rows: torch.Tensor | None, values: torch.Tensor) -> None:
        if rows is None:
            dst.copy_(values)
        else:
            dst[rows] = values.to(dst.dtype)

    def _apply_custom(
        self, logits: torch.Tensor, params: BatchParams, requests: Sequence[Request], failed: dict[int, str]
    ) -> None:
        vocab = logits.shape[1]
        # Registration order, not batch order, so the result does not depend on batch composition.
        names = [n for n in self._processors if n in params.processor_rows]
        names += [n for n in params.processor_rows if n not in self._processors]
        for name in names:
            rows = params.processor_rows[name]
            processor = self._processors.get(name)
            if processor is None:
                for r in rows:
                    failed[r] = f"unknown logits processor {name!r} (known: {sorted(self._processors)})"
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

    def _uniforms(self, params: BatchParams, device: torch.device) -> torch.Tensor:
        u = torch.zeros(params.num_rows, dtype=torch.float64)
        if params.seeded_rows:
            u[torch.tensor(params.seeded_rows)] = torch.tensor(params.seeded_u, dtype=torch.float64)
        if params.unseeded_rows:
            n = len(params.unseeded_rows)
            u[torch.tensor(params.unseeded_rows)] = torch.rand(
                n, generator=self._generator, dtype=torch.float64
            )
        return u.to(device)

    def _sample_rows(
        self,
        raw: torch.Tensor,
        proc: torch.Tensor,
        params: BatchParams,
        rows: torch.Tensor | None,
        raw_shift: torch.Tensor,
        proc_max: torch.Tensor,
        failed: dict[int, str],
    ) -> _SampledRows:
        vocab = raw.shape[1]
        dev = raw.device
        rows_list = params.sampled_rows
        n = len(rows_list)

        def sel(t: torch.Tensor) -> torch.Tensor:
            t = t.to(dev)
            return t if rows is None else t.index_select(0, rows)

        glob = torch.arange(n, device=dev) if rows is None else rows
        temperature = sel(params.temperature)
        proc_max = proc_max if rows is None else proc_max.index_select(0, rows)
        shift = finite_or(proc_max, 0.0)
        e = self._buffer("e", n, vocab, dev)
        unmodified = torch.tensor([not params.modified[r] for r in rows_list], dtype=torch.bool, device=dev)
        # Rows that are raw logits at a temperature other than 1 get their raw normaliser on the way.
        want_plain = params.any_temperature and bool(unmodified.any())
        bsum, bmax, plain_sum = exp_rows(
            proc,
            rows,
            shift,
            temperature if params.any_temperature else None,
            e,
            scratch=self._scratch(n, vocab, dev) if want_plain else None,
        )
        total = bsum.sum(1)
        bad = ~torch.isfinite(proc_max) | ~torch.isfinite(total) | (total <= 0)
        if bool(bad.any()):
            b = bad.nonzero().squeeze(1)
            for j in b.tolist():
                failed[rows_list[j]] = (
                    "no token can be sampled: every logit is -inf or the logits hold NaN/inf"
                )
            # Give those rows a harmless uniform distribution so the batch math stays finite.
            e[b] = 1.0
            bsum[b] = block_reduce(e[b], "sum")
            bmax[b] = 1.0
            total[b] = float(vocab)
            shift = torch.where(bad, torch.zeros_like(shift), shift)
        u = sel(self._uniforms(params, dev))
        # Rows whose processed e-values are exactly exp(raw - raw_max): their sum is the raw normaliser.
        identity = torch.tensor([params.identity[r] for r in rows_list], dtype=torch.bool, device=dev)
        nan = torch.full_like(total, float("nan"))
        mass = torch.where(identity & ~bad, total, nan)
        if plain_sum is not None:
            mass = torch.where(unmodified & ~identity & ~bad, plain_sum, mass)

        token = torch.zeros(n, dtype=torch.int64, device=dev)
        kept = torch.full((n,), float("nan"), dtype=torch.float64, device=dev)
        tau = torch.zeros(n, dtype=torch.float32, device=dev)
        plain = torch.ones(n, dtype=torch.bool, device=dev)
        if params.any_truncation:
            top_k, top_p, min_p = sel(params.top_k), sel(params.top_p), sel(params.min_p)
            t_rows = ((top_k > 0) | (top_p < 1.0) | (min_p > 0)).nonzero().squeeze(1)
            if t_rows.numel():
                tr = truncation_thresholds(
                    e,
                    t_rows,
                    total.index_select(0, t_rows),
                    top_k.index_select(0, t_rows),
                    top_p.index_select(0, t_rows),
                    min_p.index_select(0, t_rows),
                    bmax,
                )
                tau[t_rows] = tr.tau
                cuts = tr.tau > 0
                plain[t_rows] = ~cuts
                # Survivors all in the sorted candidate list: sample from the list alone.
                pos = (cuts & tr.complete).nonzero().squeeze(1)
                if pos.numel():
                    loc = t_rows.index_select(0, pos)
                    vals = tr.values.index_select(0, pos)
                    ids = tr.ids.index_select(0, pos)
                    weights = vals.double() * (vals >= tr.tau.index_select(0, pos).unsqueeze(1))
                    j = _inverse_cdf(weights, u.index_select(0, loc))
                    token[loc] = ids.gather(1, j.unsqueeze(1)).squeeze(1)
                    total[loc] = weights.sum(1)
                    g = glob.index_select(0, loc)
                    raw_vals = raw[g.unsqueeze(1), ids].double() - raw_shift.index_select(
                        0, g
                    ).double().unsqueeze(1)
                    kept[loc] = (torch.exp(raw_vals) * (weights > 0)).sum(1)
                # Survivors spill past the list (ties or a wide nucleus): mask whole rows.
                pos = (cuts & ~tr.complete).nonzero().squeeze(1)
                if pos.numel():
                    loc = t_rows.index_select(0, pos)
                    w = self._buffer("masked", loc.numel(), vocab, dev)
                    torch.index_select(e, 0, loc, out=w)
                    w.mul_(w >= tau.index_select(0, loc).unsqueeze(1))
                    wsum = block_reduce(w, "sum")
                    token[loc] = _inverse_cdf_blocked(w, None, wsum, u.index_select(0, loc))
                    total[loc] = wsum.sum(1)
                    ident = identity.index_select(0, loc)
                    if bool(ident.all()):
                        kept[loc] = total.index_select(0, loc)
                    else:
                        scratch = self._scratch(loc.numel(), vocab, dev)
                        g = glob.index_select(0, loc)
                        kept[loc] = exp_sum(
                            raw,
                            g,
                            raw_shift.index_select(0, g),
                            scratch,
                            keep=w,
                            keep_rows=None,
                            keep_above=0.0,
                        )
        p_rows = plain.nonzero().squeeze(1)
        if p_rows.numel():
            loc = None if p_rows.numel() == n else p_rows
            bs = bsum if loc is None else bsum.index_select(0, p_rows)
            token[p_rows] = _inverse_cdf_blocked(e, loc, bs, u.index_select(0, p_rows))
            masked = torch.tensor([params.masked[r] for r in rows_list], dtype=torch.bool, device=dev)
            m_rows = (plain & masked & ~bad).nonzero().squeeze(1)
            if m_rows.numel():
                scratch = self._scratch(m_rows.numel(), vocab, dev)
                g = glob.index_select(0, m_rows)
                kept[m_rows] = exp_sum(
                    raw, g, raw_shift.index_select(0, g), scratch, keep=proc, keep_rows=g, keep_above=NEG_INF
                )

        x_tok = proc[glob, token].double()
        temp64 = temperature.double()
        logprob = (x_tok - shift.double()) / temp64 - torch.log(total)
        res = _SampledRows(token=token, logprob=logprob, kept=kept, mass=mass)
        self._top_logprobs(res, e, proc, params, glob, shift, temp64, total, tau, bmax)
        return res

    def _sample_rows_sync_free(
        self,
        raw: torch.Tensor,
        proc: torch.Tensor,
        params: BatchParams,
        rows: torch.Tensor | None,
        raw_shift: torch.Tensor,
        proc_max: torch.Tensor,
    ) -> _SampledRows:
        """:meth:`_sample_rows` without a single device read-back (see the class docstring).

        Every branch is decided on the host, from the requests.  Rows with truncation sort their
        whole e-row once and derive top-k, top-p and min-p thresholds from it (work the CPU path
        avoids with candidate lists and a widening ladder, which need read-backs to stop); rows that
        cannot be sampled are sampled from a uniform stand-in and reported in ``bad``.
        """
        vocab = raw.shape[1]
        dev = raw.device
        rows_list = params.sampled_rows
        n = len(rows_list)

        def sel(t: torch.Tensor) -> torch.Tensor:
            t = t.to(dev)
            return t if rows is None else t.index_select(0, rows)

        def local(js: list[int]) -> torch.Tensor:
            return torch.tensor(js, dtype=torch.int64).to(dev)

        glob = torch.arange(n, device=dev) if rows is None else rows
        temperature = sel(params.temperature)
        proc_max = proc_max if rows is None else proc_max.index_select(0, rows)
        shift = finite_or(proc_max, 0.0)
        e = self._buffer("e", n, vocab, dev)
        unmodified_l = [not params.modified[r] for r in rows_list]
        want_plain = params.any_temperature and any(unmodified_l)
        bsum, bmax, plain_sum = exp_rows(
            proc,
            rows,
            shift,
            temperature if params.any_temperature else None,
            e,
            scratch=self._scratch(n, vocab, dev) if want_plain else None,
        )
        total = bsum.sum(1)
        bad = ~torch.isfinite(proc_max) | ~torch.isfinite(total) | (total <= 0)
        # A uniform stand-in keeps the batch math finite; the flag fails the request at read-back.
        e.masked_fill_(bad.unsqueeze(1), 1.0)
        ones_bsum = block_reduce(torch.ones(1, vocab, device=dev), "sum")
        bsum = torch.where(bad.unsqueeze(1), ones_bsum, bsum)
        bmax = torch.where(bad.unsqueeze(1), torch.ones_like(bmax), bmax)
        total = torch.where(bad, torch.full_like(total, float(vocab)), total)
        shift = torch.where(bad, torch.zeros_like(shift), shift)
        u = sel(self._uniforms(params, dev))

        # The raw normaliser comes for free where the processed e-values are exp(raw - raw_max)
        # (identity rows) or where exp_rows summed the raw values on the way (unmodified rows).
        identity_l = [params.identity[r] for r in rows_list]
        mass_rows = [j for j in range(n) if identity_l[j] or (plain_sum is not None and unmodified_l[j])]
        mass = torch.full_like(total, float("nan"))
        if mass_rows:
            mass = torch.where(torch.tensor(identity_l).to(dev), total, mass)
            if plain_sum is not None:
                from_plain = [unmodified_l[j] and not identity_l[j] for j in range(n)]
                mass = torch.where(torch.tensor(from_plain).to(dev), plain_sum, mass)

        token = torch.zeros(n, dtype=torch.int64, device=dev)
        kept = torch.full((n,), float("nan"), dtype=torch.float64, device=dev)
        tau = torch.zeros(n, dtype=torch.float32, device=dev)
        is_truncated = set(params.truncated_rows)
        truncated = [j for j, r in enumerate(rows_list) if r in is_truncated]
        if truncated:
            t = local(truncated)
            vals, ids = torch.sort(e.index_select(0, t), dim=1, descending=True)
            top_k, top_p, min_p = sel(params.top_k)[t], sel(params.top_p)[t], sel(params.min_p)[t]
            kth = vals.gather(1, (top_k - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
            tau_t = torch.where(top_k > 0, kth, torch.zeros_like(kth))
            # Top-p on what top-k left: keep a token while the mass strictly before it is < top_p.
            w = vals.double() * (vals >= tau_t.unsqueeze(1))
            cum = w.cumsum(1)
            n_keep = ((cum - w) < (top_p * cum[:, -1]).unsqueeze(1)).sum(1)
            tau_p = vals.gather(1, (n_keep - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
            tau_t = torch.where(top_p < 1.0, torch.maximum(tau_t, tau_p), tau_t)
            tau_t = torch.maximum(tau_t, min_p)
            tau[t] = tau_t
            weights = vals.double() * (vals >= tau_t.unsqueeze(1))
            j = _inverse_cdf(weights, u.index_select(0, t))
            token[t] = ids.gather(1, j.unsqueeze(1)).squeeze(1)
            total[t] = weights.sum(1)
            g = glob.index_select(0, t)
            raw_vals = raw.index_select(0, g).gather(1, ids).double()
            raw_vals = raw_vals - raw_shift.index_select(0, g).double().unsqueeze(1)
            kept[t] = (torch.exp(raw_vals) * (weights > 0)).sum(1)
        plain = [j for j, r in enumerate(rows_list) if r not in is_truncated]
        if plain:
            p = None if len(plain) == n else local(plain)
            bs = bsum if p is None else bsum.index_select(0, p)
            up = u if p is None else u.index_select(0, p)
            self._scatter(token, p, _inverse_cdf_blocked(e, p, bs, up))
            masked = [j for j in plain if params.masked[rows_list[j]]]
            if masked:
                m = local(masked)
                g = glob.index_select(0, m)
                kept[m] = exp_sum(
                    raw,
                    g,
                    raw_shift.index_select(0, g),
                    self._scratch(len(masked), vocab, dev),
                    keep=proc,
                    keep_rows=g,
                    keep_above=NEG_INF,
                )

        x_tok = proc[glob, token].double()
        x_tok = torch.where(bad, shift.double(), x_tok)
        temp64 = temperature.double()
        logprob = (x_tok - shift.double()) / temp64 - torch.log(total)
        res = _SampledRows(token=token, logprob=logprob, kept=kept, mass=mass, bad=bad, mass_rows=mass_rows)
        self._top_logprobs(res, e, proc, params, glob, shift, temp64, total, tau, bmax)
        return res

    def _top_logprobs(
        self,
        res: _SampledRows,
        e: torch.Tensor,
        proc: torch.Tensor,
        params: BatchParams,
        glob: torch.Tensor,
        shift: torch.Tensor,
        temp64: torch.Tensor,
        total: torch.Tensor,
        tau: torch.Tensor,
        bmax: torch.Tensor,
    ) -> None:
        """Fills ``res.topk_*`` for the sampled rows that asked: processed logprobs, ``-inf`` if cut."""
        if params.num_top_logprobs <= 0:
            return
        wanted = set(params.logprob_rows)
        local = [j for j, r in enumerate(params.sampled_rows) if r in wanted]
        if not local:
            return
        lr = torch.tensor(local, dtype=torch.int64, device=e.device)
        vals, ids = topk_desc(e, params.num_top_logprobs, lr, bmax)
        g = glob.index_select(0, lr)
        x = proc[g.unsqueeze(1), ids].double()
        lp = (x - shift.index_select(0, lr).double().unsqueeze(1)) / temp64.index_select(0, lr).unsqueeze(1)
        lp = lp - torch.log(total.index_select(0, lr)).unsqueeze(1)
        survives = vals >= tau.index_select(0, lr).unsqueeze(1)
        res.topk_rows = lr
        res.topk_ids = ids
        res.topk_logprobs = torch.where(survives, lp, torch.full_like(lp, NEG_INF))

    def _greedy_rows(
        self,
        proc: torch.Tensor,
        proc_bmax: torch.Tensor,
        params: BatchParams,
        raw_lse: torch.Tensor,
        token: torch.Tensor,
        topk_ids: torch.Tensor | None,
        topk_lp: torch.Tensor | None,
    ) -> None:
        num_rows = proc.shape[0]
        dev = proc.device
        rows = self._rows(params.greedy_rows, num_rows, dev)
        self._scatter(token, rows, row_argmax(proc, rows, proc_bmax))
        if topk_ids is None or topk_lp is None:
            return
        wanted = set(params.logprob_rows)
        local = [j for j, r in enumerate(params.greedy_rows) if r in wanted]
        if not local:
            return
        lr = torch.tensor(local, dtype=torch.int64, device=dev)
        g = lr if rows is None else rows.index_select(0, lr)
        vals, ids = topk_desc(proc, topk_ids.shape[1], g, proc_bmax)
        # Which rows were modified is known on the host: no device read-back needed to pick them.
        mod_local = [k for k, j in enumerate(local) if params.modified[params.greedy_rows[j]]]
        lse = raw_lse.index_select(0, g)
        if mod_local:
            mod = torch.tensor(mod_local, dtype=torch.int64, device=dev)
            lse[mod] = logsumexp_rows(proc.index_select(0, g.index_select(0, mod)))
        topk_ids[g] = ids
        topk_lp[g] = (vals.double() - lse.unsqueeze(1)).float()


def _cpu_greedy_kernel(raw: torch.Tensor) -> bool:
    """Whether :func:`_greedy_on_cpu` can take these logits (float32 or bfloat16 rows on the CPU,
    kernels built)."""
    if raw.device.type != "cpu" or raw.dtype not in (torch.float32, torch.bfloat16) or raw.stride(1) != 1:
        return False
    from cbgen.model import cpu_kernels

    return cpu_kernels.available()


def _greedy_on_cpu(raw: torch.Tensor) -> SamplerOutput:
    """A batch of unmodified greedy rows without top logprobs, in one C kernel (two reads of the
    logits instead of the general path's several passes); same outputs and failure flags."""
    from cbgen.model import cpu_kernels

    token, top, lse = cpu_kernels.greedy_rows(raw)
    raw_lp = (top.double() - lse).float()
    ok = torch.full_like(token, FLAG_OK, dtype=torch.int8)
    flags = torch.where(torch.isfinite(lse), ok, torch.full_like(ok, FLAG_BAD_LOGITS))
    flags = torch.where(torch.isfinite(top), flags, torch.full_like(ok, FLAG_NOTHING_CHOOSABLE))
    return SamplerOutput(
        token_ids=token,
        logprobs=torch.zeros_like(raw_lp),
        raw_logprobs=raw_lp,
        log_kept_mass=raw_lp.clone(),
        row_flags=flags,
        device_token_ids=token,
    )


def _check_processor_output(out: object, rows: int, vocab: int) -> None:
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (rows, vocab):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"processor returned {shape}, expected a tensor of shape {(rows, vocab)}")


def _last_positive(weights: torch.Tensor) -> torch.Tensor:
    """Index of the last strictly positive entry of each row (0 if none)."""
    width = weights.shape[1]
    return width - 1 - (weights > 0).flip(1).to(torch.int32).argmax(dim=1)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """First index where ``cumsum(weights) > u * sum(weights)``, per row, in float64.

    A zero-weight entry can never be chosen: the cumulative sum does not rise there.  The
    ``u -> 1`` rounding edge falls back to the last positive entry.
    """
    w = weights.double()
    cum = w.cumsum(1)
    target = (u * cum[:, -1]).unsqueeze(1)
    j = torch.searchsorted(cum, target, right=True).squeeze(1)
    last = _last_positive(w)
    j = torch.where(j >= w.shape[1], last, j)
    ok = w.gather(1, j.unsqueeze(1)).squeeze(1) > 0
    return torch.where(ok, j, last)


def _inverse_cdf_blocked(
    w: torch.Tensor, rows: torch.Tensor | None, bsum: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """Inverse-CDF sampling over whole rows of ``w`` (or its ``rows``) using precomputed block sums.

    First the block whose cumulative sum passes ``u * total`` (float64 over the block sums), then the
    position inside that block (float64 cumsum of its ``BLOCK`` entries).  Returns column ids.
    """
    nb = bsum.shape[1]
    cum = bsum.cumsum(1)
    target = u * cum[:, -1]
    b = torch.searchsorted(cum, target.unsqueeze(1), right=True).squeeze(1)
    b = torch.where(b >= nb, _last_positive(bsum), b)
    before = torch.where(
        b > 0, cum.gather(1, (b - 1).clamp(min=0).unsqueeze(1)).squeeze(1), torch.zeros_like(target)
    )
    inner_u = (target - before).clamp(min=0.0)
    vals, cols = gather_blocks(w, b.unsqueeze(1), 0.0, rows)
    inner = vals.double()
    icum = inner.cumsum(1)
    j = torch.searchsorted(icum, inner_u.unsqueeze(1), right=True).squeeze(1)
    last = _last_positive(inner)
    j = torch.where(j >= BLOCK, last, j)
    ok = inner.gather(1, j.clamp(max=inner.shape[1] - 1).unsqueeze(1)).squeeze(1) > 0
    j = torch.where(ok, j, last)
    return cols.gather(1, j.unsqueeze(1)).squeeze(1)


__all__ = ["Sampler", "SamplerOutput", "prompt_logprobs", "seeded_uniform"]
