"""Vectorised per-request logits processing for the :class:`~cbgen.sample.sampler.Sampler`.

One O(B) Python pass over the requests (:meth:`BatchParams.from_requests`) turns per-request
settings into flat lists and tensors; everything after that is batched tensor math with no
per-row Python loop.

Truncation works in "e-space": for a sampled row with processed logits ``x`` and temperature
``T`` the sampler materialises ``e = exp((x - max(x)) / T)``, so ``e`` lies in ``[0, 1]`` with
exactly ``1`` at the argmax.  Top-k, top-p and min-p then reduce to one per-row threshold
``tau``: the survivors are the tokens with ``e >= tau`` (ties with the cut-off value are kept,
like the ``logits < kth_value`` rule of ``transformers``).  Min-p compares against the maximum
probability, which is exactly ``e == 1``, so its threshold is ``min_p`` itself.

Several helpers prune by fixed-width column blocks: the top-``k`` values of a row all lie in the
``k`` blocks with the largest block maxima, so ``topk`` only has to look at ``k * BLOCK``
columns, and a row's argmax is found from block maxima plus one block.  On CPUs those
reductions are several times cheaper than the dense kernels they replace.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cbgen.request import Request

NEG_INF = float("-inf")
# float32 exp() of arguments below about -87 yields subnormals, which on x86 runs 50-100x slower
# (microcode assists) and is routine here: logits 30 below the max at temperature 0.3.  safe_exp_
# clamps there and subtracts exp(floor), so those entries become exactly 0 and every result above
# ~1e-31 is bit-identical to exp().
_EXP_FLOOR = -87.0
_EXP_FLOOR_VALUE = float(torch.exp(torch.tensor(_EXP_FLOOR, dtype=torch.float32)))
# Width of the column blocks used for pruned top-k, block argmax and two-level inverse-CDF sampling.
BLOCK = 64
# Candidate list widths tried for top-p on accelerators before a full sort of the row (on CPU the
# numpy sort is cheap enough to go straight to it after the first width).
TOP_P_WIDTHS = (64, 1024, 8192)
# Rows per chunk for the dense exp passes on CPU: small enough that the chunk stays in cache
# between the subtract, divide, exp and reduce passes (16 rows of a 49k vocabulary), and no smaller,
# because with a small vocabulary each chunk's handful of ops costs more than its math.
CPU_CHUNK_ELEMS = 16 * 49152


def cpu_chunk_rows(vocab: int) -> int:
    """Rows per chunk of the CPU exp passes for a vocabulary of ``vocab`` columns."""
    return max(1, CPU_CHUNK_ELEMS // max(vocab, 1))


def _uniform_from_hash(seed: int, sample_index: int, position: int) -> float:
    """Counter-based uniform in (0, 1) from splitmix64; depends on nothing but its three inputs."""
    mask = (1 << 64) - 1

    def mix(z: int) -> int:
        z = (z + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    h = mix(seed & mask)
    h = mix(h ^ (sample_index & mask))
    h = mix(h ^ (position & mask))
    # 53 random bits centred in their cell: never exactly 0 or 1.
    return ((h >> 11) + 0.5) / float(1 << 53)


def seeded_uniform(seed: int, sample_index: int, position: int) -> float:
    """The uniform a seeded request uses for output position ``position`` of sample ``sample_index``.

    It is a pure function of its arguments, so a seeded sample does not depend on the batch it
    is scheduled in, on its row, on preemption or on anything else in the process.
    """
    return _uniform_from_hash(seed, sample_index, position)


@dataclass
class BatchParams:
    """Per-row sampling settings of one batch, gathered in a single pass over the requests.

    Row lists are plain Python lists (cheap to build, turned into tensors once by the caller);
    per-row scalars are CPU tensors of length ``num_rows``.  ``modified[i]`` says the processed
    logits of row ``i`` may differ from the raw ones; ``masked[i]`` that stage 0/1 may have set
    some of them to ``-inf`` (custom processors, ``min_tokens``, a ``-inf`` logit bias).
    """

    num_rows: int
    vocab_size: int
    greedy_rows: list[int] = field(default_factory=list)
    sampled_rows: list[int] = field(default_factory=list)
    truncated_rows: list[int] = field(default_factory=list)  # sampled rows with top-k/top-p/min-p
    temperature: torch.Tensor | None = None  # float32 [B]; 1.0 for greedy rows
    top_k: torch.Tensor | None = None  # int64 [B]; 0 = off
    top_p: torch.Tensor | None = None  # float64 [B]; 1.0 = off
    min_p: torch.Tensor | None = None  # float32 [B]; 0.0 = off
    repetition_rows: list[int] = field(default_factory=list)
    repetition_penalty: list[float] = field(default_factory=list)
    freq_pres_rows: list[int] = field(default_factory=list)
    frequency_penalty: list[float] = field(default_factory=list)
    presence_penalty: list[float] = field(default_factory=list)
    bias_rows: list[int] = field(default_factory=list)
    bias_cols: list[int] = field(default_factory=list)
    bias_values: list[float] = field(default_factory=list)
    banned_rows: list[int] = field(default_factory=list)
    banned_cols: list[int] = field(default_factory=list)
    processor_rows: dict[str, list[int]] = field(default_factory=dict)
    processor_args: dict[str, list[Any]] = field(default_factory=dict)
    modified: list[bool] = field(default_factory=list)
    masked: list[bool] = field(default_factory=list)
    identity: list[bool] = field(default_factory=list)  # sampled, unmodified, temperature 1
    seeded_rows: list[int] = field(default_factory=list)
    seeded_u: list[float] = field(default_factory=list)
    unseeded_rows: list[int] = field(default_factory=list)
    logprob_rows: list[int] = field(default_factory=list)
    num_top_logprobs: int = 0
    any_temperature: bool = False
    any_truncation: bool = False

    @property
    def any_modified(self) -> bool:
        """True when stage 0/1 changes at least one row (the sampler then needs a private copy)."""
        return any(self.modified)

    @classmethod
    def from_requests(cls, requests: Sequence[Request], vocab_size: int) -> BatchParams:
        """Reads every request once; ``vocab_size`` is the logits width (ids at or above it are ignored)."""
        n = len(requests)
        out = cls(num_rows=n, vocab_size=vocab_size)
        # Rows start as plain greedy rows (the common case, kept to a few attribute reads per row:
        # this runs every step for every running request); other rows overwrite their entries.
        temperature, top_k, top_p, min_p = [1.0] * n, [0] * n, [1.0] * n, [0.0] * n
        out.modified, out.masked, out.identity = [False] * n, [False] * n, [False] * n
        for i, req in enumerate(requests):
            p = req.params
            greedy = p.temperature == 0.0
            if (
                greedy
                and p.repetition_penalty == 1.0
                and not p.frequency_penalty
                and not p.presence_penalty
                and not p.logit_bias
                and not p.logits_processor_args
                and p.logprobs is None
                and req.num_output_tokens >= p.min_tokens
            ):
                out.greedy_rows.append(i)
                continue
            modified = masked = False
            if greedy:
                out.greedy_rows.append(i)
            else:
                out.sampled_rows.append(i)
                t = float(p.temperature)
                temperature[i] = t
                out.any_temperature |= t != 1.0
                k = p.top_k if 0 < p.top_k < vocab_size else 0
                top_k[i] = k
                top_p[i] = float(p.top_p)
                min_p[i] = float(p.min_p)
                if k > 0 or p.top_p < 1.0 or p.min_p > 0.0:
                    out.any_truncation = True
                    out.truncated_rows.append(i)
                if p.seed is not None:
                    out.seeded_rows.append(i)
                    out.seeded_u.append(_uniform_from_hash(p.seed, req.sample_index, req.num_output_tokens))
                else:
                    out.unseeded_rows.append(i)
            if p.repetition_penalty != 1.0:
                out.repetition_rows.append(i)
                out.repetition_penalty.append(float(p.repetition_penalty))
                modified = True
            if (p.frequency_penalty or p.presence_penalty) and req.num_output_tokens > 0:
                out.freq_pres_rows.append(i)
                out.frequency_penalty.append(float(p.frequency_penalty))
                out.presence_penalty.append(float(p.presence_penalty))
                modified = True
            if p.logit_bias:
                for token, bias in p.logit_bias.items():
                    if 0 <= token < vocab_size and bias != 0.0:
                        out.bias_rows.append(i)
                        out.bias_cols.append(token)
                        out.bias_values.append(bias)
                        modified = True
                        masked |= bias == NEG_INF
            if req.num_output_tokens < p.min_tokens:
                banned = set(p.stop_token_ids or ())
                if not p.ignore_eos:
                    banned |= req.eos_token_ids
                for token in banned:
                    if 0 <= token < vocab_size:
                        out.banned_rows.append(i)
                        out.banned_cols.append(token)
                        modified = masked = True
            if p.logits_processor_args:
                for name, arg in p.logits_processor_args.items():
                    out.processor_rows.setdefault(name, []).append(i)
                    out.processor_args.setdefault(name, []).append(arg)
                    modified = masked = True
            if p.logprobs is not None:
                out.logprob_rows.append(i)
                out.num_top_logprobs = max(out.num_top_logprobs, p.logprobs)
            out.modified[i] = modified
            out.masked[i] = masked
            out.identity[i] = not greedy and not modified and p.temperature == 1.0
        out.temperature = torch.tensor(temperature, dtype=torch.float32)
        out.top_k = torch.tensor(top_k, dtype=torch.int64)
        out.top_p = torch.tensor(top_p, dtype=torch.float64)
        out.min_p = torch.tensor(min_p, dtype=torch.float32)
        return out


# ---------------------------------------------------------------------------------------- stage 0/1
# These work on a private, contiguous float32 [B, V] tensor in place, through its flat view, so
# their cost is proportional to the number of touched entries rather than to B * V.


# The CPU shortcut below reads a value back; tests turn it off to check the device path on CPU.
CPU_EXP_SHORTCUT = True


def safe_exp_(x: torch.Tensor) -> torch.Tensor:
    """In-place ``exp`` of a float32 tensor of non-positive values, flushing results below ~1.6e-38 to 0."""
    # On CPU one min-reduction is cheaper than the clamp and subtract it lets us skip; elsewhere
    # avoid the host sync.
    if CPU_EXP_SHORTCUT and x.device.type == "cpu" and x.numel() and bool(x.amin() >= _EXP_FLOOR):
        return x.exp_()
    return x.clamp_(min=_EXP_FLOOR).exp_().sub_(_EXP_FLOOR_VALUE)


def _flat_index(rows: torch.Tensor, cols: torch.Tensor, vocab: int) -> torch.Tensor:
    return rows * vocab + cols


def apply_banned_tokens(logits: torch.Tensor, rows: Sequence[int], cols: Sequence[int]) -> None:
    """Sets ``logits[rows[j], cols[j]] = -inf`` (used for ``min_tokens`` suppression)."""
    if not rows:
        return
    dev = logits.device
    idx = _flat_index(torch.tensor(rows, device=dev), torch.tensor(cols, device=dev), logits.shape[1])
    logits.view(-1).index_fill_(0, idx, NEG_INF)


def _token_index(
    requests: Sequence[Request], rows: Sequence[int], vocab: int, outputs_only: bool
) -> torch.Tensor:
    """Flat ``row * V + token`` indices of each listed row's (prompt+output or output) tokens, on the
    host: deduplicating there keeps the data-dependent sizes away from the device (no sync)."""
    lists = []
    for r in rows:
        req = requests[r]
        lists.append(req.token_ids[req.num_prompt_tokens :] if outputs_only else req.token_ids)
    lengths = [len(t) for t in lists]
    # np.fromiter over a chain is several times faster than torch.tensor on a long Python list.
    tok = torch.from_numpy(
        np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=sum(lengths))
    )
    row = torch.repeat_interleave(torch.tensor(list(rows), dtype=torch.int64), torch.tensor(lengths))
    keep = (tok >= 0) & (tok < vocab)
    return _flat_index(row[keep], tok[keep], vocab)


def apply_repetition_penalty(
    logits: torch.Tensor, requests: Sequence[Request], rows: Sequence[int], penalties: Sequence[float]
) -> None:
    """``transformers`` semantics: every distinct prompt or output token is penalised once,
    positive logits divided by the penalty and negative ones multiplied by it."""
    if not rows:
        return
    vocab = logits.shape[1]
    dev = logits.device
    # Deduplicate so each entry is written exactly once: writes with duplicate indices are
    # nondeterministic in general.  index_put_ (not index_copy_/index_add_) is used for writes
    # because it stays allowed under torch.use_deterministic_algorithms on GPUs.
    idx = torch.unique(_token_index(requests, rows, vocab, False)).to(dev)
    per_row = torch.ones(logits.shape[0], dtype=torch.float32, device=dev)
    per_row[torch.tensor(rows, device=dev)] = torch.tensor(penalties, dtype=torch.float32, device=dev)
    pen = per_row[idx // vocab]
    flat = logits.view(-1)
    vals = flat.index_select(0, idx)
    flat.index_put_((idx,), torch.where(vals > 0, vals / pen, vals * pen))


def apply_frequency_presence(
    logits: torch.Tensor,
    requests: Sequence[Request],
    rows: Sequence[int],
    frequency: Sequence[float],
    presence: Sequence[float],
) -> None:
    """OpenAI/vLLM semantics over OUTPUT tokens: ``logit -= frequency * count + presence * (count > 0)``."""
    if not rows:
        return
    vocab = logits.shape[1]
    dev = logits.device
    idx = _token_index(requests, rows, vocab, True)
    if idx.numel() == 0:
        return
    uniq, counts = torch.unique(idx, return_counts=True)
    uniq, counts = uniq.to(dev), counts.to(dev)
    row_ids = torch.tensor(rows, device=dev)
    freq = torch.zeros(logits.shape[0], dtype=torch.float32, device=dev)
    pres = torch.zeros(logits.shape[0], dtype=torch.float32, device=dev)
    freq[row_ids] = torch.tensor(frequency, dtype=torch.float32, device=dev)
    pres[row_ids] = torch.tensor(presence, dtype=torch.float32, device=dev)
    r = uniq // vocab
    delta = freq[r] * counts.to(torch.float32) + pres[r]
    flat = logits.view(-1)
    flat.index_put_((uniq,), flat.index_select(0, uniq) - delta)


def apply_logit_bias(
    logits: torch.Tensor, rows: Sequence[int], cols: Sequence[int], values: Sequence[float]
) -> None:
    """Adds ``values[j]`` to ``logits[rows[j], cols[j]]`` (pairs are unique: they come from dicts)."""
    if not rows:
        return
    dev = logits.device
    idx = _flat_index(torch.tensor(rows, device=dev), torch.tensor(cols, device=dev), logits.shape[1])
    flat = logits.view(-1)
    flat.index_put_((idx,), flat.index_select(0, idx) + torch.tensor(values, dtype=torch.float32, device=dev))


# ---------------------------------------------------------------------------------------- blocks


def block_reduce(x: torch.Tensor, op: str) -> torch.Tensor:
    """Per-block ``"max"`` or ``"sum"`` over ``BLOCK``-wide column blocks of a 2-D tensor.

    The last block may be narrower.  Sums are returned in float64 (accumulated in float32 inside
    a block; the relative error, ~1e-7, is far below float32 input precision).
    """
    vocab = x.shape[1]
    full = vocab // BLOCK
    parts = []
    if full:
        main = x[:, : full * BLOCK].unflatten(1, (full, BLOCK))
        parts.append(main.amax(-1) if op == "max" else main.sum(-1))
    if vocab % BLOCK:
        tail = x[:, full * BLOCK :]
        parts.append(tail.amax(-1, keepdim=True) if op == "max" else tail.sum(-1, keepdim=True))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return out.double() if op == "sum" else out


def gather_blocks(
    x: torch.Tensor, blocks: torch.Tensor, fill: float, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Values and column ids of the selected blocks: ``blocks`` is ``[R, n]`` block ids per row.

    Columns past the end of the vocabulary (the short last block) read as ``fill``; their ids are
    clamped into range so they are always valid indices.
    """
    vocab = x.shape[1]
    cols = (blocks.unsqueeze(-1) * BLOCK + torch.arange(BLOCK, device=x.device)).flatten(1)
    valid = None
    if vocab % BLOCK:
        valid = cols < vocab
        cols = cols.clamp_max(vocab - 1)
    if rows is None:
        vals = x.gather(1, cols)
    elif x.is_contiguous():
        # A flat index_select is much cheaper than 2-D advanced indexing on CPU.
        flat = (rows * vocab).unsqueeze(1) + cols
        vals = x.view(-1).index_select(0, flat.view(-1)).view(flat.shape)
    else:
        vals = x[rows.unsqueeze(1), cols]
    if valid is not None:
        vals = vals.masked_fill(~valid, fill)
    return vals, cols


def sort_values_desc(x: torch.Tensor) -> torch.Tensor:
    """Each row's values sorted in descending order (no indices)."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        # numpy's SIMD sort is ~25x faster than torch's CPU sort, which also always builds indices.
        return torch.from_numpy(-np.sort(-x.numpy(), axis=1))
    return torch.sort(x, dim=1, descending=True).values


def row_argmax(
    x: torch.Tensor, rows: torch.Tensor | None = None, bmax: torch.Tensor | None = None
) -> torch.Tensor:
    """First index of each row's (or ``rows``') maximum, like ``torch.argmax`` (NaN counts as the maximum).

    ``bmax`` may pass precomputed block maxima of all rows of ``x``.
    """
    if bmax is None:
        bmax = block_reduce(x if rows is None else x.index_select(0, rows), "max")
    elif rows is not None:
        bmax = bmax.index_select(0, rows)
    best = bmax.argmax(dim=1, keepdim=True)
    vals, cols = gather_blocks(x, best, NEG_INF, rows)
    return cols.gather(1, vals.argmax(dim=1, keepdim=True)).squeeze(1)


def topk_desc(
    x: torch.Tensor, k: int, rows: torch.Tensor | None = None, bmax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` values (sorted descending) and their column ids for each row (or ``rows`` subset).

    The returned multiset of values is exact; among equal values the ids are arbitrary.
    ``bmax`` may pass precomputed block maxima of all rows of ``x``.
    """
    vocab = x.shape[1]
    k = min(k, vocab)
    if 2 * k * BLOCK > vocab:
        sub = x if rows is None else x.index_select(0, rows)
        if k == vocab:
            return torch.sort(sub, dim=1, descending=True)
        return torch.topk(sub, k, dim=1)
    if bmax is None:
        bmax = block_reduce(x if rows is None else x.index_select(0, rows), "max")
    elif rows is not None:
        bmax = bmax.index_select(0, rows)
    # Any value in the row's top-k lies in one of the k blocks with the largest maxima (if it sat in
    # another block, those k blocks would each hold a value at least as large: k+1 in all).
    blocks = torch.topk(bmax, k, dim=1).indices
    vals, cols = gather_blocks(x, blocks, NEG_INF, rows)
    top, pos = torch.topk(vals, k, dim=1)
    return top, cols.gather(1, pos)


def exp_rows(
    src: torch.Tensor,
    rows: torch.Tensor | None,
    shift: torch.Tensor,
    temperature: torch.Tensor | None,
    out: torch.Tensor,
    scratch: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``out = exp((src[rows] - shift) / temperature)`` row-wise, plus block sums and block maxima.

    Returns ``(block_sums float64 [R, nb], block_max [R, nb], shifted_sums float64 [R] or None)``.
    With a ``scratch`` buffer (and a temperature) it also returns ``sum(exp(src[rows] - shift))``,
    computed while the chunk is in cache: for rows whose processed logits are the raw ones this is
    the raw softmax normaliser, which saves a second pass over the raw logits.  On CPU the rows are
    processed in small chunks so all passes over a chunk hit cache.
    """
    n = out.shape[0]
    step = cpu_chunk_rows(out.shape[1]) if out.device.type == "cpu" else max(n, 1)
    sums = []
    maxes = []
    plain_sums = []
    for start in range(0, n, step):
        stop = min(start + step, n)
        o = out[start:stop]
        if rows is None:
            torch.sub(src[start:stop], shift[start:stop, None], out=o)
        else:
            torch.index_select(src, 0, rows[start:stop], out=o)
            o.sub_(shift[start:stop, None])
        if temperature is not None:
            if scratch is not None:
                t = scratch[: stop - start]
                safe_exp_(t.copy_(o))
                plain_sums.append(block_reduce(t, "sum").sum(1))
            o.div_(temperature[start:stop, None])
        safe_exp_(o)
        sums.append(block_reduce(o, "sum"))
        maxes.append(block_reduce(o, "max"))
    bsum = torch.cat(sums) if len(sums) != 1 else sums[0]
    bmax = torch.cat(maxes) if len(maxes) != 1 else maxes[0]
    return bsum, bmax, (torch.cat(plain_sums) if plain_sums else None)


def exp_sum(
    src: torch.Tensor,
    rows: torch.Tensor | None,
    shift: torch.Tensor,
    scratch: torch.Tensor,
    keep: torch.Tensor | None = None,
    keep_rows: torch.Tensor | None = None,
    keep_above: float = 0.0,
) -> torch.Tensor:
    """``sum(exp(src[rows] - shift))`` per row in float64.

    With ``keep``, only entries where ``keep[keep_rows] > keep_above`` count (``keep_rows=None``:
    ``keep`` is aligned with the output rows).  ``scratch`` is a float32 buffer whose row count sets
    the chunk size.
    """
    n = shift.shape[0]
    step = max(scratch.shape[0], 1)
    out = []
    for start in range(0, n, step):
        stop = min(start + step, n)
        o = scratch[: stop - start]
        if rows is None:
            torch.sub(src[start:stop], shift[start:stop, None], out=o)
        else:
            torch.index_select(src, 0, rows[start:stop], out=o)
            o.sub_(shift[start:stop, None])
        safe_exp_(o)
        if keep is not None:
            k = keep[start:stop] if keep_rows is None else keep.index_select(0, keep_rows[start:stop])
            o.mul_(k > keep_above)
        # Float32 sums inside 64-wide blocks, float64 across them: accurate, and no float64 copy of the chunk.
        out.append(block_reduce(o, "sum").sum(1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64, device=src.device)


# ---------------------------------------------------------------------------------------- truncation


@dataclass
class Truncation:
    """Result of :func:`truncation_thresholds` for a set of rows of the e-space tensor.

    ``tau``: survivors are ``e >= tau``.  ``values``/``ids``: the row's largest e-values (sorted
    descending) and their columns; ``complete``: whether that list holds every survivor, so the row
    can be sampled from the list alone.
    """

    tau: torch.Tensor
    values: torch.Tensor
    ids: torch.Tensor
    complete: torch.Tensor


def truncation_thresholds(
    e: torch.Tensor,
    rows: torch.Tensor,
    row_sums: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    bmax: torch.Tensor | None = None,
) -> Truncation:
    """Per-row survivor threshold for top-k, then top-p, then min-p, each on the renormalised survivors.

    ``e`` is the e-space tensor (see the module docstring) and ``rows`` the rows to process;
    ``row_sums`` (float64) their full sums; ``top_k`` (0 = off), ``top_p`` (1 = off) and ``min_p``
    (0 = off) their settings.  Top-p keeps the smallest prefix of the sorted distribution whose mass
    reaches ``top_p`` (a token is kept while the mass strictly before it is below ``top_p``).
    """
    vocab = e.shape[1]
    has_k = top_k > 0
    kmax = int(top_k.max()) if bool(has_k.any()) else 0
    width = min(vocab, max(kmax, TOP_P_WIDTHS[0]) + 1)
    values, ids = topk_desc(e, width, rows, bmax)
    kth = values.gather(1, (top_k - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    tau = torch.where(has_k, kth, torch.zeros_like(kth))
    need_p = top_p < 1.0
    if bool(need_p.any()):
        p_local = need_p.nonzero().squeeze(1)
        tau_k = tau.index_select(0, p_local)
        k_rows = has_k.index_select(0, p_local)
        vals_p = values.index_select(0, p_local)
        # Mass left after top-k: the full sum, or the listed survivors if the list holds all of
        # them, or (ties running past the list) a masked sum over the row.
        listed_all = (width == vocab) | (vals_p[:, -1] < tau_k)
        masked_vals = vals_p.double() * (vals_p >= tau_k.unsqueeze(1))
        mass = torch.where(k_rows & listed_all, masked_vals.sum(1), row_sums.index_select(0, p_local))
        tie_rows = (k_rows & ~listed_all).nonzero().squeeze(1)
        if tie_rows.numel():
            sub = e.index_select(0, rows.index_select(0, p_local.index_select(0, tie_rows)))
            thr = tau_k.index_select(0, tie_rows).unsqueeze(1)
            mass[tie_rows] = (sub.double() * (sub >= thr)).sum(1)
        tau_p = _top_p_cutoff(
            e, rows.index_select(0, p_local), vals_p, tau_k, mass, top_p.index_select(0, p_local), bmax
        )
        tau[p_local] = torch.maximum(tau_k, tau_p)
    tau = torch.maximum(tau, min_p)
    complete = (values[:, -1] < tau) if width < vocab else torch.ones_like(has_k)
    return Truncation(tau=tau, values=values, ids=ids, complete=complete)


def _top_p_cutoff(
    e: torch.Tensor,
    rows: torch.Tensor,
    values: torch.Tensor,
    tau_k: torch.Tensor,
    mass: torch.Tensor,
    top_p: torch.Tensor,
    bmax: torch.Tensor | None,
) -> torch.Tensor:
    """The e-value of the last token top-p keeps, widening the sorted candidate list until it decides."""
    vocab = e.shape[1]
    out = torch.empty_like(tau_k)
    pending = torch.arange(rows.numel(), device=e.device)
    # On CPU a full sort (numpy) is cheaper than widening through large top-k calls.
    ladder = TOP_P_WIDTHS if e.device.type != "cpu" else ()
    widths = [w for w in ladder if w + 1 > values.shape[1]] + [vocab]
    while True:
        width = values.shape[1]
        thr = tau_k.index_select(0, pending).unsqueeze(1)
        w = values.double() * (values >= thr)
        cum = w.cumsum(1)
        before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)
        target = (top_p.index_select(0, pending) * mass.index_select(0, pending)).unsqueeze(1)
        n_keep = (before < target).sum(1)
        # Decided when the first dropped position is inside the list, or the list is the whole row.
        done = (n_keep < width) | (width >= vocab)
        if bool(done.any()):
            d = done.nonzero().squeeze(1)
            last = values.index_select(0, d).gather(1, (n_keep.index_select(0, d) - 1).unsqueeze(1))
            out[pending.index_select(0, d)] = last.squeeze(1)
        pending = pending[~done]
        if pending.numel() == 0:
            return out
        next_width = min(widths.pop(0) + 1, vocab)
        if next_width == vocab:
            values = sort_values_desc(e.index_select(0, rows.index_select(0, pending)))
        else:
            values, _ = topk_desc(e, next_width, rows.index_select(0, pending), bmax)


def logsumexp_rows(x: torch.Tensor) -> torch.Tensor:
    """Row-wise log-sum-exp in float64 (``-inf`` for an all ``-inf`` row)."""
    m = x.amax(dim=1)
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s = block_reduce(safe_exp_(x.float() - safe.unsqueeze(1).float()), "sum").sum(1)
    return safe.double() + torch.log(s)


def finite_or(x: torch.Tensor, value: float) -> torch.Tensor:
    """``x`` with non-finite entries replaced by ``value``."""
    return torch.where(torch.isfinite(x), x, torch.full_like(x, value))


__all__ = [
    "BLOCK",
    "NEG_INF",
    "BatchParams",
    "Truncation",
    "apply_banned_tokens",
    "apply_frequency_presence",
    "apply_logit_bias",
    "apply_repetition_penalty",
    "block_reduce",
    "exp_rows",
    "exp_sum",
    "finite_or",
    "gather_blocks",
    "logsumexp_rows",
    "row_argmax",
    "safe_exp_",
    "seeded_uniform",
    "sort_values_desc",
    "topk_desc",
    "truncation_thresholds",
]
