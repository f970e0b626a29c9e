"""Per-thread views of a model that other threads use at the same time.

A cbgen step on the module forward needs the model to run cbgen's paged attention, in eval mode,
with the engine's own rotary tables; a trainer's ``cbgen.parity`` forward needs parity attention.
Both happen while other threads may call the same module: an asynchronous RL loop runs the
trainer's forwards and backwards beside the engine's steps.  Writing those settings onto the shared
objects, even for the length of one forward, lets every other thread's forward see them, and two
interleaved save/restore pairs can leave them switched for good.

So each setting is made on a thread-local record, and the attribute that carries it reads that
record first:

* a config's ``_attn_implementation`` (:func:`attention`): a property on the config class that
  defines it (transformers' ``PreTrainedConfig``), which returns this thread's override for this
  config object, else what the config holds;
* a module's ``training`` (:func:`eval_mode`): a property on ``nn.Module``, which returns ``False``
  on a thread inside an eval view, else the module's own flag;
* a module's ``forward`` (:func:`forward`): an instance attribute that calls this thread's
  replacement for this module, else the forward the module had;
* a function a Python module's code calls by its global name (:func:`function`, the state mixers'
  arithmetic in transformers' modeling files): a global that calls this thread's replacement, else
  the function.

The properties and attributes are installed while at least one view (or a :class:`Hold`) needs
them anywhere in the process and removed when the last one ends; with no override for the calling
thread they give exactly what the plain attribute gives, so every other thread sees the model as it
is.  ``type()`` of the user's objects never changes.  A thread-local rather than a context variable:
``torch.compile`` traces a ``threading.local`` read (with a guard), not a ``ContextVar.get``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

from torch import nn

_TLS = threading.local()
_LOCK = threading.Lock()
_MISSING = object()


class _Patch:
    """One class attribute replaced while ``users`` > 0 (what it was is put back after)."""

    def __init__(self, owner: type | ModuleType, name: str, make: Callable[[Any], Any]) -> None:
        self.owner, self.name = owner, name
        self.original = owner.__dict__.get(name, _MISSING)
        self.users = 0
        setattr(owner, name, make(self.original))

    def remove(self) -> None:
        if self.original is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.original)


_patches: dict[tuple[type | ModuleType, str], _Patch] = {}


def _acquire(
    owner: type | ModuleType, name: str, make: Callable[[Any], Any]
) -> tuple[type | ModuleType, str]:
    key = (owner, name)
    with _LOCK:
        patch = _patches.get(key)
        if patch is None:
            patch = _patches[key] = _Patch(owner, name, make)
        patch.users += 1
    return key


def _release(key: tuple[type | ModuleType, str]) -> None:
    with _LOCK:
        patch = _patches[key]
        patch.users -= 1
        if patch.users == 0:
            del _patches[key]
            patch.remove()


# ---------------------------------------------------------------- attention implementation
def _attn_owner(config: object) -> type:
    for klass in type(config).__mro__:
        if isinstance(klass.__dict__.get("_attn_implementation"), property):
            return klass
    raise TypeError(f"{type(config).__name__} has no _attn_implementation property")


def _attn_property(original: property) -> property:
    base_get = original.fget

    def get(self):
        over = getattr(_TLS, "attn", None)
        if over:
            name = over.get(id(self))
            if name is not None:
                return name
        return base_get(self)

    return property(get, original.fset, original.fdel, original.__doc__)


@contextlib.contextmanager
def attention(configs: Sequence[object], name: str) -> Iterator[None]:
    """For the calling thread only: every config in ``configs`` reports ``name`` as its
    ``_attn_implementation`` (so transformers' attention modules and mask builders pick cbgen's
    function), until the block ends.  Nests; other threads keep seeing each config's own value."""
    keys = [
        _acquire(owner, "_attn_implementation", _attn_property) for owner in {_attn_owner(c) for c in configs}
    ]
    over = getattr(_TLS, "attn", None)
    if over is None:
        over = _TLS.attn = {}
    saved = {id(c): over.get(id(c)) for c in configs}
    try:
        for c in configs:
            over[id(c)] = name
        yield
    finally:
        for ident, previous in saved.items():
            if previous is None:
                over.pop(ident, None)
            else:
                over[ident] = previous
        for key in keys:
            _release(key)


# ---------------------------------------------------------------- train/eval mode
def _training_property(_original: object) -> property:
    def get(self):
        if getattr(_TLS, "eval_depth", 0):
            return False
        return self.__dict__.get("training", True)

    def set_(self, value):
        self.__dict__["training"] = value

    return property(get, set_, doc="train/eval flag (cbgen: False on a thread inside an eval view)")


@contextlib.contextmanager
def eval_mode() -> Iterator[None]:
    """For the calling thread only: every module reads ``training`` as ``False`` (what
    ``model.eval()`` would give) until the block ends; other threads see each module's own flag."""
    key = _acquire(nn.Module, "training", _training_property)
    _TLS.eval_depth = getattr(_TLS, "eval_depth", 0) + 1
    try:
        yield
    finally:
        _TLS.eval_depth -= 1
        _release(key)


# ---------------------------------------------------------------- forward replacement
class _Dispatch:
    """The ``forward`` instance attribute while some thread replaces ``module``'s forward."""

    def __init__(self, module: nn.Module) -> None:
        self.module_id = id(module)
        self.previous = module.__dict__.get("forward")  # e.g. accelerate's hooked forward
        self.default = self.previous if self.previous is not None else type(module).forward.__get__(module)
        self.users = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        over = getattr(_TLS, "forwards", None)
        fn = over.get(self.module_id) if over else None
        return (fn or self.default)(*args, **kwargs)


@contextlib.contextmanager
def forward(module: nn.Module, fn: Callable[..., Any]) -> Iterator[None]:
    """For the calling thread only: calls of ``module`` run ``fn(*args, **kwargs)`` instead of its
    forward (its hooks still run) until the block ends; other threads run the module's own."""
    with _LOCK:
        dispatch = module.__dict__.get("forward")
        if not isinstance(dispatch, _Dispatch):
            dispatch = _Dispatch(module)
            object.__setattr__(module, "forward", dispatch)
        dispatch.users += 1
    over = getattr(_TLS, "forwards", None)
    if over is None:
        over = _TLS.forwards = {}
    previous = over.get(id(module))
    over[id(module)] = fn
    try:
        yield
    finally:
        if previous is None:
            over.pop(id(module), None)
        else:
            over[id(module)] = previous
        with _LOCK:
            dispatch.users -= 1
            if dispatch.users == 0 and module.__dict__.get("forward") is dispatch:
                if dispatch.previous is None:
                    del module.__dict__["forward"]
                else:
                    module.__dict__["forward"] = dispatch.previous


# ---------------------------------------------------------------- module-level functions
def _function_dispatch(module: ModuleType, name: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        def dispatch(*args: Any, **kwargs: Any) -> Any:
            over = getattr(_TLS, "functions", None)
            fn = over.get((id(module), name)) if over else None
            if fn is None:
                return original(*args, **kwargs)
            return fn(original, *args, **kwargs)

        dispatch.__wrapped__ = original
        return dispatch

    return make


@contextlib.contextmanager
def function(module: ModuleType, name: str, fn: Callable[..., Any]) -> Iterator[None]:
    """For the calling thread only: code of ``module`` that calls its global function ``name`` runs
    ``fn(original, *args, **kwargs)`` instead (``original``: the function itself, to fall back on)
    until the block ends; other threads call the function."""
    if not callable(module.__dict__.get(name)):
        raise AttributeError(f"{module.__name__} has no function {name!r}")
    key = _acquire(module, name, _function_dispatch(module, name))
    over = getattr(_TLS, "functions", None)
    if over is None:
        over = _TLS.functions = {}
    slot = (id(module), name)
    previous = over.get(slot)
    over[slot] = fn
    try:
        yield
    finally:
        if previous is None:
            over.pop(slot, None)
        else:
            over[slot] = previous
        _release(key)


class Hold:
    """Keeps the class-level properties installed between views, so that an engine stepping many
    times a second does not install and remove them around every step (each change of a class's
    attributes invalidates caches and compiled-code guards).  :meth:`release` ends it (idempotent)."""

    def __init__(self) -> None:
        self._keys: dict[str, tuple[type, str]] = {}

    def attention(self, configs: Sequence[object]) -> None:
        """Holds the ``_attn_implementation`` property of ``configs``' classes."""
        for owner in {_attn_owner(c) for c in configs}:
            tag = f"attn:{owner.__qualname__}:{id(owner)}"
            if tag not in self._keys:
                self._keys[tag] = _acquire(owner, "_attn_implementation", _attn_property)

    def function(self, module: ModuleType, name: str) -> None:
        """Holds the per-thread dispatch of ``module``'s global function ``name`` (:func:`function`)."""
        tag = f"function:{module.__name__}.{name}"
        if tag not in self._keys:
            self._keys[tag] = _acquire(module, name, _function_dispatch(module, name))

    def training(self) -> None:
        """Holds ``nn.Module``'s ``training`` property."""
        if "training" not in self._keys:
            self._keys["training"] = _acquire(nn.Module, "training", _training_property)

    def release(self) -> None:
        """Lets the held properties go (they are removed once no view uses them either)."""
        keys, self._keys = self._keys, {}
        for key in keys.values():
            _release(key)


def installed() -> list[str]:
    """The class attributes currently replaced (``Class.name``), for tests and ``cbgen info``."""
    with _LOCK:
        return sorted(f"{owner.__name__}.{name}" for owner, name in _patches)
