"""``cbgen.parity(model)``: the trainer-side context under which ``model``'s forward computes exactly
what the engine computes in parity mode (``LLM(..., batch_invariant=True)``).

While the context is entered, on the thread that entered it and on no other
(:mod:`cbgen.model.thread_view`; an engine or a trainer using the same module on another thread at
that moment is unaffected):

* the model's attention implementation is cbgen's parity attention
  (:mod:`cbgen.batch_invariant.trainer_attention`): transformers then builds each forward's mask
  with cbgen's parity mask function, which refuses masks the parity attention cannot reproduce and
  hands it each token's position in its own row;
* :class:`cbgen.batch_invariant.dispatch.ParityOps` is active, so matrix products and transcendental
  functions are batch-invariant;
* a forward pre-hook on ``model`` (present while any thread is inside a parity context of it, acting
  only on those threads) reads each call's attention mask, passed by keyword or by position, and
  when the call gives no ``position_ids`` sets them from it (left-padded rows then get positions 0,
  1, ... from their first real token, as the engine gives them);
* checkpointed layers (transformers' gradient checkpointing, torch's ``CheckpointWrapper``) run the
  function they checkpoint through a replay wrapper, so that when a backward pass recomputes them,
  inside the context or after it, they recompute the parity forward that made the loss.

The model's code, parameters, config values, training mode and global torch state are not touched;
backward passes run inside or outside the context with the same gradients.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from cbgen.batch_invariant import trainer_attention
from cbgen.batch_invariant.dispatch import ParityOps, in_backward
from cbgen.batch_invariant.trainer_attention import RowPositions
from cbgen.model import thread_view
from cbgen.model.attention import attention_configs

_TLS = threading.local()  # .models: {id(model): depth} of the parity contexts open on this thread
_LOCK = threading.Lock()
# Per model (by id): [hook handle, contexts open on any thread].
_hooks: dict[int, list] = {}
# Attributes through which modules run their checkpoint function, with the callable to checkpoint
# as its first argument: transformers' layers, torch's CheckpointWrapper.
_CHECKPOINT_ATTRS = ("_gradient_checkpointing_func", "checkpoint_fn")


def _open() -> dict[int, int]:
    models = getattr(_TLS, "models", None)
    if models is None:
        models = _TLS.models = {}
    return models


def active_on_this_thread() -> bool:
    """Whether a parity context is open on the calling thread (for any model)."""
    return bool(getattr(_TLS, "models", None))


def _active(model_id: int) -> bool:
    models = getattr(_TLS, "models", None)
    return bool(models) and model_id in models


@functools.cache
def _signature(forward: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(forward)
    except (TypeError, ValueError):
        return None


def _call_arguments(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by name: its keywords, and its positional ones where the forward's
    signature names them (a ``forward(*args, **kwargs)`` wrapper names none)."""
    if not args:
        return kwargs
    sig = _signature(type(module).forward)
    if sig is None:
        return kwargs
    try:
        bound = sig.bind_partial(module, *args).arguments
    except TypeError:
        return kwargs
    named = {
        name: value
        for name, value in bound.items()
        if sig.parameters[name].kind
        in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    }
    return {**named, **kwargs}


def _add_positions(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
    """Forward pre-hook: on a thread inside a parity context of this model, the row positions from
    the call's mask (see the module docstring); elsewhere it changes nothing."""
    if not _active(id(module)):
        return args, kwargs
    named = _call_arguments(module, args, kwargs)
    mask = named.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return args, kwargs
    layout = RowPositions.from_mask(mask)
    kwargs = dict(kwargs, cbgen_parity=layout)
    if named.get("position_ids") is None:
        kwargs["position_ids"] = layout.positions.clamp(min=0)
    return args, kwargs


# It acts on parity threads only, so an engine step's forward is the same with it registered: the
# structure watch and the fused path's qualification do not count it (cpu_fast.qualify).
_add_positions.cbgen_inert = True  # type: ignore[attr-defined]


@contextlib.contextmanager
def _positions_hook(model: torch.nn.Module) -> Iterator[None]:
    """One pre-hook per model while any thread has a parity context of it open."""
    key = id(model)
    with _LOCK:
        entry = _hooks.get(key)
        if entry is None:
            handle = model.register_forward_pre_hook(_add_positions, with_kwargs=True)
            entry = _hooks[key] = [handle, 0]
        entry[1] += 1
    try:
        yield
    finally:
        with _LOCK:
            entry[1] -= 1
            if entry[1] == 0:
                del _hooks[key]
                entry[0].remove()


@contextlib.contextmanager
def _parity_state(model: torch.nn.Module, configs: list, replay: bool = False) -> Iterator[None]:
    """This thread's parity state for ``model``: attention, dispatch mode, the open-context mark.
    ``replay``: for a recomputation inside a backward pass, whose products the mode must tile like
    the forward's (it lets a backward's own ops through untouched)."""
    name = trainer_attention.register()
    models = _open()
    key = id(model)
    with thread_view.attention(configs, name), ParityOps(replay=replay):
        models[key] = models.get(key, 0) + 1
        try:
            yield
        finally:
            models[key] -= 1
            if not models[key]:
                del models[key]


class _Replay:
    """What a checkpointed layer runs in place of the function it checkpoints, when that call was
    made inside a parity context: the first time (the forward) it runs as it is; a second time (the
    backward's recomputation) it runs inside the parity state again, so the recomputed activations
    are the forward's to the bit, inside the context or after it."""

    def __init__(self, fn: Callable, model: torch.nn.Module, configs: list) -> None:
        self.fn, self.model, self.configs = fn, model, configs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _active(id(self.model)) and not in_backward():
            return self.fn(*args, **kwargs)
        with _parity_state(self.model, self.configs, replay=True):
            return self.fn(*args, **kwargs)


class _CheckpointSwitch:
    """Stands in for a module's checkpoint function while parity contexts of its model are open:
    calls from a thread inside one checkpoint a :class:`_Replay`; other calls pass unchanged."""

    def __init__(self, inner: Callable, model: torch.nn.Module, configs: list) -> None:
        self.inner, self.model, self.configs = inner, model, configs
        self.users = 0

    def __call__(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        if _active(id(self.model)):
            fn = _Replay(fn, self.model, self.configs)
        return self.inner(fn, *args, **kwargs)


@contextlib.contextmanager
def _checkpoint_replay(model: torch.nn.Module, configs: list) -> Iterator[None]:
    """Installs a :class:`_CheckpointSwitch` on every checkpointing module of ``model`` (shared by
    the contexts open on all threads) and takes it out when the last one closes, unless the user
    replaced it meanwhile."""
    switches = []
    with _LOCK:
        for module in model.modules():
            for attr in _CHECKPOINT_ATTRS:
                current = module.__dict__.get(attr)
                if current is None or not callable(current):
                    continue
                if not isinstance(current, _CheckpointSwitch):
                    current = _CheckpointSwitch(current, model, configs)
                    module.__dict__[attr] = current
                current.users += 1
                switches.append((module, attr, current))
    try:
        yield
    finally:
        with _LOCK:
            for module, attr, switch in switches:
                switch.users -= 1
                if switch.users == 0 and module.__dict__.get(attr) is switch:
                    module.__dict__[attr] = switch.inner


@contextlib.contextmanager
def parity(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Runs ``model``'s forwards on this thread in parity mode (and the backwards of those forwards,
    inside the context or after it); yields ``model``.

    ``with cbgen.parity(model): logits = model(input_ids, attention_mask=mask).logits``, then
    :func:`cbgen.batch_invariant.logprobs.token_logprobs` gives, for every token an engine with
    ``batch_invariant=True`` generated from the same weights, exactly its ``raw_logprobs``."""
    configs = attention_configs(model)
    with _checkpoint_replay(model, configs), _positions_hook(model), _parity_state(model, configs):
        yield model
