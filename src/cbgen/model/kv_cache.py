"""The cache tensors of a model's cache layout, sized from an explicit memory budget.

Per layer of a ``kv`` group (:mod:`cbgen.model.cache_groups`), one key and one value tensor of
``num_blocks + 1`` blocks shaped by its group (the layer's KV heads, key and value head sizes, the
group's block size); every
``kv`` group has the same number of blocks (one pool each, :class:`cbgen.core.cache_pools.CachePools`).
Per layer of a ``state`` group, one tensor of ``num_slots + 1`` per-sequence states, keyed by the
state's name and the layer (``states[("recurrent0", 3)]``).  The extra block
or slot at the end is scratch space that no sequence owns (padding rows of fixed-shape steps).
"""

from __future__ import annotations

import logging

import torch

from cbgen.core.cache_pools import StateCopy
from cbgen.model.cache_groups import CacheGroup, CacheLayout
from cbgen.utils import advise_huge_pages

logger = logging.getLogger("cbgen")

CPU_DEFAULT_CAP = 2 << 30
# Blocks of a kv group without layers (they hold nothing; each is a Python object in the pool).
COUNTING_BLOCKS = 1 << 16


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache tensor, on transparent huge pages where the OS grants them: decode reads blocks
    scattered over the whole cache, and with 4 KiB pages nearly every block costs a TLB miss."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return advise_huge_pages(torch.empty(shape, dtype=dtype)).zero_()  # zero_ is the first touch


def available_memory(device: torch.device) -> int:
    """Free memory on the device in bytes (CUDA: driver's free; CPU: MemAvailable)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def choose_num_blocks(
    layout: CacheLayout,
    device: torch.device,
    num_blocks: int | None,
    kv_cache_memory: int | None,
    memory_fraction: float,
    max_useful_tokens: int,
    num_slots: int = 0,
) -> int:
    """Picks the block count (the same in every kv group) from exactly one budget: ``num_blocks``,
    else ``kv_cache_memory`` bytes, else a fraction of free memory.  Byte budgets are capped at what
    the engine could ever use (``max_useful_tokens``), so a tiny model does not reserve gigabytes;
    the states of ``num_slots`` sequences are taken from the budget first."""
    groups = layout.kv_groups
    per_block = sum(g.bytes_per_block() for g in groups)
    if num_blocks is not None:
        source = "num_blocks"
        chosen = num_blocks
    else:
        states = (num_slots + 1) * layout.bytes_per_slot()
        budget, source = _budget(device, kv_cache_memory, memory_fraction, reserved=states)
        budget -= states
        cap = max(-(-max_useful_tokens // g.block_size) for g in groups)
        # A model without attention layers (pure state-space) keeps no KV: its blocks only count
        # tokens (and carry prefix hashes), so a pool of COUNTING_BLOCKS is plenty.
        chosen = budget // per_block if per_block else min(cap, COUNTING_BLOCKS)
        if chosen > cap:
            chosen, source = cap, source + ", capped at max_num_seqs x max_model_len"
        if chosen < 1:
            raise ValueError(
                f"KV-cache budget of {budget} bytes is smaller than one block ({per_block} bytes)"
                + (
                    f" once the states of {num_slots + 1} sequences "
                    f"({layout.bytes_per_slot()} bytes each) are taken from it"
                    if num_slots
                    else ""
                )
            )
    first = groups[0]
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%s; %s)",
        chosen,
        first.block_size,
        chosen * first.block_size,
        chosen * per_block / 2**20,
        source,
        f"{layout.describe()}, {str(first.dtype).removeprefix('torch.')}",
    )
    return chosen


def _budget(
    device: torch.device, kv_cache_memory: int | None, memory_fraction: float, reserved: int | None = 0
) -> tuple[int, str]:
    """The cache's byte budget and where it came from.  On CPU a fraction of free memory is capped
    at :data:`CPU_DEFAULT_CAP` of KV blocks on top of ``reserved`` bytes of states (None: uncapped)."""
    if kv_cache_memory is not None:
        return int(kv_cache_memory), "kv_cache_memory"
    budget = int(available_memory(device) * memory_fraction)
    source = f"{memory_fraction:.0%} of free {device.type} memory"
    if reserved is not None and device.type == "cpu" and budget > CPU_DEFAULT_CAP + reserved:
        # CPU throughput saturates long before RAM does; zeroing gigabytes only costs start-up.
        budget = CPU_DEFAULT_CAP + reserved
        source += f", KV capped at {CPU_DEFAULT_CAP >> 30} GiB on CPU"
    return budget, source


# The share of a byte budget the state slots may take; the rest holds KV blocks.
STATE_SHARE = 0.5


def choose_num_slots(layout: CacheLayout, device: torch.device, config, per_sequence: int = 1) -> int:
    """State slots for a model with state layers: one per sequence up to ``max_num_seqs``, within
    :data:`STATE_SHARE` of the cache's byte budget (``kv_cache_memory``, else the fraction of free
    memory, before the CPU's KV cap, also when ``num_blocks`` sizes the blocks), and at least one.  ``per_sequence``: slots each sequence brings (2 with prefix
    caching: a checkpoint slot each, :mod:`cbgen.core.checkpoints`)."""
    per_slot = layout.bytes_per_slot()
    # Whatever sized the blocks (an explicit ``num_blocks`` too), states stay within the budget.
    budget, _ = _budget(device, config.kv_cache_memory, config.kv_cache_memory_fraction, reserved=None)
    slots = max(1, min(config.max_num_seqs, int(budget * STATE_SHARE) // (per_slot * per_sequence) - 1))
    logger.info(
        "state slots: %d sequences x %.2f MiB%s (%s)",
        slots,
        per_slot / 2**20,
        f", and {slots * (per_sequence - 1)} checkpoints of as much" if per_sequence > 1 else "",
        "; ".join(g.describe() for g in layout.state_groups),
    )
    return slots


class KVCache:
    """Owns the cache tensors of a layout.  ``release()`` drops every reference so the memory really
        returns to the allocator; ``allocate()`` creates them again.

        ``layers[i]``: layer ``i``'s ``(key, value)`` tensors (a KV-sharing reader's are its producer's;
        None for a layer that keeps no keys and values).  ``states[(name, i)]``: layer ``i``'s state
    ``name``, one row per slot.
    """

    def __init__(
        self, layout: CacheLayout, num_blocks: int, device: torch.device, num_slots: int = 0
    ) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.num_slots = num_slots
        self.device = device
        self.layers: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self.states: dict[tuple[str, int], torch.Tensor] = {}
        self.allocate()

    @property
    def block_size(self) -> int:
        """Block size of the first kv group (the only one of every model today)."""
        return self.layout.kv_groups[0].block_size

    @property
    def geometry(self) -> CacheGroup:
        """The first kv group: its KV heads, head sizes and layers."""
        return self.layout.kv_groups[0]

    @property
    def scratch_slot(self) -> int:
        """First slot of the scratch block of the first kv group, which no sequence ever owns."""
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        """Total bytes of the cache tensors."""
        per_block = sum(g.bytes_per_block() for g in self.layout.kv_groups)
        return (self.num_blocks + 1) * per_block + (self.num_slots + 1) * self.layout.bytes_per_slot()

    @property
    def allocated(self) -> bool:
        """Whether the tensors currently exist."""
        return bool(self.layers)

    def allocate(self) -> None:
        """Creates the tensors, zeroed: a gathered block can hold slots past a sequence's end, which the
        mask hides, but uninitialised NaNs would still poison the softmax."""
        if self.layers:
            return
        num_layers = 1 + max(
            max(layer for g in self.layout.groups for layer in g.layers),
            max((reader for reader, _ in self.layout.shared), default=0),
        )
        layers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
        with torch.inference_mode():
            for g in self.layout.kv_groups:
                for layer in g.layers:
                    heads, k_dim, v_dim = g.shape_of(layer)
                    k_shape = (self.num_blocks + 1, g.block_size, heads, k_dim)
                    v_shape = (*k_shape[:3], v_dim)
                    layers[layer] = (
                        _zeros(k_shape, g.dtype, self.device),
                        _zeros(v_shape, g.dtype, self.device),
                    )
            for g in self.layout.state_groups:
                for layer, shape in zip(g.layers, g.state_shapes):
                    self.states[(g.name, layer)] = _zeros((self.num_slots + 1, *shape), g.dtype, self.device)
        for reader, producer in self.layout.shared:
            layers[reader] = layers[producer]
        self.layers = layers

    def release(self) -> None:
        """Drops the tensors."""
        self.layers = []
        self.states = {}

    def copy_blocks(self, copies: list) -> None:
        """Performs block copies (``BlockCopy(src, dst, group)``: copy-on-fork for n > 1 samples,
        partial prefix hits) and state copies (``StateCopy``)."""
        if not copies:
            return
        groups = self.layout.kv_groups
        by_group: dict[int, list[tuple[int, int]]] = {}
        states: list[tuple[int, int]] = []
        for c in copies:
            if isinstance(c, StateCopy):
                states.append((c.src, c.dst))
            else:
                by_group.setdefault(c.group, []).append((c.src, c.dst))
        with torch.inference_mode():
            for group, pairs in by_group.items():
                src, dst = self._indices(pairs)
                for layer in groups[group].layers:
                    for t in self.layers[layer]:
                        t.index_copy_(0, dst, t.index_select(0, src))
            if states:
                src, dst = self._indices(states)
                for t in self.states.values():
                    t.index_copy_(0, dst, t.index_select(0, src))

    def _indices(self, pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        return src, dst
