"""Rotary embeddings whose frequencies depend on the sequence's length, computed per token.

transformers' ``longrope`` and ``dynamic`` rotary modules pick their frequencies from the longest
position of the forward (``max(position_ids) + 1``, the "extent") and write them into the module's
``inv_freq`` buffer before computing cos/sin.  ``generate()`` runs one sequence per forward, so
each token of a sequence gets the frequencies of its sequence's extent when the token was computed:
a prompt token the prompt's length (the prompt is one forward), the token decoding computes at
position ``p`` the extent ``p + 1``.  For every token that is ``max(prompt_len, p + 1)``.

A packed step holds many sequences and prefill chunks in one forward, so the module would give all
of them the set of the longest one (and a chunked prompt the set of its chunk).  The engine instead
gives each token the set of its own extent (:class:`LengthRotary`), computed with the module's own
forward body on a view that carries that set, never through the module's length update: the buffer
and anyone else using the module, a trainer on another thread included, are left alone.

* ``longrope``: two sets, short up to ``original_max_position_embeddings`` and long past it.
* ``dynamic`` (NTK): the original set up to ``max_position_embeddings``, then one set per extent.
  transformers' module keeps the largest set it has grown to until a sequence shorter than the
  original length resets it, so ``generate()`` on a module that has already seen a longer sequence
  gives later prompts that larger set; the engine gives every token the set a freshly loaded model
  gives it, whatever ran before.

Phi-3 and its relatives (their ``prepare_inputs_for_generation`` checks
``original_max_position_embeddings``) go further: when a sequence first reaches
``original_max_position_embeddings + 1`` tokens, ``generate()`` drops its cache and recomputes the
whole sequence in one forward, so from then on every token of it carries the long set.  The engine
does the same (:meth:`LengthRotary.switch_for`, ``Request.rope_switch``): the request's K/V is
dropped and recomputed with every token's extent raised to the switch length.

K/V computed under one set must not serve a prompt whose tokens get another: :meth:`cache_key` is
the prefix-cache salt of a prompt of a given length (equal keys, equal sets for every token both
prompts share); a request that switched takes the salt of the length it switched at.
"""

from __future__ import annotations

import copy
import inspect
from collections import OrderedDict

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

__all__ = ["LengthRotary", "length_rotary"]

_LENGTH_TYPES = ("longrope", "dynamic")


class _WithFrequencies:
    """The rotary module as its forward body reads it, with ``inv_freq`` and ``attention_scaling``
    replaced: the module itself is never written."""

    def __init__(self, module: nn.Module, prefix: str, inv_freq: torch.Tensor, scaling: float) -> None:
        self._module = module
        self._over = {f"{prefix}inv_freq": inv_freq, "attention_scaling": scaling}
        if prefix:
            self._over[f"{prefix}attention_scaling"] = scaling

    def __getattr__(self, name: str):
        over = self.__dict__["_over"]
        return over[name] if name in over else getattr(self.__dict__["_module"], name)


class LengthRotary:
    """Per-token cos/sin of a length-dependent rotary module (see the module docstring).
    ``recomputes``: the model's ``generate()`` recomputes a sequence's cache at the switch."""

    def __init__(self, module: nn.Module, recomputes: bool = False) -> None:
        self.module = module
        self.recomputes = recomputes
        self.rope_type: str = module.rope_type
        self.config = module.config
        params = self.config.rope_parameters
        if self.rope_type == "longrope":
            self.threshold = int(params["original_max_position_embeddings"])
        else:
            self.threshold = int(module.original_max_seq_len)
        # The body under transformers' length-update decorator (and torch.no_grad's wrapper).
        self._body = inspect.unwrap(type(module).forward)
        self._sets: OrderedDict[int, tuple[torch.Tensor, float]] = OrderedDict()
        # The attention factor of the original set, as the module's init computed it (a dynamic
        # module overwrites its own attribute as it grows).
        self._base_scaling = float(ROPE_INIT_FUNCTIONS[self.rope_type](self.config, "cpu")[1])

    def cache_key(self, prompt_len: int) -> int:
        """The frequency set of a prompt of ``prompt_len`` tokens, as an int (0: the original set)."""
        return self.set_of(prompt_len)

    def switch_for(self, prompt_len: int) -> tuple[int, int] | None:
        """``(length, salt)``: where a request with a prompt of ``prompt_len`` tokens recomputes its
        cache and the salt it takes then; None where it never does."""
        if not self.recomputes or prompt_len > self.threshold:
            return None
        at = self.threshold + 1
        return at, self.cache_key(at)

    def set_of(self, extent: int) -> int:
        """Which frequency set a token of extent ``extent`` gets (0: the original one)."""
        if extent <= self.threshold:
            return 0
        return 1 if self.rope_type == "longrope" else extent

    def _frequencies(self, key: int, device: torch.device) -> tuple[torch.Tensor, float]:
        found = self._sets.get(key)
        if found is not None and found[0].device == device:
            self._sets.move_to_end(key)
            return found
        if key == 0:
            # What the module itself falls back to below the threshold.
            inv, scaling = self.module.original_inv_freq.to(device), self._base_scaling
        else:
            seq_len = self.threshold + 1 if self.rope_type == "longrope" else key
            inv, factor = ROPE_INIT_FUNCTIONS[self.rope_type](self.config, device, seq_len=seq_len)
            # The module copies its new set into its buffer, in the buffer's dtype.
            inv = inv.to(self.module.inv_freq.dtype)
            # longrope's attention factor is fixed at init; dynamic's comes with each set.
            scaling = self._base_scaling if self.rope_type == "longrope" else float(factor)
        self._sets[key] = (inv, scaling)
        if len(self._sets) > 64:  # dynamic NTK: one set per extent past the original length
            self._sets.popitem(last=False)
        return inv, scaling

    def cos_sin(
        self, x: torch.Tensor, positions: torch.Tensor, extents: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[1, T, D]`` (the module's output shape for ``position_ids [1, T]``) of tokens at
        ``positions [T]`` whose extents are ``extents [T]``, in ``x``'s dtype."""
        keys = [self.set_of(e) for e in extents.tolist()] if self.rope_type == "dynamic" else None
        if keys is None:
            long = extents > self.threshold
            groups = {0: ~long, 1: long}
        else:
            uniq = sorted(set(keys))
            key_t = torch.tensor(keys, device=positions.device)
            groups = {k: key_t == k for k in uniq}
        cos = sin = None
        for key, where in groups.items():
            if not bool(where.any()):
                continue
            inv, scaling = self._frequencies(key, x.device)
            view = _WithFrequencies(self.module, "", inv, scaling)
            c, s = self._body(view, x, positions[None])
            if cos is None:
                if bool(where.all()):
                    return c, s
                cos, sin = torch.empty_like(c), torch.empty_like(s)
            idx = where.nonzero().squeeze(1)
            cos[0, idx] = c[0, idx]
            sin[0, idx] = s[0, idx]
        return cos, sin

    def check(self, dtype: torch.dtype) -> str | None:
        """Compares :meth:`cos_sin` with what the module's own forward gives a whole sequence, at the
        lengths around the switch and past it (on a copy of the module: its forward rewrites its
        buffers, and a dynamic module its state); returns the first mismatch in words, or None."""
        clone = copy.deepcopy(self.module)
        device = self.module.original_inv_freq.device
        x = torch.zeros(1, dtype=dtype, device=device)
        for extent in sorted({1, self.threshold, self.threshold + 1, self.threshold + 9}):
            pos = torch.arange(extent, device=device)
            with torch.no_grad():
                want = clone(x, pos[None])
                got = self.cos_sin(x, pos, torch.full_like(pos, extent))
            if not all(torch.equal(g, w) for g, w in zip(got, want, strict=True)):
                return (
                    f"{type(self.module).__name__} ({self.rope_type}) gives a {extent}-token sequence "
                    "other cos/sin than cbgen's per-token tables"
                )
        return None


def length_rotary(model: nn.Module) -> LengthRotary | None:
    """The model's length-dependent rotary (:class:`LengthRotary`), or None when its rotary
    frequencies do not depend on the sequence length.  Raises ``NotImplementedError`` for such a
    rotary module cbgen cannot compute per token (one per layer type, or none it can find)."""
    found = []
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)
        if rope_type is None or not hasattr(module, "inv_freq"):
            continue
        types = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
        if any(isinstance(t, str) and (t == "longrope" or "dynamic" in t) for t in types):
            if isinstance(rope_type, dict) or rope_type not in _LENGTH_TYPES:
                raise NotImplementedError(
                    f"{type(module).__name__} uses the length-dependent rotary type {rope_type!r}, which "
                    "cbgen cannot compute per sequence"
                )
            found.append(module)
    if not found:
        return None
    if len(found) > 1:
        raise NotImplementedError(
            f"{len(found)} length-dependent rotary modules: cbgen computes one per model per sequence"
        )
    return LengthRotary(found[0], recomputes=_recomputes_at_switch(model))


def _recomputes_at_switch(model: nn.Module) -> bool:
    """Whether the model's ``generate()`` drops a sequence's cache when it passes the original
    length (Phi-3's ``prepare_inputs_for_generation``, which modular transformers copies into its
    relatives).  Read from the method's source: the behaviour has no flag of its own."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    prepare = getattr(type(base), "prepare_inputs_for_generation", None)
    try:
        source = inspect.getsource(prepare)
    except (OSError, TypeError):
        return False
    return "original_max_position_embeddings" in source
