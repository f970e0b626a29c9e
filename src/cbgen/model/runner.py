"""Runs the user's model on a packed batch and returns logits only for the rows that need them.

The model is used as it is: no copy, no weight conversion.  For the duration of one forward the
runner switches the attention implementation to cbgen's paged function and puts modules in eval
mode; both are restored in ``finally`` blocks, so the module the trainer sees never changes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator

import torch

from cbgen.model import attention
from cbgen.model.attention import AttentionBackend
from cbgen.model.backends import CpuBackend, TorchBackend
from cbgen.model.cpu_fast import fused_forward as fused_decode_mod
from cbgen.model.cpu_fast.fused_forward import FusedDecoder
from cbgen.model.graphs import StaticDecodeRunner
from cbgen.model.input_batch import ModelInput
from cbgen.model.kv_cache import KVCache

log = logging.getLogger("cbgen")


def _attention_configs(model: torch.nn.Module) -> list:
    """Every config object an attention module reads its implementation from."""
    configs: dict[int, object] = {}
    root = getattr(model, "config", None)
    if root is not None:
        configs[id(root)] = root
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation_internal"):
            configs[id(cfg)] = cfg
    return list(configs.values())


def model_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    meta: attention.AttentionMetadata,
) -> torch.Tensor:
    """The packed forward: logits ``[R, V]`` for ``rows`` of the batch, attention through ``meta``."""
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


DECODE_MODES = ("auto", "eager", "static", "graphs")


def resolve_decode_mode(
    requested: str, device: torch.device, compile: bool, backend: AttentionBackend
) -> str:
    """How decode-only steps run: ``eager`` (the packed batch as it is), ``static`` (padded to a
    batch bucket in fixed buffers; what CUDA captures, runnable on CPU for tests) or ``graphs``
    (static, captured as CUDA graphs).  ``auto``: graphs on CUDA when the backend can be captured
    (else eager, with the reason logged), static on CPU with ``compile``, else eager."""
    if requested not in DECODE_MODES:
        raise ValueError(f"decode_mode must be one of {DECODE_MODES}, got {requested!r}")
    if requested == "graphs" and device.type != "cuda":
        raise ValueError("decode_mode='graphs' needs a CUDA device (use 'static' for the padded path)")
    if requested == "eager" and compile:
        raise ValueError("compile=True compiles the padded decode path: use decode_mode 'auto' or 'static'")
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "graphs" if backend.cuda_graphs_ok(device) else ("static" if compile else "eager")
    return "static" if compile else "eager"


class ModelRunner:
    """Executes forwards for the engine; owns the KV cache and the fixed-shape decode path.

    ``backend`` (from :func:`cbgen.model.backends.select_backend`; the torch reference when None)
    attends on every path: it rides on each step's metadata.  ``decode_mode`` (see
    :func:`resolve_decode_mode`) says whether decode-only steps run eagerly or through
    :class:`StaticDecodeRunner`'s padded buffers, captured as CUDA graphs or not; ``compile`` wraps
    that path's forward in ``torch.compile``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        device: torch.device,
        backend: AttentionBackend | None = None,
        max_num_seqs: int = 256,
        max_model_len: int = 8192,
        decode_mode: str = "auto",
        compile: bool = False,
        cuda_graph_max_batch: int | None = None,
        fused_decode: bool = False,
        prepack_weights: bool = False,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.attn_name = attention.register()
        self._configs = _attention_configs(model)
        self._check_layers()
        self.attn_backend = backend = backend if backend is not None else TorchBackend()
        backend.check_geometry(kv_cache.block_size, kv_cache.geometry.head_dim)
        self.decode_mode = mode = resolve_decode_mode(decode_mode, device, compile, backend)
        use_graphs = mode == "graphs"
        use_static = mode != "eager"
        self.compiled = compile
        self.static: StaticDecodeRunner | None = None
        if use_static:
            forward = self._forward
            if compile:
                forward = self._compiled_forward
            dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
            self.static = StaticDecodeRunner(
                forward=forward,
                kv_layers=lambda: self.kv_cache.layers,
                block_size=kv_cache.block_size,
                max_batch=min(cuda_graph_max_batch or max_num_seqs, max_num_seqs),
                max_width=-(-max_model_len // kv_cache.block_size),
                device=device,
                dtype=dtype,
                scratch_slot=kv_cache.scratch_slot,
                backend=backend,
                use_cuda_graphs=use_graphs,
            )
        # Eager CPU decode steps of Llama-family models: fused C kernels (falls back per step), with
        # the C backend's attention.
        self.fused: FusedDecoder | None = None
        if fused_decode and isinstance(backend, CpuBackend) and self.static is None:
            reason = fused_decode_mod.unsupported_reason(model)
            if reason is None:
                self.fused = FusedDecoder(model, prepack=prepack_weights, backend=backend)
                # Engine start, not the first step, pays for packing (~0.3 s for SmolLM2 in bf16).
                self.fused.prepare()
            else:
                log.info("cbgen: fused CPU decode not used: %s", reason)

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
        with torch._dynamo.config.patch(recompile_limit=_COMPILE_LIMIT):
            return _compiled_model_forward()(self.model, input_ids, positions, rows, meta)

    def warmup(self) -> None:
        """Captures the decode CUDA graphs (largest bucket first) before the first request."""
        if self.static is not None and self.static.use_cuda_graphs:
            with torch.inference_mode(), self._paged_mode():
                self.static.capture_all()

    def _check_layers(self) -> None:
        indices = {
            m.layer_idx for m in self.model.modules() if hasattr(m, "layer_idx") and hasattr(m, "config")
        }
        if not indices:
            raise ValueError(
                "cbgen needs a transformers model whose attention modules carry `layer_idx`; "
                f"{type(self.model).__name__} has none"
            )

    @contextlib.contextmanager
    def _paged_mode(self) -> Iterator[None]:
        """Swaps in paged attention and eval mode for one forward, then restores both exactly."""
        saved_impl = [(cfg, cfg._attn_implementation_internal) for cfg in self._configs]
        saved_training = None
        if self.model.training or any(m.training for m in self.model.modules()):
            saved_training = [(m, m.training) for m in self.model.modules()]
            self.model.eval()
        try:
            for cfg, _ in saved_impl:
                cfg._attn_implementation_internal = self.attn_name
            yield
        finally:
            for cfg, impl in saved_impl:
                cfg._attn_implementation_internal = impl
            if saved_training is not None:
                for module, flag in saved_training:
                    module.training = flag

    @torch.inference_mode()
    def execute(self, batch: ModelInput) -> torch.Tensor:
        """Forward over the packed batch; returns logits ``[R, V]`` for ``batch.logits_indices``."""
        meta = batch.meta
        meta.kv_caches = self.kv_cache.layers
        meta.backend = self.attn_backend
        if self.fused is not None:
            # Outside _paged_mode: the fused path calls no module whose result depends on the
            # attention setting or on training mode (it computes the eval-mode math itself), and
            # that mode switch walks every module of the model (~1 ms a step for 30 layers).
            logits = self.fused.forward(batch.input_ids, batch.positions, batch.logits_indices, meta)
            if logits is not None:
                return logits
        with self._paged_mode():
            if self.static is not None and self.static.can_run(batch):
                return self.static.run(batch)
            return self._forward(batch.input_ids, batch.positions, batch.logits_indices, meta)

    def weights_changed(self) -> None:
        """Drops anything derived from the weights (the fused path's packed copies)."""
        if self.fused is not None:
            self.fused.weights_changed()

    def release(self) -> None:
        """Drops graphs, static buffers and packed weights (the KV cache is released by its owner)."""
        if self.static is not None:
            self.static.release()
        self.weights_changed()

    def resume(self) -> None:
        """Re-creates what :meth:`release` dropped."""
        if self.static is not None:
            self.static.resume()
