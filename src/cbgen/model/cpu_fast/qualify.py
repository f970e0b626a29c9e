"""Whether the fused CPU forward computes exactly what a model computes, and a watch on what changes that.

The fused forward (:mod:`cbgen.model.cpu_fast.fused_forward`) runs the math of known Llama-family
classes itself, so it may only run a model whose classes are on its allow list, whose projections
are plain ``nn.Linear`` (a PEFT-wrapped layer is not), whose weights are contiguous and which has no
hooks (hooks see, and may change, module inputs and outputs the fused path never produces).
:func:`unsupported_reason` says why a model does not qualify; the execution plan
(:mod:`cbgen.model.plan`) asks it when it is resolved.

:class:`StructureWatch` notices the changes after which that answer may differ: a module swapped
(adapters injected or unloaded), a parameter replaced, recast or moved (new storage), a hook
registered or removed.  The runner re-resolves the plan when it fires.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch
from torch import nn

from cbgen.model.kernels.cpu import ops as cpu_kernels

_FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3")
_LAYER = {f"{f}DecoderLayer" for f in _FAMILIES}
_ATTN = {f"{f}Attention" for f in _FAMILIES}
_MLP = {f"{f}MLP" for f in _FAMILIES}
_NORMS = {f"{f}RMSNorm" for f in _FAMILIES}
_ROTARY = {f"{f}RotaryEmbedding" for f in _FAMILIES}
_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_PROJ = ("gate_proj", "up_proj", "down_proj")


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the fused forward cannot run ``model`` as it is now (None when it can)."""
    reason = _structure_reason(model)
    if reason is None and _any_hooks(model):
        return "forward hooks are registered"
    if reason is None and not all(p.is_contiguous() for p in model.parameters()):
        return "some weights are not contiguous"
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
    if type(getattr(inner, "norm", None)).__name__ not in _NORMS:
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
        if type(getattr(layer, name, None)).__name__ not in _NORMS:
            return f"unknown {name}"
    for name in _PROJ:
        if type(getattr(attn, name, None)) is not nn.Linear:
            return f"self_attn.{name} is {type(getattr(attn, name, None)).__name__}, not nn.Linear"
    for name in _MLP_PROJ:
        if type(getattr(mlp, name, None)) is not nn.Linear:
            return f"mlp.{name} is {type(getattr(mlp, name, None)).__name__}, not nn.Linear"
    for name in ("q_norm", "k_norm"):
        norm = getattr(attn, name, None)
        if norm is not None and type(norm).__name__ not in _NORMS:
            return f"unknown self_attn.{name}"
    if attn.head_dim > 512 or attn.head_dim % 2:
        return "head_dim must be even and at most 512"
    return None


def _global_hooks() -> bool:
    glob = nn.modules.module
    return bool(glob._global_forward_hooks or glob._global_forward_pre_hooks)


def inert(hook: object) -> bool:
    """Whether a hook is one of cbgen's own that acts only on threads inside a cbgen context (the
    parity context's positions hook): it changes nothing an engine step computes."""
    return getattr(hook, "cbgen_inert", False) is True


def _live(hooks: dict) -> int:
    return sum(1 for h in hooks.values() if not inert(h))


def _hooked(module: nn.Module) -> bool:
    return bool(_live(module._forward_hooks) or _live(module._forward_pre_hooks))


def _any_hooks(model: nn.Module) -> bool:
    return _global_hooks() or any(_hooked(m) for m in model.modules())


def _storage(p: torch.Tensor) -> int:
    # A tensor-parallel (DTensor) parameter's storage is its local shard's.
    local = getattr(p, "_local_tensor", None)
    return (local if isinstance(local, torch.Tensor) else p).data_ptr()


@dataclass(frozen=True)
class _Snapshot:
    """The containers a look reads, and what it read there."""

    # Held so that no module or parameter of the look is freed and its id reused by a replacement.
    modules: list[nn.Module]
    hook_dicts: list[dict]  # each module's forward hooks, then its forward pre-hooks
    child_dicts: list[dict]  # each module's ``_modules``
    param_dicts: list[dict]  # each module's ``_parameters``
    params: list[nn.Parameter]
    sharded: bool  # some parameter is a DTensor: its storage is its local shard's
    state: tuple


class StructureWatch:
    """Notices changes to a model's module tree, parameters' identity or storage, and hooks.

    :meth:`changed` compares the hook counts, children and parameters of the modules of the last
    look, and every parameter's storage pointer, with what they are now.  It reuses the last look's
    module list instead of walking the tree, and reads those containers through ``map`` rather than
    a Python loop per module: the check runs before every step, where a loop over SmolLM2's 397
    modules took ~0.8 ms (its caches cold after the step's kernels), ~7% of a one-row bf16 step.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._last = self._look()

    def _look(self) -> _Snapshot:
        modules = list(self.model.modules())
        params = list(self.model.parameters())
        snap = _Snapshot(
            modules=modules,
            hook_dicts=[d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks)],
            child_dicts=[m._modules for m in modules],
            param_dicts=[m._parameters for m in modules],
            params=params,
            sharded=any(isinstance(getattr(p, "_local_tensor", None), torch.Tensor) for p in params),
            state=(),
        )
        return dataclasses.replace(snap, state=self._state(snap))

    @staticmethod
    def _state(snap: _Snapshot) -> tuple:
        # Identities and counts only (a value that changes in place is not a structural change);
        # the dicts' sizes keep a child that moved between parents from reading as unchanged.
        values = itertools.chain.from_iterable
        storage = map(_storage, snap.params) if snap.sharded else map(torch.Tensor.data_ptr, snap.params)
        hooks = list(map(len, snap.hook_dicts))
        if any(hooks):  # rare: count only hooks that can change a step (not cbgen's inert ones)
            hooks = [n and _live(d) for n, d in zip(hooks, snap.hook_dicts)]
        return (
            _global_hooks(),
            hooks,
            list(map(len, snap.child_dicts)),
            list(map(id, values(map(dict.values, snap.child_dicts)))),
            list(map(len, snap.param_dicts)),
            list(map(id, values(map(dict.values, snap.param_dicts)))),
            list(storage),
        )

    def _same(self) -> bool:
        return self._state(self._last) == self._last.state

    def changed(self) -> bool:
        """True (once per change) when the structure differs from the last look; then looks again."""
        if self._same():
            return False
        self._last = self._look()
        return True
