"""A fused eager forward of Llama-family models for CPU steps.

Why: at decode, a step of a small model on the CPU spends about a third of its time in the ~50
small torch ops each transformers decoder layer issues (norms, rotary embedding, activation,
residual adds, views), each paying dispatch and a pass over memory.  This forward runs the same
math as the transformers modules with the C kernels of :mod:`cbgen.model.kernels.cpu.ops`: per layer,
the seven projections (torch matmuls), one residual-add + RMSNorm after attention and one after the
MLP, one rotary call for q and k, the paged KV store and decode attention, and one SiLU-and-multiply.

It reads the user's modules and weights live at every step (no copies, nothing to invalidate), and
it only runs where it computes exactly what the model would: the classes are on an allow list of
known Llama-family implementations (Llama, Mistral, Qwen2, Qwen3), every projection is a plain
``nn.Linear`` (a PEFT-wrapped layer is not), and no module has hooks.  Anything else takes the
transformers path.  Steps with prefill chunks use it too (the projections are most of a prefill,
and pre-packed weights make them faster).  Attention goes through the engine's C backend
(:class:`cbgen.model.backends.CpuBackend`), with the transformers path's semantics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cbgen.model.attention import AttentionMetadata
from cbgen.model.backends import CpuBackend
from cbgen.model.cpu_fast import gemm_choice
from cbgen.model.cpu_fast.packed_linears import AMX_MAX_ROWS, PackedLinears
from cbgen.model.kernels.cpu import amx as cpu_amx
from cbgen.model.kernels.cpu import decoder as cpu_decoder
from cbgen.model.kernels.cpu import ops as cpu_kernels

_FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3")
_LAYER = {f"{f}DecoderLayer" for f in _FAMILIES}
_ATTN = {f"{f}Attention" for f in _FAMILIES}
_MLP = {f"{f}MLP" for f in _FAMILIES}
_NORM = {f"{f}RMSNorm" for f in _FAMILIES}
_ROTARY = {f"{f}RotaryEmbedding" for f in _FAMILIES}
_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_PROJ = ("gate_proj", "up_proj", "down_proj")


def unsupported_reason(model: nn.Module) -> str | None:
    """Why :class:`FusedDecoder` cannot run ``model`` as it is now (None when it can)."""
    reason = _structure_reason(model)
    if reason is None and _any_hooks(model):
        return "forward hooks are registered"
    return reason


def _structure_reason(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    if config is None or inner is None or not isinstance(getattr(model, "lm_head", None), nn.Linear):
        return "not a *ForCausalLM with .model and a plain .lm_head"
    if any(hasattr(p, "device_mesh") for p in model.lm_head.parameters()):
        return "tensor-parallel (DTensor) weights: the fused path runs whole weights only"
    if type(model).__name__ not in {f"{f}ForCausalLM" for f in _FAMILIES}:
        return f"{type(model).__name__} is not on the fused path's allow list"
    if getattr(config, "hidden_act", None) not in ("silu", "swish"):
        return f"activation {getattr(config, 'hidden_act', None)!r} is not SiLU"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp != 1"
    if getattr(config, "final_logit_softcapping", None):
        return "logit soft-capping"
    dtype = model.lm_head.weight.dtype
    if not cpu_kernels.supports(dtype) or model.lm_head.weight.device.type != "cpu":
        return f"needs float32 or bfloat16 weights on the CPU (got {dtype}, {model.lm_head.weight.device})"
    if type(getattr(inner, "embed_tokens", None)) is not nn.Embedding:
        return "embeddings are not a plain nn.Embedding"
    if type(getattr(inner, "rotary_emb", None)).__name__ not in _ROTARY:
        return "unknown rotary embedding"
    if type(getattr(inner, "norm", None)).__name__ not in _NORM:
        return "unknown final norm"
    for layer in inner.layers[: config.num_hidden_layers]:
        reason = _layer_reason(layer)
        if reason is not None:
            return reason
    return None


def _layer_reason(layer: nn.Module) -> str | None:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if (
        type(layer).__name__ not in _LAYER
        or type(attn).__name__ not in _ATTN
        or type(mlp).__name__ not in _MLP
    ):
        return f"layer {type(layer).__name__} is not on the allow list"
    for name in ("input_layernorm", "post_attention_layernorm"):
        if type(getattr(layer, name, None)).__name__ not in _NORM:
            return f"unknown {name}"
    for name in _PROJ:
        if type(getattr(attn, name, None)) is not nn.Linear:
            return f"self_attn.{name} is {type(getattr(attn, name, None)).__name__}, not nn.Linear"
    for name in _MLP_PROJ:
        if type(getattr(mlp, name, None)) is not nn.Linear:
            return f"mlp.{name} is {type(getattr(mlp, name, None)).__name__}, not nn.Linear"
    for name in ("q_norm", "k_norm"):
        norm = getattr(attn, name, None)
        if norm is not None and type(norm).__name__ not in _NORM:
            return f"unknown self_attn.{name}"
    if attn.head_dim > 512 or attn.head_dim % 2:
        return "head_dim must be even and at most 512"
    return None


def _window(attn: nn.Module) -> int:
    # Mistral reads its window from the config at call time; Qwen2/3 store it per layer; Llama has none.
    if type(attn).__name__.startswith("Mistral"):
        return int(getattr(attn.config, "sliding_window", None) or 0)
    return int(getattr(attn, "sliding_window", None) or 0)


def _any_hooks(model: nn.Module) -> bool:
    # Hooks see (and may change) module inputs and outputs, which the fused path never produces.
    glob = nn.modules.module
    if glob._global_forward_hooks or glob._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def _contiguous_weights(model: nn.Module) -> bool:
    return all(p.is_contiguous() for p in model.parameters())


# Record fields of the one-call C step, per projection group (see cpu_decoder.DecoderLayout).
_C_PROJ_FIELDS = (("W_QKV", "B_QKV"), ("W_O", "B_O"), ("W_GATE_UP", "B_GATE_UP"), ("W_DOWN", "B_DOWN"))


@dataclass(frozen=True)
class _LayerPlan:
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


def _norm(module: nn.Module) -> tuple[torch.Tensor, float]:
    return module.weight, float(module.variance_epsilon)


@dataclass(frozen=True)
class _Plan:
    """What a step reads from the model, looked up once per structure check instead of through
    ~25 ``nn.Module`` attribute lookups per layer per step."""

    dtype: torch.dtype
    embed: nn.Module
    rotary: nn.Module
    lm_head: nn.Linear
    layers: tuple[_LayerPlan, ...]
    next_norms: tuple[tuple[torch.Tensor, float], ...]  # layer i+1's input norm; the final norm last

    @classmethod
    def of(cls, model: nn.Module) -> _Plan:
        """The plan of a model :func:`unsupported_reason` accepts."""
        inner = model.model
        layers = []
        for layer in inner.layers[: model.config.num_hidden_layers]:
            attn, mlp = layer.self_attn, layer.mlp
            q_norm = getattr(attn, "q_norm", None)
            layers.append(
                _LayerPlan(
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


class FusedDecoder:
    """Runs the steps of a supported model (see the module docstring) with fused CPU kernels.

    :meth:`forward` returns ``None`` when the model stopped qualifying (an adapter was injected, a
    hook registered, the dtype changed), so the caller falls back to the transformers path.  The
    structure check runs when the set of modules or their parameters changes, which it notices from
    the parameters' identities: cheap enough for every step.
    """

    def __init__(self, model: nn.Module, prepack: bool = True, backend: CpuBackend | None = None) -> None:
        self.model = model
        # Attention goes through the engine's C backend, as on the transformers path.
        self.backend = backend if backend is not None else CpuBackend()
        self._snap: tuple | None = None
        self._params: list[nn.Parameter] = []
        self._rope: tuple | None = None  # (key, cos table, sin table), see _rotary
        self._plan: _Plan | None = None  # the modules each step reads, rebuilt with the snapshot
        self._ok = False
        self._prepack = prepack
        self._linear: PackedLinears | None = None
        self._versions: list[int] | None = None  # parameter versions the packed copies were made at
        # per GEMM name: (key, layer records or None, what the key's ids name)
        self._c_tables: dict[str, tuple] = {}

    def weights_changed(self) -> None:
        """Drops packed weight copies (call when weights changed in a way no version counter shows)."""
        if self._linear is not None:
            self._linear.clear()

    def _still_ok(self) -> bool:
        # Modules are swapped when adapters are injected, parameters when the model is cast or
        # loaded; hooks are checked every step because registering one changes neither.  The walk
        # reuses the module list of the last full check and compares children and parameters by
        # identity (and storage, which ``.to(dtype)`` or ``.data =`` change): a full traversal of a
        # 30-layer model cost ~1.3 ms a step, this ~0.2.
        glob = nn.modules.module
        if glob._global_forward_hooks or glob._global_forward_pre_hooks:
            return False
        snap = self._snap
        if snap is not None:
            modules, children, params, ptrs = snap
            for m, kids, ps in zip(modules, children, params):
                if m._forward_hooks or m._forward_pre_hooks:
                    return False
                if list(m._modules.values()) != kids or list(map(id, m._parameters.values())) != ps:
                    break
            else:
                if [p.data_ptr() for p in self._params] == ptrs:
                    return self._ok
        if any(m._forward_hooks or m._forward_pre_hooks for m in self.model.modules()):
            return False
        modules = list(self.model.modules())
        self._params = list(self.model.parameters())
        self._snap = (
            modules,
            [list(m._modules.values()) for m in modules],
            [list(map(id, m._parameters.values())) for m in modules],
            [p.data_ptr() for p in self._params],
        )
        self._ok = _structure_reason(self.model) is None and _contiguous_weights(self.model)
        self._linear = None  # modules or parameters changed: repack from scratch
        self._plan = None
        return self._ok

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

    def _current_plan(self) -> _Plan | None:
        """The plan for this step, with packed copies that match the weights; None when the model
        does not qualify (now)."""
        if not cpu_kernels.available() or not self._still_ok():
            return None
        plan = self._plan
        if plan is None:
            plan = self._plan = _Plan.of(self.model)
        if self._linear is None:
            self._linear = PackedLinears(plan.dtype, enabled=self._prepack, plan=self._gemm_plan(plan))
            self._versions = None
        # In-place updates (optimizer steps, copy_) bump version counters: one pass over every
        # parameter here lets the ~120 projection calls of a step skip their own checks.
        versions = [p._version for p in self._params]
        if versions != self._versions:
            self._linear.clear()
            self._versions = versions
        return plan

    def _gemm_plan(self, plan: _Plan) -> gemm_choice.GemmPlan | None:
        """The projection GEMMs for this model, measured on this machine once (cached on disk)."""
        if not self._prepack:
            return None
        groups = [(layer.qkv, (layer.o_proj,), layer.gate_up, (layer.down_proj,)) for layer in plan.layers]
        shapes = [(sum(m.weight.shape[0] for m in g), g[0].weight.shape[1]) for g in groups[0]]

        def make_layers() -> list[list[torch.Tensor]]:
            per_layer = sum(n * k for n, k in shapes) * plan.layers[0].qkv[0].weight.element_size()
            count = gemm_choice.timing_layer_count(per_layer, len(groups))
            return [[torch.cat([m.weight.detach() for m in g]) for g in layer] for layer in groups[:count]]

        return gemm_choice.choose(plan.dtype, shapes, make_layers)

    def prepare(self) -> None:
        """Packs every projection now (at engine start) rather than in the first step; the copies
        stay valid until the weights change."""
        plan = self._current_plan()
        if plan is None:
            return
        for layer in plan.layers:
            for modules in (layer.qkv, (layer.o_proj,), layer.gate_up, (layer.down_proj,)):
                self._linear.entry(modules)
        self._linear.entry((plan.lm_head,))

    def _c_layers(
        self, plan: _Plan, linear: PackedLinears, meta: AttentionMetadata, rows: int
    ) -> tuple | None:
        """``(gemm, words, floats, dims)`` for :func:`cbgen.model.kernels.cpu.decoder.decoder_step` on a
        decode step of ``rows`` rows: the records of this plan, packed weights and KV cache for the
        GEMM that step uses, or None when the model or that GEMM does not fit the C step (see
        :meth:`_build_c_layers`).  Rebuilt only when one of those changes."""
        gemm = linear.plan.for_rows(rows).name
        if gemm == "amx" and rows > AMX_MAX_ROWS:
            return None  # the AMX candidate hands such steps to torch's GEMM
        key = (id(plan), id(linear), linear.generation, meta.kv_caches[0][0].data_ptr(), len(meta.kv_caches))
        cached = self._c_tables.get(gemm)
        if cached is None or cached[0] != key:
            # The plan and PackedLinears are held so that their ids in the key stay theirs.
            cached = self._c_tables[gemm] = (
                key,
                self._build_c_layers(plan, linear, meta, gemm),
                plan,
                linear,
            )
        return None if cached[1] is None else (gemm, *cached[1])

    @staticmethod
    def _build_c_layers(
        plan: _Plan, linear: PackedLinears, meta: AttentionMetadata, gemm: str
    ) -> tuple | None:
        """(words, floats, (heads, kv heads, head_dim, intermediate, block size, blocks)) when every layer's
        projections are packed for ``gemm`` (a GEMM the C step calls: AMX, or the panel GEMM), with
        uniform shapes and no q/k norms; else None.  Records are filled by field name, in the
        layout the library reports (cpu_decoder.decoder_layout)."""
        if gemm not in cpu_decoder.GEMMS or plan.dtype not in (torch.float32, torch.bfloat16):
            return None
        if gemm == "amx" and (plan.dtype != torch.bfloat16 or not cpu_amx.amx_available()):
            return None
        first = plan.layers[0]
        d = first.head_dim
        heads, kv_heads = first.qkv[0].weight.shape[0] // d, first.qkv[1].weight.shape[0] // d
        inter = first.gate_up[0].weight.shape[0]
        num_blocks, block_size = meta.kv_caches[0][0].shape[:2]
        words, floats = [], []
        for layer, next_norm in zip(plan.layers, plan.next_norms):
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
                or k_cache.dtype != plan.dtype
                or any(w.dtype != plan.dtype for w in (layer.post_norm[0], next_norm[0]))
            ):
                return None
            row = {}
            groups = (layer.qkv, (layer.o_proj,), layer.gate_up, (layer.down_proj,))
            for (weight_field, bias_field), modules in zip(_C_PROJ_FIELDS, groups):
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
    ) -> torch.Tensor | None:
        """Logits ``[R, V]`` for ``rows`` of the packed batch, or ``None`` (use the model instead).

        Decode-only steps call the backend's C kernels directly; steps with prefill chunks attend
        through :meth:`cbgen.model.backends.CpuBackend.attend_projections`.
        """
        plan = self._current_plan()
        if plan is None or any(cache.dtype != plan.dtype for cache, _ in meta.kv_caches):
            return None
        linear, backend = self._linear, self.backend
        hidden = plan.embed(input_ids)
        cos, sin = self._rotary(plan.rotary, hidden, positions)
        tokens = hidden.shape[0]
        mixed = bool(meta.prefills)
        if not mixed:
            table = meta.decode_block_table.to(torch.int32).contiguous()
            seq_lens = meta.decode_seq_lens.to(torch.int32).contiguous()
            slots = meta.slot_mapping.to(torch.int64).contiguous()
            c_layers = self._c_layers(plan, linear, meta, tokens) if linear.enabled else None
            if c_layers is not None:
                gemm, words, floats, dims = c_layers
                x = cpu_decoder.decoder_step(
                    gemm,
                    words,
                    floats,
                    plan.layers[0].in_norm,
                    hidden,
                    cos,
                    sin,
                    table,
                    seq_lens,
                    slots,
                    *dims,
                )
                return linear(x.index_select(0, rows), plan.lm_head, False)
        x = torch.empty_like(hidden)
        add_rmsnorm = cpu_kernels.add_rmsnorm
        add_rmsnorm(hidden, None, *plan.layers[0].in_norm, x)
        for layer, next_norm in zip(plan.layers, plan.next_norms):
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
        return linear(picked, plan.lm_head, False)
