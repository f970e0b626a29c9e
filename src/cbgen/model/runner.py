"""Runs the user's model on a packed batch and returns logits only for the rows that need them.

The model is used as it is: no copy, no weight conversion.  For the duration of one forward, and
on the engine's thread only, the model runs cbgen's paged attention, in eval mode, with per-token
rotary tables where its rotary frequencies depend on the sequence length
(:mod:`cbgen.model.thread_view`, :mod:`cbgen.model.rotary`): a trainer using the same module on
another thread at that moment sees it as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable, Iterator

import torch

from cbgen.batch_invariant import context as parity_context
from cbgen.batch_invariant.direct_forward import ParityDirectForward
from cbgen.batch_invariant.dispatch import ParityOps
from cbgen.batch_invariant.packs import WeightPacks
from cbgen.model import attention, state_kernels, state_pieces, thread_view
from cbgen.model.backends import make_backend
from cbgen.model.cpu_fast import decode_loops
from cbgen.model.cpu_fast.fused_forward import FusedDecoder
from cbgen.model.cpu_fast.packed_linears import PackedLinears
from cbgen.model.cpu_fast.qualify import StructureWatch
from cbgen.model.graphs import StaticDecodeRunner
from cbgen.model.input_batch import ModelInput
from cbgen.model.kv_cache import KVCache
from cbgen.model.plan import PARITY_MODULE_WHY, ExecutionPlan, resolve_again
from cbgen.model.rotary import LengthRotary
from cbgen.model.state_cache import StepStates, projections
from cbgen.model.state_kernels import StateKernels

log = logging.getLogger("cbgen")


def model_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    meta: attention.AttentionMetadata,
) -> torch.Tensor:
    """The packed forward: logits ``[R, V]`` for ``rows`` of the batch, attention through ``meta``.

    ``meta`` reaches the attention function as a keyword argument, which transformers threads
    through every layer, and, for models whose layers drop their keyword arguments, through
    :data:`attention.CURRENT_META`, set by the runner around the forward."""
    out = model(
        input_ids=input_ids[None],
        position_ids=positions[None],
        use_cache=False,
        logits_to_keep=rows,
        cbgen_meta=meta,
    )
    return out.logits[0]


# Batch buckets (up to ~20) times the models a process serves.
_COMPILE_LIMIT = 64


@functools.cache
def _compiled_model_forward():
    return torch.compile(model_forward, dynamic=False)


class ModelRunner:
    """Executes forwards for the engine; owns the KV cache and the fixed-shape decode path.

    ``plan`` (:func:`cbgen.model.plan.resolve_plan`) says what runs: the attention backend, which
    rides on each step's metadata; whether decode-only steps run eagerly or through
    :class:`StaticDecodeRunner`'s padded buffers (captured as CUDA graphs or not, compiled or not);
    and whether forwards run through the fused CPU forward or the model's modules.  The runner
    re-resolves the plan when the model's structure changes (see :mod:`cbgen.model.plan`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        plan: ExecutionPlan,
        max_num_seqs: int = 256,
        max_model_len: int = 8192,
        cuda_graph_max_batch: int | None = None,
        length_rotary: LengthRotary | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = plan.device
        self.attn_name = attention.register()
        self._configs = attention.attention_configs(model)
        # Per-token cos/sin for rotary types whose frequencies depend on the sequence length.
        self.length_rotary = length_rotary
        # Keeps the thread-view properties installed between steps (see thread_view.Hold); let go
        # when the runner is.
        self._hold = thread_view.Hold()
        weakref.finalize(self, self._hold.release)
        self.attn_backend = backend = make_backend(
            plan.attention, plan.device, decode_loops.IMPLS[plan.decode_loops]
        )
        backend.check_geometry(kv_cache.block_size, kv_cache.geometry.k_head_dim)
        self._kv_readers = frozenset(reader for reader, _ in kv_cache.layout.shared)
        self.compiled = plan.compile
        self.static: StaticDecodeRunner | None = None
        if plan.decode_mode != "eager":
            self.static = StaticDecodeRunner(
                forward=self._compiled_forward if plan.compile else self._forward,
                kv_layers=lambda: self.kv_cache.layers,
                block_size=kv_cache.block_size,
                max_batch=min(cuda_graph_max_batch or max_num_seqs, max_num_seqs),
                max_width=-(-max_model_len // kv_cache.block_size),
                device=plan.device,
                dtype=plan.dtype,
                scratch_slot=kv_cache.scratch_slot,
                backend=backend,
                use_cuda_graphs=plan.decode_mode == "graphs",
            )
        self._watch = StructureWatch(model) if plan.watch_structure else None
        # The parity plan's direct forward runs only once the engine's start-up check passed
        # (cbgen.model.support.check_direct_forward): None until then, then its verdict.
        self.direct_checked: bool | None = None
        self._follow(plan, initial=True)
        if self.fused is not None:
            # Engine start, not the first step, pays for packing (~0.3 s for SmolLM2 in bf16).
            self.fused.prepare()

    def _follow(self, plan: ExecutionPlan, initial: bool = False) -> None:
        """Runs what ``plan`` says from the next forward on (``initial``: the plan at start, whose
        direct forward the engine is about to check)."""
        if plan.forward == "direct" and not initial and self.direct_checked is not True:
            # The direct forward without a passed start-up check (failed, not possible, or the plan
            # at start was the module forward): the check needs the idle cache of engine start.
            plan = dataclasses.replace(
                plan, forward="module", forward_why=f"{PARITY_MODULE_WHY} (the direct forward is not checked)"
            )
        self.plan = plan
        self.fused: FusedDecoder | None = None
        self.state_linears: PackedLinears | None = None
        # Parity mode's packed weights, made on first use and dropped on a weight change.
        self.parity_packs = WeightPacks(self.model) if plan.parity else None
        self.direct: ParityDirectForward | None = None
        # The one forward every step runs until the next plan: chosen here, never per step.  Kept
        # as the class's function, not a bound method: that would be a reference cycle through the
        # runner, and an engine in a cycle keeps its cache until the cycle collector runs.
        self._step: Callable[[ModelRunner, ModelInput, attention.AttentionMetadata], torch.Tensor]
        if plan.cache.state_groups:
            self._step = ModelRunner._state_step
            state_kernels.hold(plan.state_kernels, self._hold)
            # The projections' packed GEMMs (the plan's per row class), applied on this thread only.
            if plan.gemms is not None and plan.gemms.packs:
                self.state_linears = PackedLinears(plan.dtype, plan=plan.gemms)
                self._projections = projections(self.model)
        elif plan.forward == "fused":
            self.fused = FusedDecoder(self.model, self.attn_backend, plan.gemms, plan.c_step)
            self._step = ModelRunner._fused_step
        elif plan.forward == "direct":
            self.direct = ParityDirectForward(self.model, self.parity_packs)
            self._step = ModelRunner._direct_step
        else:
            # Fixed-shape decode (padded buffers, CUDA graphs) wraps the module forward.
            self._step = ModelRunner._static_step if self.static is not None else ModelRunner._module_step

    def direct_check_done(self, passed: bool | None) -> None:
        """Records the start-up check of the parity plan's direct forward (None: the cache was too
        small to run it); anything but a pass sends this runner to the module forward for good,
        re-resolved plans included."""
        self.direct_checked = passed is True
        if passed:
            # The check's module forward packed every single weight; the direct forward reads only
            # the concatenated groups and the LM head, so the rest would be a second packed model.
            self.parity_packs.clear()
            self.direct.prepare()
            return
        if passed is None:
            log.info(
                "cbgen: parity mode runs the module forward: the cache is too small for the direct forward's check"
            )
        else:
            log.warning(
                "cbgen: parity mode's direct forward differs from the module forward; running the latter"
            )
        self._follow(self.plan)

    def _replan(self, why: str) -> None:
        """Resolves the plan again for the model as it is now, and follows it."""
        plan = resolve_again(self.plan, self.model)
        changed = plan.describe() != self.plan.describe()
        log.log(
            logging.INFO if changed else logging.DEBUG,
            "cbgen: execution plan re-resolved (%s): %s",
            why,
            plan,
        )
        self._follow(plan)

    @property
    def decode_mode(self) -> str:
        """How decode-only steps run (the plan's ``decode_mode``)."""
        return self.plan.decode_mode

    @property
    def backend(self) -> str:
        """The attention backend's name (``torch``, ``cpu``, ``triton`` or ``flash_attn``)."""
        return self.attn_backend.name

    @property
    def decode_fn(self) -> Callable[..., torch.Tensor]:
        """The backend's paged decode kernel (``paged_ops.paged_decode_attention`` for torch)."""
        return self.attn_backend.decode_kernel

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
        meta: attention.AttentionMetadata,
    ) -> torch.Tensor:
        with attention.step_metadata(meta):
            return model_forward(self.model, input_ids, positions, rows, meta)

    def _compiled_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
        meta: attention.AttentionMetadata,
    ) -> torch.Tensor:
        # One compiled function per process, with the model as an argument: every engine built on
        # the same model (a new LLM per RL round or benchmark run) reuses the compiled buckets.
        # Each batch bucket is its own static-shape graph, hence the raised recompile limit.
        with torch._dynamo.config.patch(recompile_limit=_COMPILE_LIMIT), attention.step_metadata(meta):
            return _compiled_model_forward()(self.model, input_ids, positions, rows, meta)

    def warmup(self) -> None:
        """Captures the decode CUDA graphs (largest bucket first) before the first request."""
        if self.static is not None and self.static.use_cuda_graphs:
            with torch.inference_mode(), self._module_view():
                self.static.capture_all()

    @contextlib.contextmanager
    def _module_view(self) -> Iterator[None]:
        """This thread's view of the model for one module forward: cbgen's paged attention, and eval
        mode when some module is in training mode.  Other threads see the model as it is."""
        self._hold.attention(self._configs)
        with contextlib.ExitStack() as stack:
            stack.enter_context(thread_view.attention(self._configs, self.attn_name))
            if any(m.training for m in self.model.modules()):
                self._hold.training()
                stack.enter_context(thread_view.eval_mode())
            yield

    def _rotary_view(
        self, batch: ModelInput, tokens: slice | None = None
    ) -> contextlib.AbstractContextManager:
        """Per-token rotary tables for this step (whatever forward runs it), or for its ``tokens``,
        when the model's rotary frequencies depend on the sequence length, else nothing."""
        rotary = self.length_rotary
        if rotary is None:
            return contextlib.nullcontext()
        extents = batch.rope_extents
        if extents is not None and tokens is not None:
            extents = extents[tokens]
        if extents is None:
            raise RuntimeError(
                "a step of a model with length-dependent rotary frequencies came without extents"
            )

        def per_token(x: torch.Tensor, position_ids: torch.Tensor, *args, **kwargs):
            if position_ids.numel() != extents.numel():
                raise RuntimeError(
                    f"the rotary module was called for {position_ids.numel()} positions in a step of "
                    f"{extents.numel()} tokens"
                )
            return rotary.cos_sin(x, position_ids.reshape(-1), extents)

        return thread_view.forward(rotary.module, per_token)

    def _parity_ops(self) -> contextlib.AbstractContextManager:
        """The parity dispatch mode under the parity plan (the trainer side runs under the same
        mode, :mod:`cbgen.batch_invariant`), else nothing."""
        return ParityOps(self.parity_packs) if self.plan.parity else contextlib.nullcontext()

    @torch.inference_mode()
    def execute(self, batch: ModelInput) -> torch.Tensor:
        """Forward over the packed batch; returns logits ``[R, V]`` for ``batch.logits_indices``."""
        if parity_context.active_on_this_thread():
            # The context's dispatch mode is this thread's: the step's products would run through it.
            raise RuntimeError(
                "a cbgen step ran inside `with cbgen.parity(...)` on the same thread: generate outside "
                "the parity context (it is for the trainer's forward)"
            )
        meta = batch.meta
        meta.kv_caches = self.kv_cache.layers
        meta.kv_readers = self._kv_readers
        meta.backend = self.attn_backend
        if self._watch is not None and self._watch.changed():
            # The one check before a step (see cbgen.model.plan): hooks and module swaps reach no
            # weight fingerprint, and a fused step over them would compute the wrong thing.
            self._replan("the model's modules, hooks or weight storage changed")
        if batch.pieces is not None:
            return self._step(self, batch, meta)  # its forwards take their own rotary views
        with self._rotary_view(batch):
            return self._step(self, batch, meta)

    def _state_step(self, batch: ModelInput, meta: attention.AttentionMetadata) -> torch.Tensor:
        """A step of a model with state layers: the forwards of :mod:`cbgen.model.state_pieces`,
        each with a :class:`StepStates` over its rows' state slots, their logits gathered into the
        step's logits rows."""
        out: torch.Tensor | None = None
        kernels = self.plan.state_kernels
        with self._module_view(), self._packed_projections():
            for piece in batch.pieces:
                piece.meta.kv_caches = self.kv_cache.layers
                piece.meta.kv_readers = self._kv_readers
                piece.meta.backend = self.attn_backend
                shape = piece.shape
                decode = shape[1] == 1 and not piece.fresh
                states = StepStates(
                    self.kv_cache.states,
                    piece.slots,
                    piece.fresh,
                    piece.past,
                    piece.meta.derived,
                    in_place=kernels.in_place if decode else frozenset(),
                )
                keep, dest, src = state_pieces.logits_rows(piece, batch.logits_indices)
                with (
                    self._rotary_view(batch, piece.tokens),
                    attention.step_metadata(piece.meta),
                    state_kernels.engaged(kernels if decode else StateKernels(), states),
                ):
                    logits = self.model(
                        input_ids=batch.input_ids[piece.tokens].view(shape),
                        position_ids=batch.positions[piece.tokens].view(shape),
                        cache=states,
                        use_cache=True,
                        # Decode rows keep their one position each, a prefill row what the step needs.
                        logits_to_keep=1 if shape[1] == 1 else keep,
                        cbgen_meta=piece.meta,
                    ).logits
                states.store()
                logits = logits[:, -1][keep] if shape[1] == 1 else logits[0]
                if out is None:
                    out = logits.new_empty((batch.logits_indices.shape[0], logits.shape[-1]))
                out[dest] = logits[src]
        return out

    @contextlib.contextmanager
    def _packed_projections(self) -> Iterator[None]:
        """For this thread's forwards only: the projections run the plan's packed GEMMs
        (:class:`PackedLinears`, repacked when a weight changes); other threads run them as they are."""
        packed = self.state_linears
        if packed is None:
            yield
            return

        def linear(module: torch.nn.Linear):
            def forward(x: torch.Tensor) -> torch.Tensor:
                rows = x.reshape(-1, x.shape[-1])
                return packed(rows, module).view(*x.shape[:-1], module.out_features)

            return forward

        with contextlib.ExitStack() as stack:
            for module in self._projections:
                stack.enter_context(thread_view.forward(module, linear(module)))
            yield

    def _fused_step(self, batch: ModelInput, meta: attention.AttentionMetadata) -> torch.Tensor:
        # No module view: the fused path calls no module whose result depends on the attention
        # setting or on training mode (it computes the eval-mode math itself), and the view's
        # training check walks every module of the model (~1 ms a step for 30 layers).
        return self.fused.forward(batch.input_ids, batch.positions, batch.logits_indices, meta)

    def _direct_step(self, batch: ModelInput, meta: attention.AttentionMetadata) -> torch.Tensor:
        # The parity plan's direct forward (cbgen.batch_invariant.direct_forward): like the fused
        # one, it calls no module whose result depends on the attention setting or on training
        # mode, and it runs the parity kernels itself.
        with attention.step_metadata(meta):
            return self.direct.forward(batch.input_ids, batch.positions, batch.logits_indices, meta)

    def _module_step(self, batch: ModelInput, meta: attention.AttentionMetadata) -> torch.Tensor:
        with self._module_view(), self._parity_ops():
            return self._forward(batch.input_ids, batch.positions, batch.logits_indices, meta)

    def _static_step(self, batch: ModelInput, meta: attention.AttentionMetadata) -> torch.Tensor:
        """The module forward, through the padded decode buffers (graphs) where the step fits them."""
        if not self.static.can_run(batch):
            return self._module_step(batch, meta)
        with self._module_view(), self._parity_ops():
            return self.static.run(batch)

    @contextlib.contextmanager
    def module_forward(self) -> Iterator[None]:
        """Runs the module forward for the steps inside (the direct forward's start-up check
        compares the two on the same steps)."""
        saved, self._step = self._step, ModelRunner._module_step
        try:
            yield
        finally:
            self._step = saved

    def weights_changed(self) -> None:
        """Called on every weight change the engine notices: re-resolves the plan when the model's
        structure changed with it (an adapter injected, a weight recast), else drops what was
        derived from the old values (the fused path's packed copies)."""
        if self._watch is not None and self._watch.changed():
            self._replan("the weights changed with the model's structure")
        elif self.fused is not None:
            self.fused.weights_changed()
        if self.state_linears is not None:
            self.state_linears.clear()
        if self.parity_packs is not None:
            self.parity_packs.clear()
        if self.direct is not None:
            self.direct.weights_changed()

    def release(self) -> None:
        """Drops graphs, static buffers and packed weights (the KV cache is released by its owner),
        and lets the thread-view properties go."""
        self._hold.release()
        if self.static is not None:
            self.static.release()
        if self.fused is not None:
            self.fused.weights_changed()
        if self.state_linears is not None:
            self.state_linears.clear()
        if self.parity_packs is not None:
            self.parity_packs.clear()
        if self.direct is not None:
            self.direct.weights_changed()

    def resume(self) -> None:
        """Re-creates what :meth:`release` dropped."""
        if self.static is not None:
            self.static.resume()
