"""The sampler: turns one step's logits into one token per row, with the logprobs RL needs.

Processing order per row (the same as ``transformers`` ``generate()``):

0. the structured-output mask (:mod:`~cbgen.sample.structured`, every constrained row in one fill),
   custom batch logits processors and ``min_tokens`` suppression (EOS unless ``ignore_eos``, and
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
uniform, computed in float64 (over a whole row in two levels, block sums then one block, or over a
truncated row's sorted survivors), and can never be a token of zero probability.

Where the parts live: :mod:`~cbgen.sample.batch_params` reads the requests,
:mod:`~cbgen.sample.logits_processors` and :mod:`~cbgen.sample.penalties` are stages 0 and 1,
:mod:`~cbgen.sample.truncation` stages 3-5, :mod:`~cbgen.sample.greedy` the greedy rows, and
:mod:`~cbgen.sample.sampled_readback` / :mod:`~cbgen.sample.sampled_sync_free` the two algorithms
for sampled rows (see ``Sampler``'s ``sync_free``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cbgen.batch_invariant.logprobs import token_logprobs, truncated_logprobs
from cbgen.request import Request
from cbgen.sample.batch_params import BatchParams, seeded_uniform
from cbgen.sample.greedy import GreedyKernel, greedy_by_kernel, kernel_takes, sample_greedy_rows
from cbgen.sample.logits_processors import BatchLogitsProcessor, run_batch_processors
from cbgen.sample.penalties import (
    apply_banned_tokens,
    apply_frequency_presence,
    apply_logit_bias,
    apply_repetition_penalty,
)
from cbgen.sample.prompt_logprobs import prompt_logprobs
from cbgen.sample.row_ops import block_reduce, exp_sum, finite_or, row_subset, scatter_rows
from cbgen.sample.sampled import SampledRows
from cbgen.sample.sampled_readback import sample_rows_readback
from cbgen.sample.sampled_sync_free import sample_rows_sync_free
from cbgen.sample.sampler_output import FLAG_BAD_LOGITS, FLAG_NOTHING_CHOOSABLE, FLAG_OK, SamplerOutput
from cbgen.sample.structured import StructuredOutputs
from cbgen.sample.workspace import Workspace


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

    ``structured`` masks the rows of requests with ``structured_output``; without it such rows fail.

    ``greedy_kernel``: a kernel for batches of plain greedy rows (no penalties, processors or top
    logprobs) on the read-back path, the execution plan's choice (``ExecutionPlan.greedy_kernel()``:
    the C kernel on the CPU); None runs them through the general path.

    ``parity`` (the parity plan, ``batch_invariant=True``): raw logprobs are
    :func:`cbgen.batch_invariant.token_logprobs` of the logits, the function the trainer side uses,
    so they equal its values bit for bit (the other outputs are computed as usual).
    """

    def __init__(
        self,
        vocab_size: int,
        logits_processors: Sequence[BatchLogitsProcessor] = (),
        seed: int = 0,
        sync_free: bool | None = None,
        structured: StructuredOutputs | None = None,
        greedy_kernel: GreedyKernel | None = None,
        parity: bool = False,
    ) -> None:
        self.vocab_size = vocab_size
        self.parity = parity
        self.sync_free = sync_free
        self.greedy_kernel = greedy_kernel
        self.structured = structured
        self._processors: dict[str, BatchLogitsProcessor] = {}
        for proc in logits_processors:
            if proc.name in self._processors:
                raise ValueError(f"two logits processors are named {proc.name!r}")
            self._processors[proc.name] = proc
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(seed)
        self._workspace = Workspace()

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
    def _run(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        """Stage 0/1, then the sampled rows, the greedy rows and every row's raw logprobs."""
        params = BatchParams.from_requests(requests, logits.shape[1])
        failed: dict[int, str] = {}
        sync_free = self.sync_free if self.sync_free is not None else logits.device.type != "cpu"
        if (
            self.greedy_kernel is not None
            and not sync_free
            and not params.sampled_rows
            and not params.any_modified
            and params.num_top_logprobs == 0
            and kernel_takes(logits)
        ):
            # Reads bfloat16 logits as they are (no float32 copy).
            out = greedy_by_kernel(logits, self.greedy_kernel)
            if self.parity:
                # The argmax is exact in any order; the logprobs are the trainer side's.
                _parity_logprobs(out, logits, logits, params)
            return out
        raw, proc = self._stage_0_1(logits, params, requests, failed)
        step = _Step.start(raw, proc, params)
        if params.sampled_rows:
            rows = row_subset(params.sampled_rows, raw.shape[0], raw.device)
            ws, gen, raw_shift, proc_max = self._workspace, self._generator, step.raw_shift, step.proc_max
            if sync_free:
                res = sample_rows_sync_free(ws, gen, raw, proc, params, rows, raw_shift, proc_max)
            else:
                res = sample_rows_readback(ws, gen, raw, proc, params, rows, raw_shift, proc_max, failed)
            step.add_sampled(rows, res)
        raw_lse = step.raw_lse(self._workspace)
        if params.greedy_rows:
            sample_greedy_rows(proc, step.proc_bmax, params, raw_lse, step.token, step.topk_ids, step.topk_lp)
        step.add_sampled_top_logprobs()
        out = step.output(raw_lse, failed)
        if self.parity:
            _parity_logprobs(out, raw, proc, params)
        return out

    def _stage_0_1(
        self, logits: torch.Tensor, params: BatchParams, requests: Sequence[Request], failed: dict[int, str]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The raw logits as contiguous float32 and the stage 0/1 logits (the same tensor if unchanged)."""
        num_rows, vocab = logits.shape
        dev = logits.device
        if logits.dtype == torch.float32 and logits.is_contiguous():
            raw = logits  # read only from here on
        else:
            raw = self._workspace.buffer("raw", num_rows, vocab, dev).copy_(logits)
        if not params.any_modified:
            return raw, raw
        proc = self._workspace.buffer("proc", num_rows, vocab, dev).copy_(raw)
        if params.structured_rows:
            self._structured(proc, params.structured_rows, requests, failed)
        run_batch_processors(self._processors, proc, params, requests, failed)
        apply_banned_tokens(proc, params.banned_rows, params.banned_cols)
        apply_repetition_penalty(proc, requests, params.repetition_rows, params.repetition_penalty)
        apply_frequency_presence(
            proc, requests, params.freq_pres_rows, params.frequency_penalty, params.presence_penalty
        )
        apply_logit_bias(proc, params.bias_rows, params.bias_cols, params.bias_values)
        return raw, proc

    def _structured(
        self, proc: torch.Tensor, rows: list[int], requests: Sequence[Request], failed: dict[int, str]
    ) -> None:
        if self.structured is None:
            for r in rows:
                failed[r] = "structured output is not available in this sampler"
            return
        self.structured.apply(proc, rows, requests, failed)


def _parity_logprobs(out: SamplerOutput, raw: torch.Tensor, proc: torch.Tensor, params: BatchParams) -> None:
    """Parity mode: raw logprobs (and a greedy row's kept mass, which equals them) and the sampled
    rows' processed logprobs through the trainer side's functions (:mod:`cbgen.batch_invariant.logprobs`)."""
    raw_lp = token_logprobs(raw, out.device_token_ids).cpu()
    out.raw_logprobs = raw_lp
    if params.greedy_rows:
        g = torch.tensor(params.greedy_rows, dtype=torch.int64)
        out.log_kept_mass[g] = raw_lp[g]
    if params.sampled_rows:
        s = torch.tensor(params.sampled_rows, dtype=torch.int64)
        temperature, cut = params.temperature.index_select(0, s), out.kept_thresholds.index_select(0, s)
        if proc is raw:
            # Unprocessed logits at temperature 1 with nothing cut: truncated_logprobs' input is the
            # raw row itself (x / 1 and the all-true mask are exact), so its value is the raw logprob.
            same = (temperature == 1.0) & (cut == float("-inf"))
            out.logprobs[s[same]] = raw_lp[s[same]]
            s, temperature, cut = s[~same], temperature[~same], cut[~same]
        if len(s):
            dev = proc.device
            lp = truncated_logprobs(
                proc.index_select(0, s.to(dev)),
                out.device_token_ids.index_select(0, s.to(dev)),
                temperature.to(dev),
                cut.to(dev),
            )
            out.logprobs[s] = lp.cpu()


@dataclass
class _Step:
    """One step's batch-wide tensors, on the logits' device, while its rows are being sampled."""

    params: BatchParams
    raw: torch.Tensor
    proc: torch.Tensor
    proc_bmax: torch.Tensor
    raw_shift: torch.Tensor  # raw row maxima (0 where not finite)
    proc_max: torch.Tensor
    token: torch.Tensor
    logprob: torch.Tensor  # float64
    kept: torch.Tensor  # float64, see SampledRows
    mass: torch.Tensor  # float64 sum of exp(raw - raw_shift), NaN until known
    topk_ids: torch.Tensor | None
    topk_lp: torch.Tensor | None
    kept_count: torch.Tensor  # int64, the kept-set record (SamplerOutput)
    kept_threshold: torch.Tensor  # float32
    sampled_rows: torch.Tensor | None = None  # row_subset() of params.sampled_rows
    sampled: SampledRows | None = None

    @classmethod
    def start(cls, raw: torch.Tensor, proc: torch.Tensor, params: BatchParams) -> _Step:
        """Row maxima and the output tensors, before any row is sampled."""
        num_rows = raw.shape[0]
        dev = raw.device
        # Block maxima give the row maxima and, for greedy rows, the argmax in one pass.
        raw_bmax = block_reduce(raw, "max")
        proc_bmax = raw_bmax if proc is raw else block_reduce(proc, "max")
        top_k = params.num_top_logprobs
        topk_ids = topk_lp = None
        if top_k > 0:
            topk_ids = torch.full((num_rows, top_k), -1, dtype=torch.int64, device=dev)
            topk_lp = torch.full((num_rows, top_k), float("nan"), dtype=torch.float32, device=dev)
        return cls(
            params=params,
            raw=raw,
            proc=proc,
            proc_bmax=proc_bmax,
            raw_shift=finite_or(raw_bmax.amax(dim=1), 0.0),
            proc_max=proc_bmax.amax(dim=1),
            token=torch.zeros(num_rows, dtype=torch.int64, device=dev),
            logprob=torch.zeros(num_rows, dtype=torch.float64, device=dev),
            kept=torch.full((num_rows,), float("nan"), dtype=torch.float64, device=dev),
            mass=torch.full((num_rows,), float("nan"), dtype=torch.float64, device=dev),
            topk_ids=topk_ids,
            topk_lp=topk_lp,
            kept_count=torch.zeros(num_rows, dtype=torch.int64, device=dev),
            kept_threshold=torch.full((num_rows,), float("-inf"), dtype=torch.float32, device=dev),
        )

    def add_sampled(self, rows: torch.Tensor | None, res: SampledRows) -> None:
        """Takes the sampled rows' results (``rows``: their batch rows, ``None``: all)."""
        self.sampled_rows, self.sampled = rows, res
        scatter_rows(self.token, self.sampled_rows, res.token)
        scatter_rows(self.logprob, self.sampled_rows, res.logprob)
        scatter_rows(self.kept, self.sampled_rows, res.kept)
        scatter_rows(self.mass, self.sampled_rows, res.mass)
        if res.kept_count is not None:
            scatter_rows(self.kept_count, self.sampled_rows, res.kept_count)
            scatter_rows(self.kept_threshold, self.sampled_rows, res.kept_threshold)

    def raw_lse(self, ws: Workspace) -> torch.Tensor:
        """Every row's raw log-normaliser, completing ``mass`` where the sampled rows left it unset."""
        raw, dev = self.raw, self.raw.device
        num_rows, vocab = raw.shape
        res = self.sampled
        # The rows whose sampled e-values were not already exp(raw - max) need a pass over the raw
        # logits.  Without sampled rows that is every row, known on the host (no device read-back).
        if res is None:
            self.mass = exp_sum(raw, None, self.raw_shift, ws.scratch(num_rows, vocab, dev)).to(
                self.mass.dtype
            )
        else:
            if res.mass_rows is None:
                missing = torch.isnan(self.mass).nonzero().squeeze(1)
            else:  # which rows lack it is known on the host
                have = {self.params.sampled_rows[j] for j in res.mass_rows}
                missing = torch.tensor([r for r in range(num_rows) if r not in have], dtype=torch.int64)
                missing = missing.to(dev)
            if missing.numel():
                rows_m = None if missing.numel() == num_rows else missing
                scratch = ws.scratch(missing.numel(), vocab, dev)
                self.mass[missing] = exp_sum(raw, rows_m, self.raw_shift.index_select(0, missing), scratch)
        return self.raw_shift.double() + torch.log(self.mass)

    def add_sampled_top_logprobs(self) -> None:
        """Copies the sampled rows' top logprobs into the batch-wide tensors."""
        res = self.sampled
        if res is None or res.topk_rows is None:
            return
        s_rows = self.sampled_rows
        glob = res.topk_rows if s_rows is None else s_rows.index_select(0, res.topk_rows)
        self.topk_ids[glob] = res.topk_ids
        self.topk_lp[glob] = res.topk_logprobs.float()

    def output(self, raw_lse: torch.Tensor, failed: dict[int, str]) -> SamplerOutput:
        """Raw logprobs, kept mass and failure flags of every row, copied to the host in one go."""
        params, token, kept, dev = self.params, self.token, self.kept, self.raw.device
        raw_tok = self.raw.gather(1, token.unsqueeze(1)).squeeze(1).double()
        raw_lp = raw_tok - raw_lse
        log_kept = torch.where(
            torch.isnan(kept), torch.zeros_like(kept), torch.log(kept) - torch.log(self.mass)
        )
        # Row failures the device finds are flags, read back with the tokens, not here.
        flags = torch.where(~torch.isfinite(raw_lse), FLAG_BAD_LOGITS, FLAG_OK).to(torch.int8)
        if params.greedy_rows:
            g = torch.tensor(params.greedy_rows, device=dev)
            log_kept[g] = raw_lp.index_select(0, g)
            self.kept_count[g] = 1
            self.kept_threshold[g] = self.proc_max.index_select(0, g).float()
            stuck = ~torch.isfinite(self.proc_max.index_select(0, g))
            flags[g] = torch.where(stuck, FLAG_NOTHING_CHOOSABLE, flags.index_select(0, g)).to(torch.int8)
        if self.sampled is not None and self.sampled.bad is not None:
            s_rows = self.sampled_rows
            s_flags = flags if s_rows is None else flags.index_select(0, s_rows)
            s_flags = torch.where(self.sampled.bad, FLAG_NOTHING_CHOOSABLE, s_flags).to(torch.int8)
            scatter_rows(flags, s_rows, s_flags)
        columns = [self.logprob.double(), raw_lp.double(), log_kept.double(), flags.double()]
        columns += [self.kept_count.double(), self.kept_threshold.double()]
        return SamplerOutput.from_device(token, columns, self.topk_ids, self.topk_lp, failed)


__all__ = ["Sampler", "SamplerOutput", "prompt_logprobs", "seeded_uniform"]
