"""Paged KV tensors, one key and one value tensor per layer, sized from an explicit memory budget."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from cbgen.topology import local_kv_heads
from cbgen.utils import advise_huge_pages

logger = logging.getLogger("cbgen")

CPU_DEFAULT_CAP = 2 << 30


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache tensor, on transparent huge pages where the OS grants them: decode reads blocks
    scattered over the whole cache, and with 4 KiB pages nearly every block costs a TLB miss."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return advise_huge_pages(torch.empty(shape, dtype=dtype)).zero_()  # zero_ is the first touch


@dataclass(frozen=True)
class KVGeometry:
    """Shape of the cache that a model needs."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def from_model(cls, model: torch.nn.Module, dtype: torch.dtype) -> KVGeometry:
        """Reads layers, KV heads and head size from the model's (text) config (KV heads: this
        rank's share under tensor parallelism)."""
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        # A tensor-parallel rank's attention sees only its share of the heads: cache that share.
        num_kv_heads = local_kv_heads(model, num_heads, num_kv_heads, head_dim)
        return cls(config.num_hidden_layers, num_kv_heads, head_dim, dtype)

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes of K plus V for one block across all layers."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * itemsize


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
    geometry: KVGeometry,
    block_size: int,
    device: torch.device,
    num_blocks: int | None,
    kv_cache_memory: int | None,
    memory_fraction: float,
    max_useful_tokens: int,
) -> int:
    """Picks the block count from exactly one budget: ``num_blocks``, else ``kv_cache_memory`` bytes,
    else a fraction of free memory.  Byte budgets are capped at what the engine could ever use
    (``max_useful_tokens``), so a tiny model does not reserve gigabytes."""
    per_block = geometry.bytes_per_block(block_size)
    if num_blocks is not None:
        source = "num_blocks"
        chosen = num_blocks
    else:
        if kv_cache_memory is not None:
            budget, source = int(kv_cache_memory), "kv_cache_memory"
        else:
            budget = int(available_memory(device) * memory_fraction)
            source = f"{memory_fraction:.0%} of free {device.type} memory"
            if device.type == "cpu" and budget > CPU_DEFAULT_CAP:
                # CPU throughput saturates long before RAM does; zeroing gigabytes only costs start-up.
                budget, source = CPU_DEFAULT_CAP, source + f", capped at {CPU_DEFAULT_CAP >> 30} GiB on CPU"
        chosen = budget // per_block
        cap = -(-max_useful_tokens // block_size)
        if chosen > cap:
            chosen, source = cap, source + ", capped at max_num_seqs x max_model_len"
        if chosen < 1:
            raise ValueError(
                f"KV-cache budget of {budget} bytes is smaller than one block ({per_block} bytes)"
            )
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%s; %d layers, %d KV heads, head_dim %d, %s)",
        chosen,
        block_size,
        chosen * block_size,
        chosen * per_block / 2**20,
        source,
        geometry.num_layers,
        geometry.num_kv_heads,
        geometry.head_dim,
        geometry.dtype,
    )
    return chosen


class KVCache:
    """Owns the per-layer cache tensors.  ``release()`` drops every reference so the memory really
    returns to the allocator; ``allocate()`` creates them again."""

    def __init__(self, geometry: KVGeometry, num_blocks: int, block_size: int, device: torch.device) -> None:
        self.geometry = geometry
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.allocate()

    @property
    def scratch_slot(self) -> int:
        """First slot of the scratch block, which no sequence ever owns."""
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        """Total bytes of the cache tensors."""
        return (self.num_blocks + 1) * self.geometry.bytes_per_block(self.block_size)

    @property
    def allocated(self) -> bool:
        """Whether the tensors currently exist."""
        return bool(self.layers)

    def allocate(self) -> None:
        """Creates the tensors, zeroed: a gathered block can hold slots past a sequence's end, which the
        mask hides, but uninitialised NaNs would still poison the softmax."""
        if self.layers:
            return
        g = self.geometry
        # One extra block at the end is scratch space for padding rows of fixed-shape decode steps.
        shape = (self.num_blocks + 1, self.block_size, g.num_kv_heads, g.head_dim)
        with torch.inference_mode():
            self.layers = [
                (_zeros(shape, g.dtype, self.device), _zeros(shape, g.dtype, self.device))
                for _ in range(g.num_layers)
            ]

    def release(self) -> None:
        """Drops the tensors."""
        self.layers = []

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copies whole blocks ``src -> dst`` in every layer (copy-on-fork for n > 1 samples, partial
        prefix hits)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        with torch.inference_mode():
            for k, v in self.layers:
                k.index_copy_(0, dst, k.index_select(0, src))
                v.index_copy_(0, dst, v.index_select(0, src))
