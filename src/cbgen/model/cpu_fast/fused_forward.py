"""A fused eager forward of Llama-family models for CPU steps.

Why: at decode, a step of a small model on the CPU spends about a third of its time in the ~50
small torch ops each transformers decoder layer issues (norms, rotary embedding, activation,
residual adds, views), each paying dispatch and a pass over memory.  This forward runs the same
math as the transformers modules with the C kernels of :mod:`cbgen.model.kernels.cpu.ops`: per layer,
the seven projections (torch matmuls), one residual-add + RMSNorm after attention and one after the
MLP, one rotary call for q and k, the paged KV store and decode attention, and one SiLU-and-multiply.

It reads the user's modules and weights live at every step (packed copies follow the weights'
version counters).  Whether it runs at all is the execution plan's decision (:mod:`cbgen.model.plan`):
only for a model :func:`cbgen.model.cpu_fast.qualify.unsupported_reason` accepts, re-resolved when
the model's structure changes, so every model this decoder is given computes exactly what the
modules would.  The plan also names the projection GEMM of each row class (:func:`choose_gemms`) and
the row classes whose decode steps run as one C call (:func:`c_step_classes`).  Steps with prefill
chunks use it too (the projections are most of a prefill, and pre-packed weights make them faster).
Attention goes through the engine's C backend (:class:`cbgen.model.backends.CpuBackend`), with the
transformers path's semantics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cbgen.model.attention import AttentionMetadata
from cbgen.model.backends import CpuBackend
from cbgen.model.cpu_fast import gemm_choice
from cbgen.model.cpu_fast.gemm_choice import PLAIN, ROW_CLASSES, GemmPlan
from cbgen.model.cpu_fast.packed_linears import AMX_MAX_ROWS, PackedLinears, packable
from cbgen.model.cpu_fast.qualify import unsupported_reason
from cbgen.model.kernels.cpu import amx as cpu_amx
from cbgen.model.kernels.cpu import decoder as cpu_decoder
from cbgen.model.kernels.cpu import ops as cpu_kernels

__all__ = ["FusedDecoder", "c_step_classes", "choose_gemms", "unsupported_reason"]


def _window(attn: nn.Module) -> int:
    # Mistral reads its window from the config at call time; Qwen2/3 store it per layer; Llama has none.
    if type(attn).__name__.startswith("Mistral"):
        return int(getattr(attn.config, "sliding_window", None) or 0)
    return int(getattr(attn, "sliding_window", None) or 0)


# Record fields of the one-call C step, per projection group (see cpu_decoder.DecoderLayout).
_C_PROJ_FIELDS = (("W_QKV", "B_QKV"), ("W_O", "B_O"), ("W_GATE_UP", "B_GATE_UP"), ("W_DOWN", "B_DOWN"))


@dataclass(frozen=True)
class LayerModules:
    """One decoder layer's modules and constants as the fused forward uses them.  Parameters are
    held as objects (their values are read at every step); norms as (weight, eps)."""

    attn: nn.Module
    qkv: tuple[nn.Linear, nn.Linear, nn.Linear]
    o_proj: nn.Linear
    gate_up: tuple[nn.Linear, nn.Linear]
    down_proj: nn.Linear
    in_norm: tuple[torch.Tensor, float]
    post_norm: tuple[torch.Tensor, float]
    qk_norms: tuple[tuple[torch.Tensor, float], tuple[torch.Tensor, float]] | None
    head_dim: int
    scaling: float
    window: int
    layer_idx: int

    @property
    def groups(self) -> tuple[tuple[nn.Linear, ...], ...]:
        """The projection groups, each run as one GEMM: q/k/v, o, gate/up, down."""
        return (self.qkv, (self.o_proj,), self.gate_up, (self.down_proj,))


def _norm(module: nn.Module) -> tuple[torch.Tensor, float]:
    return module.weight, float(module.variance_epsilon)


@dataclass(frozen=True)
class ModelModules:
    """What a step reads from the model, looked up once instead of through ~25 ``nn.Module``
    attribute lookups per layer per step (the runner makes a new decoder when the structure
    changes, see :mod:`cbgen.model.plan`)."""

    dtype: torch.dtype
    embed: nn.Module
    rotary: nn.Module
    lm_head: nn.Linear
    layers: tuple[LayerModules, ...]
    next_norms: tuple[tuple[torch.Tensor, float], ...]  # layer i+1's input norm; the final norm last

    @classmethod
    def of(cls, model: nn.Module) -> ModelModules:
        """The modules of a model :func:`unsupported_reason` accepts."""
        inner = model.model
        layers = []
        for layer in inner.layers[: model.config.num_hidden_layers]:
            attn, mlp = layer.self_attn, layer.mlp
            q_norm = getattr(attn, "q_norm", None)
            layers.append(
                LayerModules(
                    attn=attn,
                    qkv=(attn.q_proj, attn.k_proj, attn.v_proj),
                    o_proj=attn.o_proj,
                    gate_up=(mlp.gate_proj, mlp.up_proj),
                    down_proj=mlp.down_proj,
                    in_norm=_norm(layer.input_layernorm),
                    post_norm=_norm(layer.post_attention_layernorm),
                    qk_norms=None if q_norm is None else (_norm(q_norm), _norm(attn.k_norm)),
                    head_dim=int(attn.head_dim),
                    scaling=float(attn.scaling),
                    window=_window(attn),
                    layer_idx=attn.layer_idx,
                )
            )
        norms = (*(layer.in_norm for layer in layers[1:]), _norm(inner.norm))
        return cls(
            model.lm_head.weight.dtype,
            inner.embed_tokens,
            inner.rotary_emb,
            model.lm_head,
            tuple(layers),
            norms,
        )


def gemm_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """``[N, K]`` of each projection group of the first layer (what a GEMM choice is keyed by)."""
    first = ModelModules.of(model).layers[0]
    return [(sum(m.weight.shape[0] for m in g), g[0].weight.shape[1]) for g in first.groups]


def choose_gemms(model: nn.Module, prepack: bool) -> GemmPlan:
    """The projection GEMM of each row class for a model the fused forward runs: measured on this
    machine once and cached on disk (:func:`cbgen.model.cpu_fast.gemm_choice.choose`), or plain
    ``F.linear`` everywhere without ``prepack``."""
    if not prepack:
        return GemmPlan(PLAIN, PLAIN, source="prepack_weights=False", single=PLAIN)
    modules = ModelModules.of(model)
    groups = [layer.groups for layer in modules.layers]
    shapes = gemm_shapes(model)

    def make_layers() -> list[list[torch.Tensor]]:
        per_layer = sum(n * k for n, k in shapes) * modules.layers[0].qkv[0].weight.element_size()
        count = gemm_choice.timing_layer_count(per_layer, len(groups))
        return [[torch.cat([m.weight.detach() for m in g]) for g in layer] for layer in groups[:count]]

    return gemm_choice.choose(modules.dtype, shapes, make_layers)


def c_step_classes(model: nn.Module, gemms: GemmPlan, max_rows: int) -> tuple[frozenset[str], str]:
    """The row classes whose decode-only steps run as one C call (``csrc/cpu_decoder.c``), and why
    the others do not, for a model the fused forward runs with ``gemms`` on decode steps of at most
    ``max_rows`` rows (``max_num_seqs``)."""
    modules = ModelModules.of(model)
    reason = _c_step_model_reason(modules)
    if reason is not None:
        return frozenset(), reason
    refused = {}
    for name in ROW_CLASSES:
        gemm = gemms.for_class(name).name
        why = _c_step_gemm_reason(modules, gemm)
        if why is None and gemm == "amx" and max_rows > AMX_MAX_ROWS:
            why = f"max_num_seqs={max_rows} allows decode steps past the AMX kernel's {AMX_MAX_ROWS} rows"
        if why is not None:
            refused[name] = why
    classes = frozenset(c for c in ROW_CLASSES if c not in refused)
    if not refused:
        return classes, "every row class's GEMM has a C form"
    return classes, "; ".join(f"{c}: {why}" for c, why in refused.items())


def _c_step_model_reason(modules: ModelModules) -> str | None:
    """Why no decode step of this model can run as one C call (None when its layers fit)."""
    if modules.dtype not in (torch.float32, torch.bfloat16):
        return f"{modules.dtype} weights"
    first = modules.layers[0]
    d = first.head_dim
    shape = [tuple(m.weight.shape) for g in first.groups for m in g]
    for layer, next_norm in zip(modules.layers, modules.next_norms):
        if layer.qk_norms is not None:
            return "q/k norms are not in the C step"
        if layer.head_dim != d or [tuple(m.weight.shape) for g in layer.groups for m in g] != shape:
            return "the layers differ in shape"
        if any(w.dtype != modules.dtype for w in (layer.post_norm[0], next_norm[0])):
            return "norm weights of another dtype"
        if not all(packable(sum(m.weight.numel() for m in g)) for g in layer.groups):
            return "projections too small to pack: they run as plain GEMMs"
    return None


def _c_step_gemm_reason(modules: ModelModules, gemm: str) -> str | None:
    """Why the C step cannot call ``gemm`` for this model's projections (None when it can)."""
    if gemm not in cpu_decoder.GEMMS:
        return f"{gemm} has no C form"
    if (gemm, modules.dtype) in (("dpbf16", torch.float32), ("panel512", torch.bfloat16)):
        return f"{gemm} does not take {modules.dtype} weights"
    if gemm == "amx":
        if modules.dtype != torch.bfloat16 or not cpu_amx.amx_available():
            return "AMX needs bfloat16 weights and a CPU with AMX"
        for g in modules.layers[0].groups:
            n, k = sum(m.weight.shape[0] for m in g), g[0].weight.shape[1]
            if not cpu_amx.amx_supports(torch.empty(n, k, dtype=modules.dtype, device="meta")):
                return f"AMX does not pack a {n}x{k} projection"
    return None


class FusedDecoder:
    """Runs the steps of a model the execution plan gave the fused forward (see the module
    docstring) with fused CPU kernels.

    ``gemms`` is the plan's projection GEMM per row class (default: what the engine used before
    measuring), ``c_step`` the row classes whose decode-only steps run as one C call.  The decoder
    decides no path itself: the plan qualified the model, and the runner makes a new decoder when
    the plan is re-resolved.  What it follows per step is the weights' values (version counters),
    to repack its copies.
    """

    def __init__(
        self,
        model: nn.Module,
        backend: CpuBackend | None = None,
        gemms: GemmPlan | None = None,
        c_step: frozenset[str] = frozenset(),
    ) -> None:
        self.model = model
        # Attention goes through the engine's C backend, as on the transformers path.
        self.backend = backend if backend is not None else CpuBackend()
        self._gemms = gemms
        self._c_step = c_step
        self._params = list(model.parameters())
        self._rope: tuple | None = None  # (key, cos table, sin table), see _rotary
        self._modules: ModelModules | None = None  # read on the first step
        self._linear: PackedLinears | None = None
        self._versions: list[int] | None = None  # parameter versions the packed copies were made at
        # per GEMM name: (key, layer records or None, what the key's ids name)
        self._c_tables: dict[str, tuple] = {}

    def weights_changed(self) -> None:
        """Drops packed weight copies (call when weights changed in a way no version counter shows)."""
        if self._linear is not None:
            self._linear.clear()

    def _rotary(
        self, rotary: nn.Module, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[T, D]`` for ``positions``: rows of a table the rotary module computed for
        positions 0..N-1 (N doubling as needed), since its values depend on the position alone.
        That is two ops a step instead of ~10.  Types whose frequencies change with the sequence
        length (dynamic, longrope) call the module every step."""
        rope_type = getattr(rotary, "rope_type", "default")
        if not isinstance(rope_type, str) or "dynamic" in rope_type or rope_type == "longrope":
            cos, sin = rotary(hidden[None], positions[None])
            return cos[0].contiguous(), sin[0].contiguous()
        need = int(positions.max()) + 1 if positions.numel() else 1
        inv = rotary.inv_freq
        key = (
            id(rotary),
            inv.data_ptr(),
            inv._version,
            hidden.dtype,
            getattr(rotary, "attention_scaling", 1.0),
        )
        table = self._rope
        if table is None or table[0] != key or table[1].shape[0] < need:
            size = max(need, 2 * table[1].shape[0] if table is not None and table[0] == key else 256)
            cos, sin = rotary(hidden[None], torch.arange(size, device=hidden.device)[None])
            table = self._rope = (key, cos[0].contiguous(), sin[0].contiguous())
        return table[1].index_select(0, positions), table[2].index_select(0, positions)

    def _current(self) -> ModelModules:
        """The modules this step reads, with packed copies that match the weights."""
        modules = self._modules
        if modules is None:
            modules = self._modules = ModelModules.of(self.model)
            self._linear = PackedLinears(modules.dtype, plan=self._gemms)
            self._versions = None
        # In-place updates (optimizer steps, copy_) bump version counters: one pass over every
        # parameter here lets the ~120 projection calls of a step skip their own checks.
        versions = [p._version for p in self._params]
        if versions != self._versions:
            self._linear.clear()
            self._versions = versions
        return modules

    def prepare(self) -> None:
        """Packs every projection now (at engine start) rather than in the first step; the copies
        stay valid until the weights change."""
        modules = self._current()
        for layer in modules.layers:
            for group in layer.groups:
                self._linear.entry(group)
        self._linear.entry((modules.lm_head,))

    def _c_layers(
        self, modules: ModelModules, linear: PackedLinears, meta: AttentionMetadata, rows: int
    ) -> tuple | None:
        """``(gemm, words, floats, dims)`` for :func:`cbgen.model.kernels.cpu.decoder.decoder_step` on a
        decode step of ``rows`` rows: the layer records of these modules, packed weights and KV
        cache for the GEMM that step uses; None when the plan runs the step's row class in the
        Python loop, or the records cannot be built (see :meth:`_build_c_layers`).  Rebuilt only
        when one of those changes."""
        if gemm_choice.row_class(rows) not in self._c_step:
            return None
        gemm = linear.plan.for_rows(rows).name
        key = (
            id(modules),
            id(linear),
            linear.generation,
            meta.kv_caches[0][0].data_ptr(),
            len(meta.kv_caches),
        )
        cached = self._c_tables.get(gemm)
        if cached is None or cached[0] != key:
            # The modules and PackedLinears are held so that their ids in the key stay theirs.
            cached = self._c_tables[gemm] = (
                key,
                self._build_c_layers(modules, linear, meta, gemm),
                modules,
                linear,
            )
        return None if cached[1] is None else (gemm, *cached[1])

    @staticmethod
    def _build_c_layers(
        mods: ModelModules, linear: PackedLinears, meta: AttentionMetadata, gemm: str
    ) -> tuple | None:
        """(words, floats, (heads, kv heads, head_dim, intermediate, block size, blocks)) when every layer's
        projections are packed for ``gemm`` (a GEMM the C step calls: AMX, or the panel GEMM), with
        uniform shapes and no q/k norms; else None.  Records are filled by field name, in the
        layout the library reports (cpu_decoder.decoder_layout).

        The plan chose the C step for this model and GEMM (:func:`c_step_classes`); these checks
        guard the pointers and sizes handed to C, and a packing that failed at run time (then
        every GEMM is plain and the Python loop runs)."""
        if gemm not in cpu_decoder.GEMMS or mods.dtype not in (torch.float32, torch.bfloat16):
            return None
        if (gemm, mods.dtype) in (("dpbf16", torch.float32), ("panel512", torch.bfloat16)):
            return None
        if gemm == "amx" and (mods.dtype != torch.bfloat16 or not cpu_amx.amx_available()):
            return None
        first = mods.layers[0]
        d = first.head_dim
        heads, kv_heads = first.qkv[0].weight.shape[0] // d, first.qkv[1].weight.shape[0] // d
        inter = first.gate_up[0].weight.shape[0]
        num_blocks, block_size = meta.kv_caches[0][0].shape[:2]
        words, floats = [], []
        for layer, next_norm in zip(mods.layers, mods.next_norms):
            k_cache, v_cache = meta.kv_caches[layer.layer_idx]
            q, k, v = layer.qkv
            if (
                layer.qk_norms is not None
                or layer.head_dim != d
                or (q.weight.shape[0], k.weight.shape[0], v.weight.shape[0])
                != (heads * d, kv_heads * d, kv_heads * d)
                or layer.gate_up[0].weight.shape[0] != inter
                or tuple(k_cache.shape) != (num_blocks, block_size, kv_heads, d)
                or v_cache.shape != k_cache.shape
                or k_cache.dtype != mods.dtype
                or any(w.dtype != mods.dtype for w in (layer.post_norm[0], next_norm[0]))
            ):
                return None
            row = {}
            for (weight_field, bias_field), modules in zip(_C_PROJ_FIELDS, layer.groups):
                entry = linear.entry(modules, checked=False)
                packed = entry.packed.get(gemm) if entry is not None else None
                if packed is None:
                    return None
                row[weight_field] = packed.data_ptr()
                row[bias_field] = 0 if entry.bias is None else entry.bias.data_ptr()
            row.update(POST_NORM=layer.post_norm[0].data_ptr(), NEXT_NORM=next_norm[0].data_ptr())
            row.update(K_CACHE=k_cache.data_ptr(), V_CACHE=v_cache.data_ptr(), WINDOW=layer.window)
            words.append(row)
            floats.append({"POST_EPS": layer.post_norm[1], "NEXT_EPS": next_norm[1], "SCALE": layer.scaling})
        records = cpu_decoder.decoder_layout().records(words, floats)
        return (*records, (heads, kv_heads, d, inter, block_size, num_blocks))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Logits ``[R, V]`` for ``rows`` of the packed batch.

        Decode-only steps call the backend's C kernels directly; steps with prefill chunks attend
        through :meth:`cbgen.model.backends.CpuBackend.attend_projections`.
        """
        mods = self._current()
        linear, backend = self._linear, self.backend
        hidden = mods.embed(input_ids)
        cos, sin = self._rotary(mods.rotary, hidden, positions)
        tokens = hidden.shape[0]
        mixed = bool(meta.prefills)
        if not mixed:
            table = meta.decode_block_table.to(torch.int32).contiguous()
            seq_lens = meta.decode_seq_lens.to(torch.int32).contiguous()
            slots = meta.slot_mapping.to(torch.int64).contiguous()
            c_layers = self._c_layers(mods, linear, meta, tokens) if linear.enabled else None
            if c_layers is not None:
                gemm, words, floats, dims = c_layers
                x = cpu_decoder.decoder_step(
                    gemm,
                    words,
                    floats,
                    mods.layers[0].in_norm,
                    hidden,
                    cos,
                    sin,
                    table,
                    seq_lens,
                    slots,
                    *dims,
                    attn_impl=backend.decode_impl,
                )
                return linear(x.index_select(0, rows), mods.lm_head, False)
        x = torch.empty_like(hidden)
        add_rmsnorm = cpu_kernels.add_rmsnorm
        add_rmsnorm(hidden, None, *mods.layers[0].in_norm, x)
        for layer, next_norm in zip(mods.layers, mods.next_norms):
            d = layer.head_dim
            q, k, v = linear.group(x, layer.qkv, False)
            if layer.qk_norms is not None:
                q, k = q.contiguous(), k.contiguous()  # the norm runs over [T * heads, d] rows
                qh, kh = q.view(-1, d), k.view(-1, d)
                add_rmsnorm(qh, None, *layer.qk_norms[0], qh)
                add_rmsnorm(kh, None, *layer.qk_norms[1], kh)
            cpu_kernels.rope_(q, k, cos, sin, d)
            if mixed:
                attn = layer.attn
                out = backend.attend_projections(
                    meta, layer.layer_idx, q, k, v, d, float(attn.scaling), _window(attn)
                )
            else:
                k_cache, v_cache = meta.kv_caches[layer.layer_idx]
                backend.store_direct(k, v, k_cache, v_cache, slots)
                out = backend.decode_direct(
                    q.view(tokens, -1, d),  # a view of the q/k/v GEMM's output: rows are strided
                    k_cache,
                    v_cache,
                    table,
                    seq_lens,
                    layer.scaling,
                    layer.window,
                    0.0,
                )
            delta = linear(out.view(tokens, -1), layer.o_proj, False)
            add_rmsnorm(hidden, delta, *layer.post_norm, x)
            gate, up = linear.group(x, layer.gate_up, False)
            act = cpu_kernels.silu_mul(gate, up, gate if gate.is_contiguous() else x.new_empty(up.shape))
            delta = linear(act, layer.down_proj, False)
            add_rmsnorm(hidden, delta, *next_norm, x)
        picked = x.index_select(0, rows)
        return linear(picked, mods.lm_head, False)
