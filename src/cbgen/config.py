"""Engine configuration: budgets, cache geometry, device and fast-path knobs, validated up front."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    """Everything that shapes one engine instance.

    KV-cache size comes from exactly one budget, in this order of precedence: ``num_blocks``,
    ``kv_cache_memory`` (bytes), ``kv_cache_memory_fraction`` (of free device memory; on CPU of
    available RAM).  The chosen sizes are logged at start-up.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    kv_cache_memory_fraction: float = 0.3
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    max_logprobs: int = 20
    # Where and how LLM loads a model from a path; a model object is used as it is.
    device: str | None = None
    dtype: str = "auto"
    # Decode-only steps: "eager" (the packed batch as it is), "static" (padded to a batch bucket in
    # fixed buffers, the path CUDA captures; runs on CPU too), "graphs" (static, captured as CUDA
    # graphs; CUDA only) or "auto" (graphs on CUDA, eager on CPU; static on CPU with compile).
    decode_mode: str = "auto"
    compile: bool = False
    attention_backend: str = "auto"  # "auto" | "torch" | "cpu" | "triton" | "flash_attn"
    cuda_graph_max_batch: int | None = None  # default: max_num_seqs
    # CPU, C attention backend, eager decode: steps of Llama/Mistral/Qwen2/Qwen3 models run through the
    # fused C forward (cbgen.model.cpu_fast.fused_forward) instead of the transformers module tree,
    # where the execution plan finds the model qualifies (cbgen.model.plan); off = always the latter.
    fused_decode: bool = True
    # With fused_decode: projections run on the GEMM measured fastest on this machine per row class,
    # most of them on a packed copy of the weights (repacked when a weight changes); off = plain
    # F.linear on the user's weights.
    prepack_weights: bool = True
    # Overlap scheduling: step N+1 is scheduled, built and launched before step N's tokens are read
    # back (stop checks lag one step; tokens past a stop are dropped).  None: on for CUDA, off on CPU,
    # where torch runs synchronously and there is nothing to overlap.
    async_scheduling: bool | None = None
    # Seed of the private generator of unseeded requests.  None: 0, plus the data-parallel replica
    # under torch.distributed (the global rank of the tensor-parallel root), so replicas sample
    # differently while the ranks of one tensor-parallel group agree.
    seed: int | None = None
    # Trainer parity (cbgen.batch_invariant): every generated token's raw_logprobs equal, bit for bit,
    # cbgen.token_logprobs of the model's forward under ``cbgen.parity(model)``, whatever the batch,
    # chunking, prefix-cache state or scheduling.  Slower: module forward, tiled matmuls, blocked
    # attention (see docs/rl.md, "Trainer parity").
    batch_invariant: bool = False
    # Tensor parallelism: how long a rank waits for its group's root at each exchange before it
    # fails with an error (a rank died or the ranks diverged) instead of hanging.
    distributed_timeout: float = 600.0
    # At engine start, run two short sequences through the packed, paged forward and compare them
    # with the model's own forward; a model that differs is refused (cbgen.model.support.probe).
    # False skips that check (the config-based refusals stay).
    verify_model: bool = True

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"EngineConfig: {msg}")

        need(
            isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens!r}",
        )
        need(
            isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1,
            f"max_num_seqs must be >= 1, got {self.max_num_seqs!r}",
        )
        need(
            isinstance(self.block_size, int) and self.block_size >= 1,
            f"block_size must be >= 1, got {self.block_size!r}",
        )
        need(
            self.num_blocks is None or (isinstance(self.num_blocks, int) and self.num_blocks >= 1),
            f"num_blocks must be >= 1 or None, got {self.num_blocks!r}",
        )
        need(
            self.kv_cache_memory is None or self.kv_cache_memory > 0,
            f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory!r}",
        )
        need(
            0.0 < self.kv_cache_memory_fraction <= 1.0,
            f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction!r}",
        )
        need(self.max_logprobs >= 0, f"max_logprobs must be >= 0, got {self.max_logprobs!r}")
        need(
            self.decode_mode in ("auto", "eager", "static", "graphs"),
            f"decode_mode must be auto|eager|static|graphs, got {self.decode_mode!r}",
        )
        need(
            self.attention_backend in ("auto", "torch", "cpu", "triton", "flash_attn"),
            f"attention_backend must be auto|torch|cpu|triton|flash_attn, got {self.attention_backend!r}",
        )
