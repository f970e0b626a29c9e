"""A fused eager forward of Llama-family models for CPU steps.

Why: at decode, a step of a small model on the CPU spends about a third of its time in the ~50
small torch ops each transformers decoder layer issues (norms, rotary embedding, activation,
residual adds, views), each paying dispatch and a pass over memory.  This forward runs the same
math as the transformers modules with the C kernels of :mod:`cbgen.model.cpu_kernels`: per layer,
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
from torch.nn import functional as F

from cbgen.model import cpu_amx, cpu_kernels
from cbgen.model.attention import AttentionMetadata
from cbgen.model.backends import CpuBackend

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


def _pack_ops(dtype: torch.dtype):
    """(pack, apply) for weights the CPU reorders once instead of at every call, or None.

    ``apply(x, packed, weight, bias)`` returns ``F.linear(x, weight, bias)`` from the packed copy, or
    None for an input it does not serve (the caller then runs plain linears).
    - float32: MKL's packed GEMM, identical to ``F.linear``; it only runs at the row count it packed
      for (any other count falls back to a plain GEMM inside MKL), so other counts get None.
    - bfloat16: the AMX kernel of ``csrc/cpu_gemm.c`` where the CPU has AMX (up to
      ``_AMX_MAX_ROWS`` rows; weights whose sides are not multiples of 32 go to oneDNN), else
      oneDNN's packed GEMM (identical to ``F.linear``).
    """
    try:
        if dtype == torch.float32 and torch._C.has_mkl:
            mkl = torch.ops.mkl

            def mkl_apply(x, packed, w, b):
                return mkl._mkl_linear(x, packed, w, b, _PACK_ROWS) if x.shape[0] == _PACK_ROWS else None

            return (lambda w: mkl._mkl_reorder_linear_weight(w, _PACK_ROWS), mkl_apply)
        if dtype == torch.bfloat16 and torch.backends.mkldnn.is_available():
            dnn = torch.ops.mkldnn
            if not dnn._is_mkldnn_bf16_supported():
                return None
            amx = cpu_amx.amx_available()

            def bf16_pack(w):
                if amx and cpu_amx.amx_supports(w):
                    return cpu_amx.amx_pack(w)
                return dnn._reorder_linear_weight(w, _PACK_ROWS)

            def bf16_apply(x, packed, w, b):
                if packed.dim() != 6:  # oneDNN's
                    return dnn._linear_pointwise(x, packed, b, "none", [], "")
                return cpu_amx.amx_linear(x, packed, b) if x.shape[0] <= _AMX_MAX_ROWS else None

            return (bf16_pack, bf16_apply)
    except (AttributeError, RuntimeError):
        pass
    return None


# MKL's packed GEMM only runs at the row count it packed for; 64 rows is where packing pays most
# (small-M GEMMs, ~20% faster) and oneDNN's hint.
_PACK_ROWS = 64
# Below this a packed GEMM's call overhead (~90 us measured at 256 x 64 x 64) outweighs its gain.
_PACK_MIN_ELEMS = 1 << 16
# Above this many rows torch's own bf16 GEMM takes over.  Hot, it beats the AMX kernel from ~1,024
# rows; inside an engine step, where the weights arrive cold, the AMX kernel still ran prefill steps
# of 2,048 tokens ~20% faster (530-590 against 690 ms a step), so the default token budget stays on it.
_AMX_MAX_ROWS = 4096
# (weight, bias) fields of each projection group (q/k/v, o, gate/up, down) in the one-call decoder
# step's layer records (csrc/cpu_decoder.c).
_C_PROJ_FIELDS = (("W_QKV", "B_QKV"), ("W_O", "B_O"), ("W_GATE_UP", "B_GATE_UP"), ("W_DOWN", "B_DOWN"))


def _stamp(modules: tuple[nn.Linear, ...]) -> list[int]:
    """What identifies the values of ``modules``' weights and biases: tensor, version, storage (as
    ints, so a check is one list comparison; the cache entry holds the tensors, so ids stay valid)."""
    out: list[int] = []
    for m in modules:
        for t in (m.weight, m.bias):
            if t is not None:
                out += (id(t), t._version, t.data_ptr())
    return out


class PackedLinears:
    """Pre-packed copies of linear weights, each rebuilt when its weight changes.

    :meth:`group` runs several projections of the same input (q/k/v, gate/up) as one GEMM over their
    concatenated packed weights: one call instead of three, and wide enough to keep the matrix units
    busy (oneDNN's bf16 GEMM ran the 192-wide k/v projections at a quarter of its speed at 960).

    A weight is repacked when its tensor, version counter (in-place updates, optimizer steps) or
    storage (``.data =`` / ``load_state_dict``) differs from what was packed, and likewise for the
    biases; :meth:`clear` covers writes no counter sees (through ``.data``), via
    ``notify_weights_updated``.  Costs one extra copy of every projection weight.
    """

    def __init__(self, dtype: torch.dtype, enabled: bool = True) -> None:
        self._ops = _pack_ops(dtype) if enabled else None
        self._cache: dict[tuple[int, ...], tuple] = {}
        self.generation = 0  # changes whenever an entry is made or dropped

    @property
    def enabled(self) -> bool:
        """Whether this torch build can pack weights of the dtype."""
        return self._ops is not None

    def clear(self) -> None:
        """Drops every packed copy (they are rebuilt on the next use)."""
        self._cache.clear()
        self.generation += 1

    def __call__(self, x: torch.Tensor, module: nn.Linear, checked: bool = True) -> torch.Tensor:
        """``F.linear(x, module.weight, module.bias)`` (``checked``: see :meth:`group`)."""
        return self.group(x, (module,), checked)[0]

    def group(
        self, x: torch.Tensor, modules: tuple[nn.Linear, ...], checked: bool = True
    ) -> tuple[torch.Tensor, ...]:
        """``F.linear(x, m.weight, m.bias)`` for each of ``modules`` (same input width): column slices
        of one output when packed (row stride = the summed widths), else separate tensors.

        ``checked=False`` skips comparing the weights' stamps with the packed copy's: for a caller
        that saw no weight change since the copy was made (:class:`FusedDecoder` checks every
        parameter's version once a step, which costs less than ~120 per-call stamps)."""
        entry = self.entry(modules, checked)
        if entry is None:
            return tuple(F.linear(x, m.weight, m.bias) for m in modules)
        packed = entry[1]
        if packed is not None:
            out = self._ops[1](x, packed, entry[2], entry[3])
            if out is None:
                return tuple(F.linear(x, m.weight, m.bias) for m in modules)
        elif entry[2] is not None:
            out = F.linear(x, entry[2], entry[3])
        else:
            return tuple(F.linear(x, m.weight, m.bias) for m in modules)
        return (out,) if entry[5] is None else out.split(entry[5], dim=1)

    def entry(self, modules: tuple[nn.Linear, ...], checked: bool = True) -> tuple | None:
        """The cache entry of ``modules`` (see :meth:`_pack`), made now if missing or (``checked``)
        stale; None when this build cannot pack."""
        if self._ops is None:
            return None
        key = tuple(map(id, modules))
        entry = self._cache.get(key)
        if entry is None or (checked and entry[0] != _stamp(modules)):
            try:
                entry = self._pack(modules)
            except RuntimeError:  # this build or CPU cannot: plain linears from now on
                self._ops = None
                self._cache.clear()
                return None
            self._cache[key] = entry
            self.generation += 1
        return entry

    def _pack(self, modules: tuple[nn.Linear, ...]) -> tuple:
        """(stamp, packed weight or None, plain weight or its shape stand-in or None, bias, the
        stamped tensors, output widths or None for one module) for ``modules``.  Small weights gain
        nothing from packing (call overhead): a group of them runs as one plain GEMM over a
        concatenated copy (a few hundred KiB at most), a single one as its own ``F.linear``
        (packed and plain weight both None)."""
        held = [t for m in modules for t in (m.weight, m.bias) if t is not None]
        widths = None if len(modules) == 1 else [m.weight.shape[0] for m in modules]
        small = sum(m.weight.numel() for m in modules) < _PACK_MIN_ELEMS
        if small and len(modules) == 1:
            return (_stamp(modules), None, None, None, held, None)
        with torch.no_grad():
            weights = [m.weight.detach() for m in modules]
            weight = weights[0] if len(modules) == 1 else torch.cat(weights)
            bias = None
            if any(m.bias is not None for m in modules):
                bias = torch.cat(
                    [
                        m.bias.detach() if m.bias is not None else w.new_zeros(w.shape[0])
                        for m, w in zip(modules, weights)
                    ]
                )
            if small:
                return (_stamp(modules), None, weight, bias, held, widths)
            # The apply ops read only the shape of the plain weight (they return None for inputs
            # they do not serve): a zero-stride stand-in keeps no second copy.
            shape_ref = weight if len(modules) == 1 else weight.new_zeros(1, 1).expand(weight.shape)
            return (_stamp(modules), self._ops[0](weight), shape_ref, bias, held, widths)


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
        self._c_table: tuple | None = None  # (key, layer records or None, what the key's ids name)

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
            self._linear = PackedLinears(plan.dtype, enabled=self._prepack)
            self._versions = None
        # In-place updates (optimizer steps, copy_) bump version counters: one pass over every
        # parameter here lets the ~120 projection calls of a step skip their own checks.
        versions = [p._version for p in self._params]
        if versions != self._versions:
            self._linear.clear()
            self._versions = versions
        return plan

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

    def _c_layers(self, plan: _Plan, linear: PackedLinears, meta: AttentionMetadata) -> tuple | None:
        """The layer records of :func:`cbgen.model.cpu_amx.decoder_step` for this plan, packed
        weights and KV cache, or None when the model does not fit it (see :meth:`_build_c_layers`).
        Rebuilt only when one of those changes."""
        key = (id(plan), id(linear), linear.generation, meta.kv_caches[0][0].data_ptr(), len(meta.kv_caches))
        cached = self._c_table
        if cached is None or cached[0] != key:
            # The plan and PackedLinears are held so that their ids in the key stay theirs.
            cached = self._c_table = (key, self._build_c_layers(plan, linear, meta), plan, linear)
        return cached[1]

    @staticmethod
    def _build_c_layers(plan: _Plan, linear: PackedLinears, meta: AttentionMetadata) -> tuple | None:
        """(words, floats, (heads, kv heads, head_dim, intermediate, block size, blocks)) when every layer's
        projections are AMX-packed, bf16, with uniform shapes and no q/k norms; else None.  Records
        are filled by field name, in the layout the library reports (cpu_amx.decoder_layout)."""
        if plan.dtype != torch.bfloat16 or not cpu_amx.amx_available():
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
                or k_cache.dtype != torch.bfloat16
                or any(w.dtype != torch.bfloat16 for w in (layer.post_norm[0], next_norm[0]))
            ):
                return None
            row = {}
            groups = (layer.qkv, (layer.o_proj,), layer.gate_up, (layer.down_proj,))
            for (weight_field, bias_field), modules in zip(_C_PROJ_FIELDS, groups):
                entry = linear.entry(modules, checked=False)
                if entry is None or entry[1] is None or entry[1].dim() != 6:
                    return None
                row[weight_field] = entry[1].data_ptr()
                row[bias_field] = 0 if entry[3] is None else entry[3].data_ptr()
            row.update(POST_NORM=layer.post_norm[0].data_ptr(), NEXT_NORM=next_norm[0].data_ptr())
            row.update(K_CACHE=k_cache.data_ptr(), V_CACHE=v_cache.data_ptr(), WINDOW=layer.window)
            words.append(row)
            floats.append({"POST_EPS": layer.post_norm[1], "NEXT_EPS": next_norm[1], "SCALE": layer.scaling})
        records = cpu_amx.decoder_layout().records(words, floats)
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
            c_layers = self._c_layers(plan, linear, meta) if tokens <= _AMX_MAX_ROWS else None
            if c_layers is not None:
                words, floats, dims = c_layers
                x = cpu_amx.decoder_step(
                    words, floats, plan.layers[0].in_norm, hidden, cos, sin, table, seq_lens, slots, *dims
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
