"""What an engine reads off the model before it builds anything: device and dtype, vocabulary,
the longest sequence it serves, the rotary that switches with the length, the end-of-sequence ids.

One place decides ``max_model_len``: the configured value, else the model's
``max_position_embeddings``; capped at a chunked-attention model's chunk (the paged kernels attend the
whole context) and, in parity mode, at the length where the rotary frequencies switch (the trainer's
padded forward and the engine's per-token one agree only below it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from cbgen.config import EngineConfig
from cbgen.model import support
from cbgen.model.rotary import LengthRotary, length_rotary

logger = logging.getLogger("cbgen")


@dataclass(frozen=True)
class ModelFacts:
    """The model's facts an engine is built from (see the module docstring)."""

    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    max_model_len: int
    length_rotary: LengthRotary | None
    eos_token_ids: frozenset[int]

    @classmethod
    def read(cls, model: torch.nn.Module, config: EngineConfig, tokenizer=None) -> ModelFacts:
        """Reads them; raises :class:`~cbgen.model.support.UnsupportedModelError` or ``ValueError``
        where the settings cannot work with this model."""
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        max_model_len = int(config.max_model_len or getattr(text, "max_position_embeddings", None) or 1 << 20)
        limit = support.length_limit(model)
        if limit is not None and max_model_len > limit:
            if config.max_model_len:
                raise support.UnsupportedModelError(
                    f"max_model_len={config.max_model_len} exceeds {limit}, the attention chunk of "
                    f"{type(model).__name__}'s chunked-attention layers: the paged kernels attend the "
                    "whole context, which equals chunked attention only within one chunk"
                )
            logger.info("cbgen: max_model_len capped at %d, the model's attention chunk", limit)
            max_model_len = limit
        try:
            rotary = length_rotary(model)
        except NotImplementedError as exc:
            raise support.UnsupportedModelError(str(exc)) from exc
        if config.batch_invariant and rotary is not None:
            max_model_len = _cap_for_parity(model, config, max_model_len, rotary.threshold)
        return cls(
            device=next(model.parameters()).device,
            dtype=next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32),
            vocab_size=int(text.vocab_size),
            max_model_len=max_model_len,
            length_rotary=rotary,
            eos_token_ids=frozenset(_eos_ids(model, tokenizer)),
        )


def _cap_for_parity(model: torch.nn.Module, config: EngineConfig, max_model_len: int, threshold: int) -> int:
    """Parity mode on a model whose rotary frequencies switch with the sequence length: the
    trainer's forward over a whole padded batch picks one set from the batch's longest row, the
    engine one per token, so the two agree only while no sequence passes the switch."""
    if max_model_len <= threshold:
        return max_model_len
    if config.max_model_len:
        raise ValueError(
            f"batch_invariant=True with max_model_len={config.max_model_len}: "
            f"{type(model).__name__}'s rotary frequencies switch past {threshold} tokens, where "
            "the trainer's forward and the engine's can no longer agree bit for bit; use "
            f"max_model_len <= {threshold}"
        )
    logger.info(
        "cbgen: max_model_len capped at %d for parity mode: the rotary frequencies switch past it", threshold
    )
    return threshold


def _eos_ids(model: torch.nn.Module, tokenizer) -> set[int]:
    """The generation config's end-of-sequence ids, else the model config's, else the tokenizer's."""
    ids: set[int] = set()
    gen_config = getattr(model, "generation_config", None)
    eos = getattr(gen_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if isinstance(eos, int):
        ids.add(eos)
    elif eos is not None:
        ids.update(int(e) for e in eos)
    return ids
