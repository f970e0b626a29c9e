"""One execution plan per engine: which code paths run for this model on this machine, and why.

:func:`resolve_plan` makes every choice of path, once, when the engine starts, by asking the
deciders that know each part:

* the attention backend (:func:`cbgen.model.backends.backend_choice`);
* how decode-only steps run (:func:`decode_mode_choice`: eager, padded ``static``, CUDA ``graphs``);
* the forward: ``fused`` (the C forward of :mod:`cbgen.model.cpu_fast.fused_forward`, for models
  :func:`cbgen.model.cpu_fast.qualify.unsupported_reason` accepts) or ``module`` (the transformers
  module tree with cbgen's paged attention);
* with the fused forward, the projection GEMM of each row class
  (:mod:`cbgen.model.cpu_fast.gemm_choice`, measured once per machine) and the row classes whose
  decode steps run as one C call;
* the sampler's paths: the C kernel for batches of plain greedy rows, or torch; and whether sampled
  rows read values back from the device or never do.

With ``batch_invariant=True`` the plan is the parity plan (:func:`_parity_plan`): the one set of
paths whose results the trainer side (``cbgen.parity``) reproduces bit for bit.  Its forward is
``direct`` (:mod:`cbgen.batch_invariant.direct_forward`, the module forward's kernels called without
the module tree, for the models the fused path qualifies, on the C parity kernels) or ``module``.

The engine logs the plan in one line (logger ``cbgen``), keeps it as ``engine.plan`` and builds the
runner, its attention backend and the sampler from it; ``cbgen info MODEL`` prints it.  The runner,
the fused forward and the sampler read the plan and choose nothing themselves.

**When the model's structure changes** (a decision, recorded here).  Whether the fused forward
computes exactly what the model computes depends on the model as it is now: a PEFT adapter injected,
a hook registered, a module swapped or a weight recast after the engine started can each make it
wrong.  The fused forward never checks this itself any more; instead the plan is re-resolved, by
:func:`resolve_plan` with the same settings, and the runner switches to what the new plan says
(logged at INFO when the plan changed):

* On a weight change.  The engine's ``WeightWatcher`` (:mod:`cbgen.model.loading.weights`) notices
  new parameters (an adapter injected), new storage (a recast, ``.data =``) and adapter switches,
  and the engine then calls :meth:`cbgen.model.runner.ModelRunner.weights_changed`, which
  re-resolves the plan when the structure changed (an optimizer step changes values only and keeps
  the plan).
* Before every step, a guard, while the choice of forward depends on the structure (fused enabled,
  the C backend, eager decode steps, or the parity plan's direct forward:
  :attr:`ExecutionPlan.watch_structure`).  It stays because
  some changes reach no weight fingerprint: a forward hook registered or removed, or a module
  swapped for a wrapper holding the same parameters, change neither versions, storage nor the
  parameter set, and a fused step over them would silently compute the wrong thing.  The guard
  (:class:`cbgen.model.cpu_fast.qualify.StructureWatch`, ~0.2 ms a step on a 30-layer model)
  decides nothing: when it fires, the plan is re-resolved and logged, and the step runs the new
  plan.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from cbgen.batch_invariant import native as parity_kernels
from cbgen.config import EngineConfig
from cbgen.model import state_kernels
from cbgen.model.attention import AttentionBackend
from cbgen.model.backends import backend_choice, make_backend
from cbgen.model.cache_groups import CacheLayout
from cbgen.model.cpu_fast import decode_loops, fused_forward
from cbgen.model.cpu_fast.gemm_choice import ROW_CLASSES, GemmPlan
from cbgen.model.kernels.cpu import ops as cpu_kernels
from cbgen.model.rotary import length_rotary
from cbgen.model.state_kernels import StateKernels

log = logging.getLogger("cbgen")

__all__ = ["DECODE_MODES", "ExecutionPlan", "decode_mode_choice", "plan_for_model", "resolve_plan"]

DECODE_MODES = ("auto", "eager", "static", "graphs")

# Where a GemmPlan's choice came from (GemmPlan.source), in words.
_GEMM_SOURCES = {
    "cache": "measured on this machine before, cached on disk",
    "measured": "measured on this machine now",
    "CBGEN_GEMM": "forced by CBGEN_GEMM",
    "default": "not measured",
}

GreedyKernel = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class ExecutionPlan:
    """What runs for one model on one machine, each choice with the reason it was made.

    ``attention``: the backend name (``torch``, ``cpu``, ``triton``, ``flash_attn``); with ``cpu``,
    ``decode_loops`` names the loops its decode kernel runs (measured: ``decode_loops.py``).
    ``decode_mode``: ``eager``, ``static`` or ``graphs``.  ``forward``: ``fused`` or ``module``.
    ``gemms``: with the fused forward, the projection GEMM per row class (``single``, ``decode``,
    ``prefill``); ``c_step``: the row classes whose decode-only steps run as one C call.
    ``greedy``: ``c`` (one C kernel for batches of plain greedy rows) or ``torch``.
    ``sampled_rows``: ``readback`` or ``sync_free`` (see :class:`cbgen.sample.sampler.Sampler`).
    ``row_prefill_max``: prefill chunks up to this many tokens attend as decode rows.
    ``watch_structure``: whether the choice of forward depends on the model's structure, so the
    runner watches it (see the module docstring).
    """

    model: str
    device: torch.device
    dtype: torch.dtype
    attention: str
    attention_why: str
    decode_mode: str
    decode_mode_why: str
    forward: str
    forward_why: str
    gemms: GemmPlan | None = field(compare=False)
    c_step: frozenset[str]
    c_step_why: str
    greedy: str
    greedy_why: str
    sampled_rows: str
    sampled_rows_why: str
    row_prefill_max: int
    watch_structure: bool
    # What the plan was resolved from, so that it can be resolved again (resolve_plan's ``previous``).
    config: EngineConfig = field(repr=False, compare=False)
    # The model's cache as groups of layers (one kv group for every model cbgen runs today): what
    # the engine sizes and allocates its cache, block pools and step batches from.
    cache: CacheLayout = field(repr=False, compare=False)
    gemm_shapes: tuple[tuple[int, int], ...] = field(default=(), repr=False, compare=False)
    # With the C attention backend: which loops its decode kernel runs (a key of decode_loops.IMPLS).
    decode_loops: str = "widest"
    decode_loops_why: str = ""
    # Parity mode (``batch_invariant=True``): every forward runs under the parity dispatch mode and
    # the sampler reports raw logprobs through cbgen.batch_invariant.token_logprobs.
    parity: bool = False
    # Models with state layers: the mixer functions whose C kernels the decode forwards run.
    state_kernels: StateKernels = field(default=StateKernels(), repr=False, compare=False)
    state_kernels_why: str = ""

    @property
    def head_dim(self) -> int:
        """The key head size of the first kv group (what the backends' kernels are chosen for)."""
        return self.cache.kv_groups[0].k_head_dim

    @property
    def compile(self) -> bool:
        """Whether the padded decode path runs through ``torch.compile``."""
        return self.config.compile

    def greedy_kernel(self) -> GreedyKernel | None:
        """The kernel the sampler hands batches of plain greedy rows (None: the general torch path)."""
        return cpu_kernels.greedy_rows if self.greedy == "c" else None

    def _gemm_entries(self, per_class: bool) -> list[tuple[str, str, str]]:
        names = self.gemms.names() if self.gemms is not None else {}
        source = self.gemms.source if self.gemms is not None else "-"
        why = _GEMM_SOURCES.get(source, source)
        if per_class:
            return [(f"GEMM {c}", n, why) for c, n in names.items()]
        return [("GEMM", ", ".join(f"{c} {n}" for c, n in names.items()), why)]

    def _entries(self, per_class: bool = False) -> list[tuple[str, str, str]]:
        """(label, choice, reason) of every decision, in the order a step meets them; ``per_class``:
        the GEMM of each row class on an entry of its own."""
        entries = [("parity", "batch-invariant", _PARITY_WHY)] if self.parity else []
        entries += [
            ("attention", self.attention, self.attention_why),
        ]
        if self.attention == "cpu":
            entries.append(("decode loops", self.decode_loops, self.decode_loops_why))
        entries += [("forward", self.forward, self.forward_why)]
        kv_per_token = sum(g.bytes_per_block() // g.block_size for g in self.cache.kv_groups)
        if self.cache.state_groups:
            # State models: what each sequence holds beyond its KV blocks (cbgen.model.state_cache).
            per_seq = self.cache.bytes_per_slot() / 2**20
            choice = f"{kv_per_token} bytes of KV a token, {per_seq:.2f} MiB of state a sequence"
            entries.append(("cache", choice, self.cache.describe()))
            if self.state_kernels_why:
                kernels = "C" if self.state_kernels else "torch"
                entries.append(("state kernels", kernels, self.state_kernels_why))
        else:
            entries.append(("cache", f"{kv_per_token} bytes of KV a token", self.cache.describe()))
        if self.forward == "fused" or (self.cache.state_groups and self.gemms is not None):
            entries += self._gemm_entries(per_class)
        if self.forward == "fused":
            c_step = ", ".join(c for c in ROW_CLASSES if c in self.c_step) or "none"
            entries.append(("C decode step", c_step, self.c_step_why))
        entries += [
            ("decode mode", self.decode_mode, self.decode_mode_why),
            ("greedy", "C kernel" if self.greedy == "c" else "torch", self.greedy_why),
            ("sampled rows", self.sampled_rows, self.sampled_rows_why),
        ]
        if self.row_prefill_max:
            entries.append(("short prefill", f"<= {self.row_prefill_max} tokens", "attended as decode rows"))
        return entries

    def _title(self) -> str:
        return f"{self.model} on {self.device}, {str(self.dtype).removeprefix('torch.')}"

    def describe(self) -> str:
        """The plan in one line (what the engine logs at start)."""
        return f"{self._title()}: " + "; ".join(f"{k} {v} ({why})" for k, v, why in self._entries())

    def __str__(self) -> str:
        return self.describe()

    def report(self) -> str:
        """The plan on several lines, one decision a line (what ``cbgen info`` prints)."""
        lines = [f"execution plan for {self._title()}"]
        for label, choice, why in self._entries(per_class=True):
            lines.append(f"  {label:<14} {choice:<16} {why}")
        return "\n".join(lines)


def resolve_plan(
    model: nn.Module,
    config: EngineConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    cache: CacheLayout | None = None,
    previous: ExecutionPlan | None = None,
) -> ExecutionPlan:
    """Every choice of code path for ``model`` on ``device``, with a KV cache of ``dtype``, under
    ``config`` (see the module docstring).  Raises ``ValueError`` for settings that cannot work.

    ``cache``: the model's cache layout (default: :func:`cache_layout`); its head size lets
    ``auto`` consider flash-attn.
    ``previous``, the plan this one replaces: its GEMM choice is kept when the projections' shapes
    and dtype did not change, instead of reading the on-disk cache (or measuring) again.
    """
    device = torch.device(device)
    if cache is None:
        cache = cache_layout(model, dtype, config.block_size)
    head_dim = cache.kv_groups[0].k_head_dim
    if cache.state_groups:
        _check_state_settings(model, config)
    if config.batch_invariant:
        return _parity_plan(model, config, device, dtype, cache)
    attention, attention_why = backend_choice(
        config.attention_backend, device, dtype, block_size=config.block_size, head_dim=head_dim
    )
    if _has_sinks(model):
        attention_why += (
            "; layers with attention sinks through the backend's torch reference (attend_with_sinks)"
        )
    backend = make_backend(attention, device)
    decode_mode, decode_mode_why = decode_mode_choice(config.decode_mode, device, config.compile, backend)
    decode_mode, decode_mode_why = _unpadded_for_length_rotary(model, config, decode_mode, decode_mode_why)
    forward, forward_why = _forward_choice(model, config, dtype, attention, decode_mode)
    if cache.state_groups:
        decode_mode, decode_mode_why = "eager", STATE_FORWARD_WHY
        forward, forward_why = "module", STATE_FORWARD_WHY
    mixed = not all(g.uniform_head_sizes for g in cache.kv_groups)
    if mixed and attention == "cpu":
        attention_why += (
            "; layers whose keys and values differ in head size (latent attention) through the C "
            "kernel's portable loops (its vector loops take one size)"
        )
    if mixed and not backend.mixed_head_sizes:
        attention_why += (
            "; layers whose keys and values differ in head size (latent attention) through the torch "
            "reference, which the backend's kernels do not take"
        )
        if decode_mode != "eager":
            # The reference store filters padding rows on the host: no fixed-shape steps, no graphs.
            decode_mode, decode_mode_why = "eager", "layers attended by the torch reference run eagerly"
    gemms, shapes, c_step, c_step_why = None, (), frozenset(), "not with the module forward"
    if cache.state_groups and device.type == "cpu" and cpu_kernels.supports(dtype):
        # The module forward of a state model runs its projections through packed GEMMs.
        gemms, shapes = _state_gemms(model, config.prepack_weights, previous)
    if forward == "fused":
        gemms, shapes = _gemms(model, config.prepack_weights, previous)
        c_step, c_step_why = fused_forward.c_step_classes(model, gemms, config.max_num_seqs)
    greedy, greedy_why = _greedy_choice(device, dtype)
    sampled_rows, sampled_rows_why = _sampled_rows_choice(device)
    loops, loops_why = _decode_loops(model, config, dtype, attention, cache, previous)
    mixers, mixers_why = state_kernels.choose(model, cache, device)
    return ExecutionPlan(
        model=type(model).__name__,
        device=device,
        dtype=dtype,
        attention=attention,
        attention_why=attention_why,
        decode_mode=decode_mode,
        decode_mode_why=decode_mode_why,
        forward=forward,
        forward_why=forward_why,
        gemms=gemms,
        c_step=c_step,
        c_step_why=c_step_why,
        greedy=greedy,
        greedy_why=greedy_why,
        sampled_rows=sampled_rows,
        sampled_rows_why=sampled_rows_why,
        row_prefill_max=backend.row_prefill_max,
        watch_structure=config.fused_decode and attention == "cpu" and decode_mode == "eager",
        config=dataclasses.replace(config),
        cache=cache,
        gemm_shapes=shapes,
        decode_loops=loops,
        decode_loops_why=loops_why,
        state_kernels=mixers,
        state_kernels_why=mixers_why,
    )


_PARITY_WHY = "batch_invariant=True: raw logprobs equal cbgen.parity's trainer forward bit for bit"
STATE_FORWARD_WHY = (
    "state layers: the module forward, the decode rows as one batch and each prefill row on its own "
    "(cbgen.model.state_pieces)"
)
# Why parity mode refuses models with state layers (docs/rl.md says the same).
STATE_PARITY_WHY = (
    "batch_invariant=True is not supported for models with linear-attention, state-space or "
    "convolution layers: generation decodes them in the mixers' recurrent form, as generate() does, "
    "and a trainer's forward over the whole sequence computes them in the chunk form, whose bits "
    "differ; no cbgen kernel makes the two agree without changing the trainer's forward"
)


def _check_state_settings(model: nn.Module, config: EngineConfig) -> None:
    """Settings a model with state layers cannot run under, refused with the reason."""
    from cbgen.model import support

    if config.batch_invariant:
        raise support.UnsupportedModelError(f"{type(model).__name__}: {STATE_PARITY_WHY}")
    if config.compile:
        raise ValueError("compile=True is not supported for models with state layers (eager forwards only)")
    if config.decode_mode in ("static", "graphs"):
        raise ValueError(
            f"decode_mode {config.decode_mode!r} is not supported for models with state layers: their decode "
            "rows run eagerly as one batch (decode_mode 'auto' or 'eager')"
        )


PARITY_MODULE_WHY = "parity mode: the trainer's module forward, under the parity dispatch mode"


def _parity_plan(
    model: nn.Module, config: EngineConfig, device: torch.device, dtype: torch.dtype, cache: CacheLayout
) -> ExecutionPlan:
    """The parity plan: the one set of paths whose results the trainer side reproduces exactly (see
    :mod:`cbgen.batch_invariant`).  Everything that changes a reduction order by batch, chunk or
    cache state is off: the fused C forward and its packed GEMMs, the C attention kernels, short
    prefill chunks as decode rows, CUDA graphs and ``torch.compile``.  The C greedy kernel stays (an
    argmax is exact; the logprobs are recomputed the trainer side's way)."""
    if config.compile:
        raise ValueError("batch_invariant=True runs eagerly: compile=True is not supported with it")
    mixed = [g for g in cache.kv_groups if not g.uniform_head_sizes]
    if mixed:
        (_, k, v), layers = next((s, ls) for s, ls in mixed[0].shapes.items() if s[1] != s[2])
        raise ValueError(
            f"batch_invariant=True: {type(model).__name__}'s attention takes keys of head size {k} and "
            f"values of {v} (layer {layers[0]}), and parity mode's attention kernels (C, Triton and "
            "the torch form, the trainer's and the engine's) take one head size for both (see docs/rl.md)"
        )
    if config.decode_mode == "graphs":
        raise ValueError(
            "batch_invariant=True supports decode_mode 'auto', 'eager' or 'static', not 'graphs'"
        )
    if config.decode_mode == "static":
        decode_mode, decode_mode_why = "static", "requested"
    else:
        decode_mode, decode_mode_why = (
            "eager",
            "parity mode runs decode steps eagerly unless 'static' is asked",
        )
    decode_mode, decode_mode_why = _unpadded_for_length_rotary(model, config, decode_mode, decode_mode_why)
    sampled_rows, sampled_rows_why = _sampled_rows_choice(device)
    forward, forward_why = _parity_forward_choice(model, device, dtype, decode_mode)
    greedy, greedy_why = _greedy_choice(device, dtype)
    if greedy == "c":
        # An argmax is exact whatever the order; the logprobs still come from the trainer side's
        # log-softmax (the sampler's parity step), so the kernel changes no reported bit.
        greedy_why += ", an exact argmax; logprobs through the trainer side's functions"
    else:
        greedy_why = "parity mode: raw and processed logprobs through the trainer side's functions"
    return ExecutionPlan(
        model=type(model).__name__,
        device=device,
        dtype=dtype,
        attention="parity",
        attention_why="parity mode, the trainer's: " + parity_kernels.describe(device, dtype),
        decode_mode=decode_mode,
        decode_mode_why=decode_mode_why,
        forward=forward,
        forward_why=forward_why,
        gemms=None,
        c_step=frozenset(),
        c_step_why="not with the module forward",
        greedy=greedy,
        greedy_why=greedy_why,
        sampled_rows=sampled_rows,
        sampled_rows_why=sampled_rows_why,
        row_prefill_max=0,
        # The direct forward runs only the math of the modules it was qualified on.
        watch_structure=decode_mode == "eager" and parity_kernels.parity_form(device, dtype) == "c",
        config=dataclasses.replace(config),
        cache=cache,
        parity=True,
    )


def _parity_forward_choice(
    model: nn.Module, device: torch.device, dtype: torch.dtype, decode_mode: str
) -> tuple[str, str]:
    """The parity plan's forward: the direct one (:mod:`cbgen.batch_invariant.direct_forward`)
    where the C parity kernels run and the fused path qualifies the model, else the modules under
    the parity dispatch mode."""
    if decode_mode != "eager":
        return "module", PARITY_MODULE_WHY + f" (decode mode {decode_mode!r})"
    if parity_kernels.parity_form(device, dtype) != "c":
        return "module", PARITY_MODULE_WHY
    reason = fused_forward.unsupported_reason(model)
    if reason is not None:
        return "module", f"{PARITY_MODULE_WHY} (direct forward: {reason})"
    return "direct", (
        "parity mode: the module forward's kernels called directly, checked bit for bit against it at start"
    )


def resolve_again(plan: ExecutionPlan, model: nn.Module) -> ExecutionPlan:
    """:func:`resolve_plan` with the settings ``plan`` was resolved from, for the model as it is now."""
    return resolve_plan(model, plan.config, plan.device, plan.dtype, cache=plan.cache, previous=plan)


def plan_for_model(model: nn.Module, config: EngineConfig | None = None) -> ExecutionPlan:
    """The plan an engine resolves for ``model`` under ``config`` (``cbgen info``): on the device of
    its parameters, with the dtype of its first floating-point one, as the engine takes them."""
    params = list(model.parameters())
    dtype = next((p.dtype for p in params if p.is_floating_point()), torch.float32)
    return resolve_plan(model, config or EngineConfig(), params[0].device, dtype)


def decode_mode_choice(
    requested: str, device: torch.device, compile: bool, backend: AttentionBackend
) -> tuple[str, str]:
    """How decode-only steps run, and why: ``eager`` (the packed batch as it is), ``static`` (padded
    to a batch bucket in fixed buffers; what CUDA captures, runnable on CPU for tests) or ``graphs``
    (static, captured as CUDA graphs).  ``auto``: graphs on CUDA when the backend can be captured
    (else eager, or static with ``compile``), static on CPU with ``compile``, else eager."""
    if requested not in DECODE_MODES:
        raise ValueError(f"decode_mode must be one of {DECODE_MODES}, got {requested!r}")
    if requested == "graphs" and device.type != "cuda":
        raise ValueError("decode_mode='graphs' needs a CUDA device (use 'static' for the padded path)")
    if requested == "eager" and compile:
        raise ValueError("compile=True compiles the padded decode path: use decode_mode 'auto' or 'static'")
    if requested != "auto":
        return requested, "requested"
    if device.type == "cuda":
        if backend.cuda_graphs_ok(device):
            return "graphs", f"auto on CUDA: {backend.name} decode steps can be captured"
        if compile:
            return "static", f"auto on CUDA: {backend.name} cannot be captured; compile runs the padded path"
        return "eager", f"auto on CUDA: {backend.name} decode steps cannot be captured in CUDA graphs"
    if compile:
        return "static", "auto with compile: torch.compile compiles the padded decode path"
    return "eager", f"auto on {device.type} without compile"


def _unpadded_for_length_rotary(
    model: nn.Module, config: EngineConfig, decode_mode: str, why: str
) -> tuple[str, str]:
    """Eager decode steps where the rotary frequencies depend on each sequence's length: the
    per-token tables (cbgen.model.rotary) follow the packed batch, which a padded bucket is not."""
    if decode_mode == "eager" or not _has_length_rotary(model):
        return decode_mode, why
    if config.decode_mode != "auto":
        raise ValueError(
            f"decode_mode={config.decode_mode!r}: the model's rotary frequencies depend on each sequence's "
            "length, which padded decode steps cannot follow (use 'auto' or 'eager')"
        )
    if config.compile:
        raise ValueError("compile=True compiles the padded decode path, which this model's rotary cannot use")
    return "eager", "the rotary frequencies depend on each sequence's length (per-token tables)"


def _has_length_rotary(model: nn.Module) -> bool:
    try:
        return length_rotary(model) is not None
    except NotImplementedError:
        return True


def _forward_choice(
    model: nn.Module, config: EngineConfig, dtype: torch.dtype, attention: str, decode_mode: str
) -> tuple[str, str]:
    if not config.fused_decode:
        return "module", "fused_decode=False"
    if attention != "cpu":
        return "module", f"the fused forward attends through the C backend, not {attention}"
    if decode_mode != "eager":
        return "module", f"decode_mode {decode_mode}: padded decode steps run the module forward"
    reason = fused_forward.unsupported_reason(model)
    if reason is not None:
        return "module", reason
    weights = model.lm_head.weight.dtype
    if weights != dtype:
        return "module", f"the KV cache holds {dtype}, the weights are {weights}"
    return "fused", f"{type(model).__name__} on the allow list, plain nn.Linear projections, no hooks"


def _gemms(
    model: nn.Module, prepack: bool, previous: ExecutionPlan | None
) -> tuple[GemmPlan, tuple[tuple[int, int], ...]]:
    shapes = tuple(fused_forward.gemm_shapes(model))
    if (
        previous is not None
        and previous.gemms is not None
        and previous.gemm_shapes == shapes
        and previous.dtype == model.lm_head.weight.dtype
        and previous.config.prepack_weights == prepack
    ):
        return previous.gemms, shapes
    return fused_forward.choose_gemms(model, prepack), shapes


def _state_gemms(
    model: nn.Module, prepack: bool, previous: ExecutionPlan | None
) -> tuple[GemmPlan, tuple[tuple[int, int], ...]]:
    from cbgen.model.state_cache import choose_projection_gemms, projections

    shapes = tuple(sorted({tuple(m.weight.shape) for m in projections(model)}))
    if previous is not None and previous.gemms is not None and previous.gemm_shapes == shapes:
        return previous.gemms, shapes
    if not shapes:
        return None, ()
    return choose_projection_gemms(model, prepack), shapes


def _decode_loops(
    model: nn.Module,
    config: EngineConfig,
    dtype: torch.dtype,
    attention: str,
    cache: CacheLayout,
    previous: ExecutionPlan | None,
) -> tuple[str, str]:
    """The C decode kernel's loops (measured once per machine and geometry; see decode_loops.py)."""
    if attention != "cpu" or not cache.kv_groups[0].layers:
        return "widest", ""
    if previous is not None and previous.attention == "cpu" and previous.dtype == dtype:
        return previous.decode_loops, previous.decode_loops_why
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    group = cache.kv_groups[0]
    kv_heads, head_dim = group.num_kv_heads, group.k_head_dim
    heads = kv_heads * (
        int(text.num_attention_heads)
        // int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    )
    return decode_loops.choose(dtype, heads, kv_heads, head_dim, config.block_size)


def _greedy_choice(device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    if device.type != "cpu":
        return "torch", f"on {device.type}: argmax on the device"
    if not cpu_kernels.supports(dtype):
        return "torch", f"the C kernel reads float32/bfloat16 logits, not {str(dtype).removeprefix('torch.')}"
    if not cpu_kernels.available():
        return "torch", f"the C kernels are unavailable ({cpu_kernels.unavailable_reason()})"
    return "c", "batches of plain greedy rows in one C kernel"


def _sampled_rows_choice(device: torch.device) -> tuple[str, str]:
    if device.type == "cpu":
        return "readback", "on the CPU a read-back costs nothing"
    return "sync_free", f"on {device.type} every read-back waits for the device's queue"


def cache_layout(model: nn.Module, dtype: torch.dtype, block_size: int) -> CacheLayout:
    """The model's cache layout, or the refusal of a model whose cache shape cannot be read: one kv
    group over the attention layers, shaped by what each layer's attention receives
    (:mod:`cbgen.model.kv_shapes`; by the config under tensor parallelism), KV-sharing readers
    pointing at their producers; for models with state layers, the state groups too
    (:func:`cbgen.model.state_cache.state_layout`).  Layouts of several kv groups are refused here
    until a backend takes them."""
    from cbgen.model import support
    from cbgen.model.state_cache import state_layout
    from cbgen.topology import is_sharded

    name = type(model).__name__
    try:
        if support.has_state_layers(model):
            layout = state_layout(model, dtype, block_size)
        elif is_sharded(model):
            layout = CacheLayout.from_model(model, dtype, block_size)
        else:
            layout = _recorded_or_config_layout(model, dtype, block_size)
    except support.UnsupportedModelError:
        raise
    except Exception as exc:  # whatever the config or the start-up forward raises, refused with it
        if support.has_state_layers(model):
            raise support.UnsupportedModelError(
                f"{name}'s state layers cannot be served through transformers' cache interface: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        raise support.geometry_error(model, exc) from exc
    if len(layout.kv_groups) != 1:
        raise support.UnsupportedModelError(
            f"{name}'s cache is {layout.describe()}: cbgen's attention backends take one kv group"
        )
    return layout


def _recorded_or_config_layout(model: nn.Module, dtype: torch.dtype, block_size: int) -> CacheLayout:
    """The layout read from a recorded forward, else (nothing called attention through the
    interface, or the forward failed) from the config, whose refusals and the start-up checks then
    say why the model cannot run."""
    from cbgen.model import kv_shapes, support

    try:
        layout = kv_shapes.recorded_layout(model, dtype, block_size)
    except Exception as exc:
        try:
            return CacheLayout.from_model(model, dtype, block_size)
        except Exception:
            raise support.UnsupportedModelError(
                f"{type(model).__name__}'s own forward on input_ids alone fails "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}), and its "
                "config states no KV shape: cbgen feeds the model token ids and positions only"
            ) from exc
    return layout if layout is not None else CacheLayout.from_model(model, dtype, block_size)


def _has_sinks(model: nn.Module) -> bool:
    """Whether an attention module of ``model`` holds sink logits (gpt-oss's ``sinks``)."""
    return any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules())
