"""The keys and values each attention layer hands to attention, read from one short forward.

A config says one head size and one KV-head count for the whole model, and for several families
that is not what attention receives:

* latent attention (DeepSeek V2/V3, GLM-4.7-Flash, MiniCPM3, Kimi-Linear): keys of
  ``qk_nope + qk_rope`` and values of ``v_head_dim`` per head, expanded from a compressed latent,
  while ``config.head_dim`` is the rope dimension;
* Gemma 4: 256-wide sliding and 512-wide full layers, with their own KV-head counts
  (``per_layer_config``), and its last layers reuse an earlier layer's keys and values;
* JetMoE: keys and values tiled ``top_k`` times before the attention call.

So cbgen asks the model: :func:`attention_shapes` runs four tokens through it with a recording
attention function (this thread only, :func:`cbgen.model.thread_view.attention`) and notes, per
layer, the KV heads and head sizes of the keys and values attention receives, and which layers are
handed another layer's very tensors (a KV-sharing reader, which then reads its producer's pages and
writes none).  The paged cache stores exactly those tensors, so the arithmetic after the cache is
the one the model's attention call does.  For latent attention that is the expanded keys and values
(``docs/design.md`` says why that layout and what it costs against the latent).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from cbgen.model import thread_view
from cbgen.model.attention import attention_configs
from cbgen.model.cache_groups import CacheGroup, CacheLayout

RECORD_NAME = "cbgen_record_shapes"


@dataclass(frozen=True)
class AttentionShapes:
    """Per attention layer, (KV heads, key head size, value head size); and the KV-sharing readers
    as (reader, producer) pairs."""

    shapes: dict[int, tuple[int, int, int]]
    shared: tuple[tuple[int, int], ...] = ()


class _Recorder:
    """The recording attention function: notes shapes and tensor identities, returns zeros."""

    def __init__(self) -> None:
        self.shapes: dict[int, tuple[int, int, int]] = {}
        self.shared: dict[int, int] = {}
        self._seen: dict[tuple[int, tuple[int, ...]], int] = {}
        # Every key seen stays referenced until the forward ends, so no later layer's fresh keys
        # can be allocated at a freed layer's address and pass for a shared tensor.
        self._alive: list[torch.Tensor] = []

    def __call__(self, module, query, key, value, attention_mask, *args, **kwargs):
        layer = getattr(module, "layer_idx", None)
        if isinstance(layer, int) and layer not in self.shapes:
            # The same key storage as an earlier layer's: this layer reads that layer's keys.
            ident = (key.data_ptr(), tuple(key.shape))
            producer = self._seen.get(ident)
            if producer is not None and producer != layer:
                self.shared[layer] = self.shared.get(producer, producer)
            else:
                self._seen[ident] = layer
            self._alive.append(key)
            self.shapes[layer] = (key.shape[1], key.shape[-1], value.shape[-1])
        batch, heads, tokens = query.shape[:3]
        out = query.new_zeros(batch, tokens, heads, value.shape[-1])
        return out, None


# The recorder of the forward running in this thread (the registered name is process-wide; what
# it records is not).
_RECORDER: contextvars.ContextVar[_Recorder | None] = contextvars.ContextVar(
    "cbgen_shape_recorder", default=None
)


def _dispatch(module, *args, **kwargs):
    recorder = _RECORDER.get()
    if recorder is None:
        raise RuntimeError(f"{RECORD_NAME} was called by {type(module).__name__} outside cbgen's shape probe")
    return recorder(module, *args, **kwargs)


def attention_shapes(model: torch.nn.Module) -> AttentionShapes | None:
    """The shapes of keys and values each attention layer receives in a 4-token forward, or None
    when no layer with a ``layer_idx`` called attention through the interface (then the refusal
    comes from the start-up checks, as for any model that bypasses it)."""
    AttentionInterface.register(RECORD_NAME, _dispatch)
    recorder = _Recorder()
    device = next(model.parameters()).device
    ids = torch.arange(1, 5, device=device)[None]
    token = _RECORDER.set(recorder)
    try:
        with (
            torch.inference_mode(),
            thread_view.eval_mode(),
            thread_view.attention(attention_configs(model), RECORD_NAME),
        ):
            model(input_ids=ids, position_ids=torch.arange(4, device=device)[None], use_cache=False)
    finally:
        _RECORDER.reset(token)
    if not recorder.shapes:
        return None
    # A reader's shape is its producer's: the tensors are the same.
    shapes = {layer: s for layer, s in recorder.shapes.items() if layer not in recorder.shared}
    return AttentionShapes(shapes, tuple(sorted(recorder.shared.items())))


def kv_group(shapes: dict[int, tuple[int, int, int]], dtype: torch.dtype, block_size: int) -> CacheGroup:
    """One kv group over ``shapes``' layers, with per-layer shapes where they differ."""
    layers = tuple(sorted(shapes))
    distinct = {shapes[i] for i in layers}
    heads, k_dim, v_dim = shapes[layers[0]] if layers else (1, 64, 64)
    per_layer = tuple(shapes[i] for i in layers) if len(distinct) > 1 else ()
    return CacheGroup("kv", layers, dtype, heads, k_dim, v_dim, block_size, layer_shapes=per_layer)


def recorded_layout(model: torch.nn.Module, dtype: torch.dtype, block_size: int) -> CacheLayout | None:
    """The cache layout of an attention-only model from :func:`attention_shapes`, or None when the
    forward recorded nothing."""
    found = attention_shapes(model)
    if found is None:
        return None
    return CacheLayout((kv_group(found.shapes, dtype, block_size),), shared=found.shared)
