"""Which GEMM runs the fused CPU forward's projections, chosen by timing them on this machine.

No vendor library is the fast one everywhere: on one Intel CPU MKL's packed GEMM beat oneDNN in
float32, on an AMD EPYC oneDNN ran the same shapes twice as fast as MKL.  A choice made from the
CPU's vendor or flags is a guess, so the engine times every GEMM it can call on the model's own
projection weights, once per machine, and remembers the answer on disk.

* Candidates (:func:`candidates`): ``plain`` (``F.linear`` on the user's weight, no copy),
  ``mkl_packed`` (float32; MKL's GEMM on a copy packed for one row count, which it only serves at
  that count), ``onednn_packed`` (oneDNN on a reordered copy, any row count; float32, and bfloat16
  where oneDNN has a bf16 path), ``amx`` (bfloat16, our AMX kernel, where the CPU has AMX),
  ``gemv`` (float32 and bfloat16, our C kernel for single rows, where the C kernels build),
  ``panel`` (float32 and bfloat16, our register-blocked C GEMM on float32 panels of 16 weight
  columns, where the CPU has AVX2 + FMA: on an AMD EPYC with AVX2 only it ran decode-sized GEMMs
  1.2-1.5x faster than oneDNN), ``panel_bf16`` (the same on bfloat16 panels: half the bytes,
  more vector work per FMA), and our AVX-512 panel GEMMs of 32 columns: ``panel512`` (float32) and
  ``dpbf16`` (bfloat16 through vdpbf16ps, where the CPU has AVX512-BF16).  On an AMD EPYC Zen 4
  those ran decode-sized GEMMs 3-5% faster than oneDNN (bf16 single rows 1.3x), and unlike oneDNN
  the one-call C decode step can call them.
  A candidate that fails on a small probe is dropped.
* Row classes: ``single`` steps (one row: a sequence decoding alone), ``decode`` steps (at most
  ``SPLIT_ROWS`` rows, timed at ``DECODE_ROWS``) and ``prefill`` steps (more rows, timed at
  ``PREFILL_ROWS``).  Each gets its own winner.  At one row a step only streams weights, and the
  GEMMs built for many rows streamed them at half the memory bandwidth on an AMD EPYC; ``gemv``
  (our C kernel, no copy of the weight) competes there.
* Timing (:func:`time_candidate`) cycles through several layers' distinct weights, so the weights
  arrive from memory as they do in a step rather than hot in cache.
* The answer is cached in ``<kernel dir>/gemm-choice.json``, keyed by CPU model and flags, torch
  version, dtype, the projection shapes and the row counts: a second start costs nothing, and a
  cache written on another CPU is never read.  ``CBGEN_GEMM`` overrides it
  (``single=NAME,decode=NAME,prefill=NAME``, or one name for all).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from cbgen import envs

log = logging.getLogger("cbgen")

SINGLE_ROWS = 1  # the single class is timed at one row (one sequence decoding alone)
SINGLE_MAX_ROWS = 1  # steps of one row use the single winner (gemv lost to oneDNN at 4 rows)
DECODE_ROWS = 64  # MKL's packed GEMM is packed for this row count (oneDNN's hint too)
PREFILL_ROWS = 1024
SPLIT_ROWS = 256  # steps with more rows than this use the prefill winner
AMX_MAX_ROWS = 4096  # above this torch's own bf16 GEMM beats the AMX kernel even with cold weights
# Packed copies made for one timing: at least two layers, at most this many bytes.
_TIMING_BYTES = 256 << 20
ROW_CLASSES = ("single", "decode", "prefill")
ROWS = {"single": SINGLE_ROWS, "decode": DECODE_ROWS, "prefill": PREFILL_ROWS}


@dataclass(frozen=True)
class Candidate:
    """One way to run ``F.linear(x, weight, bias)``: ``pack(weight)`` makes its copy (None: none is
    made), ``apply(x, packed, weight, bias)`` runs it, returning None for a row count it does not
    serve (the caller then runs ``plain``)."""

    name: str
    pack: Callable[[torch.Tensor], Any] | None
    apply: Callable[[torch.Tensor, Any, torch.Tensor, torch.Tensor | None], torch.Tensor | None]


def _plain_apply(x, packed, weight, bias):
    return F.linear(x, weight, bias)


PLAIN = Candidate("plain", None, _plain_apply)


def _mkl_packed() -> Candidate:
    mkl = torch.ops.mkl

    def apply(x, packed, weight, bias):
        return mkl._mkl_linear(x, packed, weight, bias, DECODE_ROWS) if x.shape[0] == DECODE_ROWS else None

    return Candidate("mkl_packed", lambda w: mkl._mkl_reorder_linear_weight(w, DECODE_ROWS), apply)


def _onednn_packed() -> Candidate:
    dnn = torch.ops.mkldnn

    def apply(x, packed, weight, bias):
        return dnn._linear_pointwise(x, packed, bias, "none", [], "")

    return Candidate("onednn_packed", lambda w: dnn._reorder_linear_weight(w, DECODE_ROWS), apply)


def _amx() -> Candidate:
    from cbgen.model.kernels.cpu import amx as cpu_amx

    def pack(w):
        return cpu_amx.amx_pack(w) if cpu_amx.amx_supports(w) else None

    def apply(x, packed, weight, bias):
        if packed is None or x.shape[0] > AMX_MAX_ROWS:
            return None
        return cpu_amx.amx_linear(x, packed, bias)

    return Candidate("amx", pack, apply)


def _gemv() -> Candidate:
    from cbgen.model.kernels.cpu import ops as cpu_kernels

    if not cpu_kernels.available():
        raise RuntimeError(f"the C kernels did not build: {cpu_kernels.unavailable_reason()}")

    def apply(x, packed, weight, bias):
        if not 1 <= x.shape[0] <= SINGLE_MAX_ROWS or x.dtype != packed.dtype:
            return None  # e.g. the LM head of a prefill chunk that samples nothing: zero rows
        return cpu_kernels.gemv(x, packed, bias)

    # The "packed" weight is the weight itself (a single projection's own tensor: no copy) or the
    # concatenation PackedLinears makes for a group (q/k/v, gate/up), so one call covers the group.
    return Candidate("gemv", lambda w: w, apply)


def _panel(panel_dtype: torch.dtype) -> Candidate:
    from cbgen.model.kernels.cpu import panel as cpu_panel

    if not cpu_panel.panel_available():
        raise RuntimeError("the panel GEMM needs the C kernels built for a CPU with AVX2 and FMA")

    def apply(x, packed, weight, bias):
        if x.shape[0] < 1 or x.dtype != weight.dtype:
            return None  # zero rows (an LM head with nothing to sample): plain F.linear
        return cpu_panel.panel_linear(x, packed, weight.shape[0], bias)

    name = "panel" if panel_dtype == torch.float32 else "panel_bf16"
    return Candidate(name, lambda w: cpu_panel.panel_pack(w, panel_dtype), apply)


def _panel512(dtype: torch.dtype) -> Candidate:
    from cbgen.model.kernels.cpu import panel as cpu_panel

    if not cpu_panel.panel512_available(dtype):
        raise RuntimeError(f"the AVX-512 panel GEMM for {dtype} needs the C kernels built for that CPU")

    def apply(x, packed, weight, bias):
        if x.shape[0] < 1 or x.dtype != dtype:
            return None  # zero rows (an LM head with nothing to sample): plain F.linear
        return cpu_panel.panel512_linear(x, packed, weight.shape[0], bias)

    return Candidate("panel512" if dtype == torch.float32 else "dpbf16", cpu_panel.panel512_pack, apply)


def candidates(dtype: torch.dtype) -> dict[str, Candidate]:
    """The GEMMs this torch build and CPU can run for ``dtype``, each checked on a small probe."""
    found = {"plain": PLAIN}
    makers: list[Callable[[], Candidate]] = []
    if dtype == torch.float32 and torch._C.has_mkl:
        makers.append(_mkl_packed)
    if torch.backends.mkldnn.is_available() and (
        dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    ):
        makers.append(_onednn_packed)
    if dtype == torch.bfloat16:
        from cbgen.model.kernels.cpu import amx as cpu_amx

        if cpu_amx.amx_available():
            makers.append(_amx)
    if dtype in (torch.float32, torch.bfloat16):
        makers.extend((_gemv, functools.partial(_panel, torch.float32)))
    if dtype == torch.bfloat16:
        makers.append(functools.partial(_panel, torch.bfloat16))
    if dtype in (torch.float32, torch.bfloat16):
        makers.append(functools.partial(_panel512, dtype))
    gen = torch.Generator().manual_seed(0)  # never the global RNG: a trainer's seeds stay its own
    weight = torch.randn(64, 64, generator=gen).to(dtype)
    for make in makers:
        try:
            cand = make()
            rows = SINGLE_ROWS if cand.name == "gemv" else DECODE_ROWS
            x = torch.randn(rows, 64, generator=gen).to(dtype)
            out = cand.apply(x, cand.pack(weight), weight, None)
            if out is not None and not torch.allclose(
                out.float(), F.linear(x, weight).float(), atol=0.1, rtol=0.05
            ):
                raise RuntimeError("wrong result")
        except (AttributeError, RuntimeError, ValueError) as exc:
            log.debug("cbgen: GEMM candidate %s unusable here: %s", getattr(make, "__name__", make), exc)
            continue
        found[cand.name] = cand
    return found


def row_class(rows: int) -> str:
    """The row class of a step of ``rows`` rows: ``single``, ``decode`` or ``prefill``."""
    if rows <= SINGLE_MAX_ROWS:
        return "single"
    return "decode" if rows <= SPLIT_ROWS else "prefill"


@dataclass(frozen=True)
class GemmPlan:
    """The winner of each row class; ``timings`` (seconds per timed cycle) when it was measured.
    ``single`` defaults to the decode winner."""

    decode: Candidate
    prefill: Candidate
    timings: dict | None = None
    source: str = "default"
    single: Candidate | None = None

    def for_rows(self, rows: int) -> Candidate:
        """The candidate for a step of ``rows`` rows."""
        return self.for_class(row_class(rows))

    def for_class(self, name: str) -> Candidate:
        """The winner of row class ``name`` (one of :data:`ROW_CLASSES`)."""
        if name == "single":
            return self.single if self.single is not None else self.decode
        return self.decode if name == "decode" else self.prefill

    def names(self) -> dict[str, str]:
        """The winner's name per row class, in :data:`ROW_CLASSES` order."""
        return {name: self.for_class(name).name for name in ROW_CLASSES}

    @property
    def packs(self) -> tuple[Candidate, ...]:
        """The candidates that need a packed copy (one to three)."""
        distinct = {
            c.name: c
            for c in (self.single, self.decode, self.prefill)
            if c is not None and c.pack is not None
        }
        return tuple(distinct.values())


def default_plan(dtype: torch.dtype) -> GemmPlan:
    """What the engine used before measuring: MKL's packed GEMM (float32) for decode rows; AMX, else
    oneDNN, for bfloat16; plain GEMMs otherwise."""
    found = candidates(dtype)
    if dtype == torch.float32:
        return GemmPlan(found.get("mkl_packed", PLAIN), PLAIN)
    best = found.get("amx") or found.get("onednn_packed") or PLAIN
    return GemmPlan(best, best)


def time_candidate(
    cand: Candidate, layers: Sequence[Sequence[torch.Tensor]], rows: int, repeats: int = 1
) -> float | None:
    """Seconds for one pass of ``rows``-row GEMMs over ``layers`` (each a list of weights), cycling
    through distinct layers so the weights come from memory; None when it does not serve ``rows``."""
    dtype = layers[0][0].dtype
    packed = [[(cand.pack(w) if cand.pack is not None else None, w) for w in layer] for layer in layers]
    gen = torch.Generator().manual_seed(0)  # never the global RNG
    inputs = {
        w.shape[1]: torch.randn(rows, w.shape[1], generator=gen).to(dtype) for layer in layers for w in layer
    }
    best = None
    for _ in range(repeats + 1):  # the first pass warms up code paths and allocator
        start = time.perf_counter()
        for layer in packed:
            for p, w in layer:
                if cand.apply(inputs[w.shape[1]], p, w, None) is None:
                    return None
        elapsed = time.perf_counter() - start
        best = elapsed if best is None else min(best, elapsed)
    return best


# Raised when the way of measuring changes, or a candidate changes enough to move the answer, so
# choices cached before are measured again (2: candidates take turns; 3: the single row class; 4:
# the AVX-512 panel GEMMs stream contiguous panel ranges per thread, which made dpbf16 the fastest
# prefill GEMM on a Zen 4 where oneDNN had been; 5: the AVX2 panel GEMM does too, 1.1-1.7x at 1-64
# rows on that Zen 4, and it is the GEMM an AVX2-only CPU chooses).
_MEASUREMENT_VERSION = 5
# How many turns each candidate gets (see choose).
TIMING_ROUNDS = 3


def timing_layer_count(layer_bytes: int, num_layers: int) -> int:
    """How many layers' weights a timing cycles through: enough to leave the cache, at least two."""
    return max(2, min(num_layers, _TIMING_BYTES // max(layer_bytes, 1)))


def _timing_layers(layers: Sequence[Sequence[torch.Tensor]]) -> list[Sequence[torch.Tensor]]:
    per_layer = sum(w.numel() * w.element_size() for w in layers[0])
    return list(layers[: timing_layer_count(per_layer, len(layers))])


def cpu_key() -> str:
    """The machine as measurements key it: architecture, CPU model and flags, torch threads."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    model = next((ln for ln in lines if ln.startswith("model name")), "")
    flags = next((ln for ln in lines if ln.startswith("flags")), "")
    return f"{platform.machine()}|{model}|{flags}|threads={torch.get_num_threads()}"


def cache_key(dtype: torch.dtype, shapes: Sequence[tuple[int, int]]) -> str:
    """Identifies a measurement: CPU model and flags, torch version and threads, dtype, shapes, rows."""
    text = (
        f"v{_MEASUREMENT_VERSION}|{cpu_key()}|torch={torch.__version__}|{dtype}|{sorted(set(shapes))}|"
        f"{SINGLE_ROWS},{DECODE_ROWS},{PREFILL_ROWS}"
    )
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def choice_dir() -> Path:
    """Where measured choices are cached (the kernel build directory)."""
    root = envs.get("CBGEN_KERNEL_DIR")
    return Path(root) if root else Path.home() / ".cache" / "cbgen" / "kernels"


def _cache_path() -> Path:
    return choice_dir() / "gemm-choice.json"


def _override(found: dict[str, Candidate]) -> GemmPlan | None:
    text = (envs.get("CBGEN_GEMM") or "").strip()
    if not text:
        return None
    names = dict(part.split("=", 1) if "=" in part else (None, part) for part in text.split(","))
    decode = names.get("decode", names.get(None, "plain"))
    prefill = names.get("prefill", names.get(None, "plain"))
    # One name for everything, or decode=..., also covers single rows unless single= says otherwise;
    # gemv alone would leave the bigger classes nothing, so they stay plain then.
    single = names.get("single", names.get(None, decode))
    if decode == "gemv":
        decode = "plain"
    if prefill == "gemv":
        prefill = "plain"
    missing = [n for n in (single, decode, prefill) if n not in found]
    if missing:
        raise ValueError(f"CBGEN_GEMM names {missing}, not among this machine's GEMMs {sorted(found)}")
    return GemmPlan(found[decode], found[prefill], source="CBGEN_GEMM", single=found[single])


def choose(
    dtype: torch.dtype,
    shapes: Sequence[tuple[int, int]],
    make_layers: Callable[[], Sequence[Sequence[torch.Tensor]]],
    timer: Callable[[Candidate, Sequence[Sequence[torch.Tensor]], int], float | None] = time_candidate,
    cache_path: Path | None = None,
    found: dict[str, Candidate] | None = None,
) -> GemmPlan:
    """The fastest candidate per row class for projections of ``shapes`` (``[N, K]`` weights), from
    the cache when this machine measured them before; else timed on ``make_layers()`` (a list of
    layers, each a list of weights; called only when a measurement is needed)."""
    found = found if found is not None else candidates(dtype)
    forced = _override(found)
    if forced is not None:
        return forced
    key = cache_key(dtype, shapes)
    path = cache_path or _cache_path()
    stored = read_cache(path)
    entry = stored.get(key)
    # A cached answer stands only if it timed every candidate found now: a build that gained a
    # candidate (a new kernel) measures again.
    if entry is not None and all(
        entry.get(c) in found and set(found) <= set((entry.get("timings") or {}).get(c) or ())
        for c in ROW_CLASSES
    ):
        return GemmPlan(
            found[entry["decode"]],
            found[entry["prefill"]],
            entry.get("timings"),
            "cache",
            found[entry["single"]],
        )
    timing_layers = _timing_layers(make_layers())
    timings: dict[str, dict[str, float | None]] = {}
    winners = {}
    # Decode GEMMs stream their weights from memory, so they are timed over enough layers to leave
    # the cache; prefill GEMMs reuse each weight across 1,024 rows and are compute-bound, so two
    # layers time them as well at a fraction of the cost (the first start of SmolLM2 spent ~50 s
    # timing prefill over seven layers).
    layers_for = {"single": timing_layers, "decode": timing_layers, "prefill": timing_layers[:2]}
    for row_class in ROW_CLASSES:
        rows = ROWS[row_class]
        # Candidates take turns, and each keeps its best round: a burst of load from other jobs then
        # slows one round of every candidate instead of all rounds of one (timed one after another,
        # a busy moment once made plain F.linear look 3x faster than packed MKL, which is 3% faster).
        best: dict[str, float | None] = {}
        for _ in range(TIMING_ROUNDS):
            for name, cand in found.items():
                if name in best and best[name] is None:
                    continue  # it does not serve these rows
                t = timer(cand, layers_for[row_class], rows)
                best[name] = t if t is None or name not in best else min(t, best[name])
        timings[row_class] = best
        usable = {n: t for n, t in timings[row_class].items() if t is not None}
        winners[row_class] = min(usable, key=usable.get)
    stored[key] = {**winners, "timings": timings, "cpu": cpu_key().split("|")[1], "dtype": str(dtype)}
    write_cache(path, stored)
    log.info(
        "cbgen: projection GEMMs measured here: single %s, decode %s, prefill %s (%s)",
        *winners.values(),
        timings,
    )
    return GemmPlan(
        found[winners["decode"]], found[winners["prefill"]], timings, "measured", found[winners["single"]]
    )


def read_cache(path: Path) -> dict:
    """A cache file of measured choices (empty when missing or unreadable)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_cache(path: Path, data: dict) -> None:
    """Replaces a cache file of measured choices atomically; a read-only home only logs."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{time.time_ns()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)  # atomic: concurrent engines never read half a file
    except OSError as exc:  # a read-only home: measure again next time
        log.warning("cbgen: could not cache a measured choice in %s: %s", path, exc)
