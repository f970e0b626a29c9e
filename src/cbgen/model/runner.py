"""Runs the user's model on a packed batch and returns logits only for the rows that need them.

The model is used as it is: no copy, no weight conversion.  For the duration of one forward the
runner switches the attention implementation to cbgen's paged function and puts modules in eval
mode; both are restored in ``finally`` blocks, so the module the trainer sees never changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from cbgen.model import attention
from cbgen.model.input_batch import ModelInput
from cbgen.model.kv_cache import KVCache


def _attention_configs(model: torch.nn.Module) -> list:
    """Every config object an attention module reads its implementation from."""
    configs: dict[int, object] = {}
    root = getattr(model, "config", None)
    if root is not None:
        configs[id(root)] = root
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation_internal"):
            configs[id(cfg)] = cfg
    return list(configs.values())


class ModelRunner:
    """Executes forwards for the engine; owns the KV cache."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.attn_name = attention.register()
        self._configs = _attention_configs(model)
        self._check_layers()

    def _check_layers(self) -> None:
        indices = {
            m.layer_idx for m in self.model.modules() if hasattr(m, "layer_idx") and hasattr(m, "config")
        }
        if not indices:
            raise ValueError(
                "cbgen needs a transformers model whose attention modules carry `layer_idx`; "
                f"{type(self.model).__name__} has none"
            )

    @contextlib.contextmanager
    def _paged_mode(self) -> Iterator[None]:
        """Swaps in paged attention and eval mode for one forward, then restores both exactly."""
        saved_impl = [(cfg, cfg._attn_implementation_internal) for cfg in self._configs]
        saved_training = None
        if self.model.training or any(m.training for m in self.model.modules()):
            saved_training = [(m, m.training) for m in self.model.modules()]
            self.model.eval()
        try:
            for cfg, _ in saved_impl:
                cfg._attn_implementation_internal = self.attn_name
            yield
        finally:
            for cfg, impl in saved_impl:
                cfg._attn_implementation_internal = impl
            if saved_training is not None:
                for module, flag in saved_training:
                    module.training = flag

    @torch.inference_mode()
    def execute(self, batch: ModelInput) -> torch.Tensor:
        """Forward over the packed batch; returns logits ``[R, V]`` for ``batch.logits_indices``."""
        batch.meta.kv_caches = self.kv_cache.layers
        with self._paged_mode():
            out = self.model(
                input_ids=batch.input_ids[None],
                position_ids=batch.positions[None],
                use_cache=False,
                logits_to_keep=batch.logits_indices,
                cbgen_meta=batch.meta,
            )
        return out.logits[0]
