"""The cache a model needs, as groups of layers: the execution plan's ``cache`` (its layout).

A group is a set of layers cached together:

* ``kv``: paged keys and values per token, with its own KV heads, key head size, value head size
  (they may differ: latent attention) and block size; one block pool each
  (:class:`cbgen.core.block_manager.BlockManager`), one block table per request.  The layers of one
  kv group may differ in KV heads and head sizes (``layer_shapes``: Gemma 4's 256-wide sliding and
  512-wide full layers, JetMoE's tiled heads): a block id addresses the same tokens in every layer's
  own key and value tensors, so such layers share one block table, one prefix-hash chain and
  partial-block prefix hits, and a block costs the sum of its layers' bytes.  Separate pools would
  pay only where block sizes differ, and an engine has one block size;
* ``state``: a fixed-size state per sequence and layer (a recurrent or convolution state), one slot
  per running sequence (:class:`cbgen.core.slots.SlotPool`).  Each state group is one *named*
  state (``conv0``, ``recurrent0``: what transformers' cache calls the conv and recurrent state
  ``state_idx``) in one dtype; a layer may hold several (a convolution and a recurrent state), and a
  layer of a kv group may hold states too (Falcon-H1's attention and Mamba2 in one layer).

Layers that read another layer's keys and values instead of writing their own belong to no group
and are listed in ``shared`` (reader, producer).

Attention-only models have one ``kv`` group over all their layers, with the shapes each layer's
attention receives (:mod:`cbgen.model.kv_shapes`; under tensor parallelism, what the config says).
Models with linear-attention, state-space or convolution layers have one ``kv`` group over
their attention layers (possibly none: a pure state-space model's kv group holds no layer, and its
blocks only count tokens) and one ``state`` group per named state
(:func:`cbgen.model.state_cache.state_layout`).  The scheduler, block pools, input builder and KV
cache take any number of groups (``tests/model/test_cache_groups.py``); the paged attention backends
attend one kv group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cbgen.topology import local_kv_heads

KINDS = ("kv", "state")


@dataclass(frozen=True)
class CacheGroup:
    """One group of layers with one cache shape (see the module docstring)."""

    kind: str
    layers: tuple[int, ...]
    dtype: torch.dtype
    num_kv_heads: int = 0
    k_head_dim: int = 0
    v_head_dim: int = 0
    block_size: int = 0
    state_shapes: tuple[tuple[int, ...], ...] = ()  # kind "state": one shape per layer
    name: str = ""  # kind "state": which state of its layers (``conv0``, ``recurrent0``)
    # kind "kv" whose layers differ: (KV heads, key head size, value head size) per layer, in the
    # order of ``layers``; empty when every layer has the group's own shape.
    layer_shapes: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"cache group kind must be one of {KINDS}, got {self.kind!r}")
        if not self.layers and self.kind == "state":
            raise ValueError("a state group needs at least one layer")
        if (
            self.kind == "kv"
            and min(self.num_kv_heads, self.k_head_dim, self.v_head_dim, self.block_size) < 1
        ):
            raise ValueError(f"a kv group needs heads, head sizes and a block size, got {self}")
        if self.kind == "state" and (len(self.state_shapes) != len(self.layers) or not self.name):
            raise ValueError("a state group needs a name and one state shape per layer")
        if self.layer_shapes and (
            len(self.layer_shapes) != len(self.layers) or min(min(s) for s in self.layer_shapes) < 1
        ):
            raise ValueError("a kv group's layer shapes need one (heads, K size, V size) per layer, all >= 1")

    def shape_of(self, layer: int) -> tuple[int, int, int]:
        """(KV heads, key head size, value head size) of one of the group's layers."""
        if self.layer_shapes:
            return self.layer_shapes[self.layers.index(layer)]
        return (self.num_kv_heads, self.k_head_dim, self.v_head_dim)

    @property
    def shapes(self) -> dict[tuple[int, int, int], tuple[int, ...]]:
        """Each distinct (KV heads, K size, V size) of the group and its layers."""
        found: dict[tuple[int, int, int], list[int]] = {}
        for layer in self.layers:
            found.setdefault(self.shape_of(layer), []).append(layer)
        return {shape: tuple(layers) for shape, layers in found.items()}

    @property
    def uniform_head_sizes(self) -> bool:
        """Whether every layer's keys and values have one head size (what kernels that take one
        size for both need)."""
        return all(k == v for _, k, v in self.shapes)

    @property
    def itemsize(self) -> int:
        """Bytes per cache element."""
        return torch.empty((), dtype=self.dtype).element_size()

    def bytes_per_block(self) -> int:
        """Bytes of K plus V for one block across the group's layers (kind ``kv``)."""
        per_token = sum(heads * (k + v) for heads, k, v in map(self.shape_of, self.layers))
        return self.block_size * per_token * self.itemsize

    def bytes_per_slot(self) -> int:
        """Bytes of one sequence's state across the group's layers (kind ``state``)."""
        return sum(math.prod(shape) for shape in self.state_shapes) * self.itemsize

    def describe(self) -> str:
        """One line for ``cbgen info``."""
        if not self.layers:
            return f"kv, no layer (blocks of {self.block_size} tokens count tokens only)"
        span = _span(self.layers)
        if self.kind == "state":
            dtype = str(self.dtype).removeprefix("torch.")
            return f"state {self.name} ({dtype}), {span}: {self.bytes_per_slot()} bytes a sequence"
        per_token = self.bytes_per_block() // self.block_size
        shapes = self.shapes
        heads = "; ".join(
            (f"{_span(layers)}: " if len(shapes) > 1 else "") + f"{h} KV heads x K {k} / V {v}"
            for (h, k, v), layers in shapes.items()
        )
        return f"kv, {span}: {heads}, blocks of {self.block_size} tokens, {per_token} bytes a token"


@dataclass(frozen=True)
class CacheLayout:
    """The groups of a model's cache, and the layers that read another layer's KV."""

    groups: tuple[CacheGroup, ...]
    shared: tuple[tuple[int, int], ...] = ()
    # State layers compute a prefill cut at a multiple of this exactly as in one piece (their
    # mixers' chunk size; 1 for sequential scans and convolutions): where prefill chunks may end.
    # 0: the model cannot continue a multi-token forward, so a prompt is prefilled in one piece.
    align: int = 1

    def __post_init__(self) -> None:
        if not any(g.kind == "kv" for g in self.groups):
            raise ValueError("a cache layout needs a kv group")
        # A layer holds at most one kv entry and each named state once; a layer may hold both.
        seen: set[int] = set()
        for g in self.kv_groups:
            if seen & set(g.layers):
                raise ValueError(f"layers {sorted(seen & set(g.layers))} are in two kv groups")
            seen |= set(g.layers)
        names = [g.name for g in self.state_groups]
        if len(names) != len(set(names)):
            raise ValueError(f"two state groups share a name: {names}")
        for reader, producer in self.shared:
            if reader in seen or producer not in seen:
                raise ValueError(
                    f"shared layer {reader} -> {producer}: the reader owns a cache or the producer none"
                )

    @property
    def kv_groups(self) -> list[CacheGroup]:
        """The paged groups, in order (group ``i`` of the block pools is ``kv_groups[i]``)."""
        return [g for g in self.groups if g.kind == "kv"]

    @property
    def state_groups(self) -> list[CacheGroup]:
        """The per-sequence state groups."""
        return [g for g in self.groups if g.kind == "state"]

    @property
    def state_layers(self) -> tuple[int, ...]:
        """The layers that hold a state, in order."""
        return tuple(sorted({layer for g in self.state_groups for layer in g.layers}))

    @property
    def single(self) -> CacheGroup | None:
        """The one kv group when that is the whole layout (every model today), else None."""
        return self.groups[0] if len(self.groups) == 1 and not self.shared else None

    def kv_group_of(self) -> dict[int, int]:
        """Layer -> index of its kv group (KV-sharing readers map to their producer's group)."""
        found = {layer: i for i, g in enumerate(self.kv_groups) for layer in g.layers}
        for reader, producer in self.shared:
            found[reader] = found[producer]
        return found

    def bytes_per_slot(self) -> int:
        """Bytes of one sequence's state across every state group."""
        return sum(g.bytes_per_slot() for g in self.state_groups)

    def describe(self) -> str:
        """The groups in one line each (``cbgen info``)."""
        lines = [g.describe() for g in self.groups]
        readers: dict[int, list[int]] = {}
        for reader, producer in self.shared:
            readers.setdefault(producer, []).append(reader)
        lines += [
            f"{_span(tuple(rs))} read{'s' if len(rs) == 1 else ''} layer {p}'s KV"
            for p, rs in readers.items()
        ]
        if self.state_groups and self.align > 1:
            lines.append(f"prefill chunks end at multiples of {self.align} tokens")
        elif self.state_groups and self.align == 0:
            lines.append("each prompt prefilled in one piece (its state layers cannot continue one)")
        return "; ".join(lines)

    @classmethod
    def from_model(cls, model: torch.nn.Module, dtype: torch.dtype, block_size: int) -> CacheLayout:
        """One kv group over every layer, heads and head size from the (text) config (KV heads: this
        rank's share under tensor parallelism).  The layout where :mod:`cbgen.model.kv_shapes`
        cannot watch a forward (a tensor-parallel model, whose forward needs every rank)."""
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        # A tensor-parallel rank's attention sees only its share of the heads: cache that share.
        num_kv_heads = local_kv_heads(model, num_heads, num_kv_heads, head_dim)
        layers = tuple(range(config.num_hidden_layers))
        return cls((CacheGroup("kv", layers, dtype, num_kv_heads, head_dim, head_dim, block_size),))


def _span(layers: tuple[int, ...]) -> str:
    if len(layers) == 1:
        return f"layer {layers[0]}"
    if layers == tuple(range(layers[0], layers[-1] + 1)):
        return f"layers {layers[0]}-{layers[-1]}"
    shown = ", ".join(map(str, layers[:8])) + (", ..." if len(layers) > 8 else "")
    return f"{len(layers)} layers ({shown})"
