"""Notices when the shared model's weights change, so cached K/V computed under old weights is dropped.

An optimizer step, ``load_state_dict`` and any other in-place update bump the parameters' version
counters; replacing ``param.data`` changes its storage pointer; PEFT changes the adapter's forward without
touching any watched tensor (an adapter switch, a ``disable_adapter()`` context, a LoRA scale set by
``set_scale``/``scale_layer``, a merge, whose ``.data`` write on the base weight no version counter
sees), so the fingerprint also holds each tuner layer's state (:func:`_adapter_state`).  Fused optimizer
kernels (``AdamW(fused=True)``) update parameters without bumping their version counters, so every
``Optimizer.step`` also bumps a process-wide step counter through an optimizer post-hook.  The
fingerprint covers all of this and costs one pass over the parameter list and one over the tuner
layers per step.

Not detectable cheaply: writes through ``param.data`` (a ``.data`` alias has its own version
counter).  After such writes call ``LLM.notify_weights_updated()``.
"""

from __future__ import annotations

import functools
import operator

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

_VERSION = operator.attrgetter("_version")
_optimizer_steps = 0
_hook_handle = None


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


def _install_optimizer_hook() -> None:
    """Registers the step counter once per process (it only increments an integer)."""
    global _hook_handle
    if _hook_handle is None:
        _hook_handle = register_optimizer_step_post_hook(_count_optimizer_step)


class WeightWatcher:
    """Computes a cheap fingerprint of the model's weights and adapter state."""

    def __init__(self, model: torch.nn.Module) -> None:
        _install_optimizer_hook()
        self.model = model
        self._forced = 0
        self._params = _local_tensors(model)
        self._versioned = _versioned(self._params)
        self._adapter_modules = _adapter_layers(model)
        self._last = self.fingerprint()
        self.version = 0

    def fingerprint(self) -> tuple:
        """Sum of version counters, storage pointers and adapter flags."""
        # map and reduce rather than Python loops: this runs before every step, over every tensor.
        versions = sum(map(_VERSION, self._versioned))
        pointers = functools.reduce(operator.xor, map(torch.Tensor.data_ptr, self._params), 0)
        adapters = tuple(map(_adapter_state, self._adapter_modules))
        return versions, pointers, len(self._params), adapters, _optimizer_steps, self._forced

    def force_change(self) -> None:
        """Makes the next :meth:`changed` report a change (for updates no fingerprint can see)."""
        self._forced += 1

    def refresh_modules(self) -> None:
        """Re-reads the parameter list (after adapters are added or removed)."""
        self._params = _local_tensors(self.model)
        self._versioned = _versioned(self._params)
        self._adapter_modules = _adapter_layers(self.model)

    def changed(self) -> bool:
        """True (once) when the weights differ from the last check; bumps ``version``."""
        current = self.fingerprint()
        if current == self._last:
            return False
        # Adapters may have been added since the last look: re-read the module set so their
        # parameters are watched from now on.
        self.refresh_modules()
        self._last = self.fingerprint()
        self.version += 1
        return True


def _adapter_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """PEFT tuner layers: they expose ``disable_adapters`` and ``active_adapters`` as plain values
    (transformers models have methods of the same names, which are skipped)."""
    layers = []
    for m in model.modules():
        flag = getattr(type(m), "disable_adapters", None)
        if isinstance(flag, property) and hasattr(m, "active_adapters"):
            layers.append(m)
    return layers


def _adapter_state(layer: torch.nn.Module) -> tuple:
    """What of a PEFT tuner layer's own state changes its forward: whether adapters are disabled,
    which are active, which are merged into the base weight, their scales, and whether inputs are cast
    to the adapter's dtype.

    It runs for every tuner layer on every step, so it reads the instance's ``__dict__`` (no property
    calls, no ``nn.Module.__getattr__`` fallback): PEFT's ``set_adapter``, ``enable_adapters``,
    ``merge``, ``set_scale`` and ``scale_layer`` all write instance attributes, and a class default
    never changes.  Lists and dicts are copied into tuples because PEFT mutates them in place.
    Left out: ``r`` and ``lora_alpha`` (they act through ``scaling``), ``lora_dropout`` (training
    only) and the adapter weights (watched as parameters)."""
    d = layer.__dict__
    active = d.get("_active_adapter")  # "a" at first, ["a"] after set_adapter("a"): the same state
    merged = d.get("merged_adapters")
    scaling = d.get("scaling")
    return (
        d.get("_disable_adapters"),
        (active,) if active is None or isinstance(active, str) else tuple(active),
        None if merged is None else tuple(merged),
        tuple(scaling.items()) if isinstance(scaling, dict) else None,
        d.get("cast_input_dtype_enabled"),
    )


def _versioned(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors that have a version counter.  Inference tensors have none: a model that caches
    a buffer in its forward (CTRL casts its position table on every call) makes one when that
    forward runs under inference mode.  They cannot be changed in place outside inference mode, and
    replacing one changes the storage pointer, which the fingerprint also covers."""
    return [t for t in tensors if not t.is_inference()]


def _persistent_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """Buffers that are part of the state dict.  Non-persistent ones are derived by the model and
    may be rewritten by its own forward (a longrope or dynamic rotary module swaps its frequency set
    with the sequence length): counting those as weight changes would restart every request each
    time a long sequence flips them, and the restarted short prefill flips them back."""
    seen: set[int] = set()
    out = []
    for module in model.modules():
        skip = module._non_persistent_buffers_set
        for name, buf in module._buffers.items():
            if buf is not None and name not in skip and id(buf) not in seen:
                seen.add(id(buf))
                out.append(buf)
    return out


def _local_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters and persistent buffers (what a user trains or loads); a tensor-parallel (DTensor)
    one as this rank's shard, whose version counter and storage are what in-place updates change."""
    out = []
    for t in [*model.parameters(), *_persistent_buffers(model)]:
        local = getattr(t, "_local_tensor", None)
        out.append(local if isinstance(local, torch.Tensor) else t)
    return out
