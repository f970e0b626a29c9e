"""The per-sequence state of linear-attention, state-space and convolution layers.

These layers (Gated DeltaNet in Qwen3.5 and Qwen3-Next, Mamba and Mamba2 in Nemotron-H, Granite-H,
Falcon-H1, Bamba, Zamba2 and Jamba, LFM2's short convolution) keep a fixed-size state per sequence
instead of keys and values per token, and reach it through a handful of methods on the cache object
the model is called with (``get_conv_state``, ``update_conv_state``, ``get_recurrent_state``,
``update_recurrent_state``, ``is_recording_past``).  cbgen reaches them there, without touching the
user's module:

* :func:`state_layout` finds out which layers keep which states, in which shape and dtype, by
  running the model on four tokens with transformers' own ``DynamicCache`` and reading what it holds
  afterwards; the attention layers are the ones that cached keys and values.  Four more tokens
  continued over that cache, against one forward of all eight (and of the last four alone), show whether the model continues a
  multi-token forward from its cached state at all (Mamba1's full-sequence form in Jamba and
  FalconMamba starts from zero whatever the cache holds): such a model prefills every prompt in one
  piece (``CacheLayout.align`` 0).  That is the
  model's :class:`~cbgen.model.cache_groups.CacheLayout`: a kv group over the attention layers and a
  state group per named state.
* :class:`StepStates` is the cache object of one forward of a step (:mod:`cbgen.model.state_pieces`
  says which rows run together): it hands each mixer its rows' states from the engine's slots and
  takes the new states back into them.  A row starting a sequence gets no state (the mixer then
  computes from zero, as for ``generate()``'s prefill); attention layers' ``update`` passes their
  keys and values through, since cbgen's paged attention writes them itself.

The arithmetic stays the model's own: the same functions ``generate()`` runs, on the same shapes
for each sequence (see the exactness rules in ``docs/design.md``), or a cbgen kernel that computes
the same bits on the slots in place (:mod:`cbgen.model.state_kernels`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from cbgen.model import thread_view
from cbgen.model.cache_groups import CacheGroup, CacheLayout
from cbgen.model.kv_shapes import attention_shapes, kv_group

# Gated DeltaNet and KDA chunk the sequence in 64s in transformers' torch functions (their
# ``chunk_size`` default, which no model overrides); Mamba2 mixers say their own ``chunk_size``.
_DEFAULT_CHUNKS = {"GatedDeltaNet": 64, "DeltaAttention": 64, "DeltaNet": 64}
# A continued forward continues the cached state when it differs from the one-piece forward by at
# most this (relative to the largest logit), or by at most CONTINUE_SHARE of what leaving the first
# tokens out changes.  Measured on the tiny test models: rounding gives below 1e-6 in float32 and
# up to ~1e-2 in bf16 (Mamba1's scan), a dropped state 1.5e-2 and more, about what leaving the
# tokens out gives.
CONTINUE_TOLERANCE = 1e-3
CONTINUE_SHARE = 0.1


def state_layout(model: torch.nn.Module, dtype: torch.dtype, block_size: int) -> CacheLayout:
    """The cache layout of a model with state layers (see the module docstring).  Raises
    ``ValueError`` with the reason when the model's cache cannot be read this way."""
    from transformers import DynamicCache

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    cache = DynamicCache(config=config)
    device = next(model.parameters()).device
    ids = torch.arange(1, 9, device=device)[None]
    pos = torch.arange(8, device=device)[None]
    with torch.inference_mode(), thread_view.eval_mode():
        whole = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0, 4:].float()
        model(input_ids=ids[:, :4], position_ids=pos[:, :4], cache=cache, use_cache=True)
        # A continued multi-token forward must continue the cached state; some mixers' full-sequence
        # form starts from zero whatever the cache holds (Mamba1's in Jamba and FalconMamba).
        continued = model(input_ids=ids[:, 4:], position_ids=pos[:, 4:], cache=cache, use_cache=True)
        # The same four tokens without the first four: how far a forward that ignores them lands.
        alone = model(input_ids=ids[:, 4:], position_ids=pos[:, 4:], use_cache=False).logits[0].float()
    scale = whole.abs().max().clamp(min=1)
    err = float((continued.logits[0].float() - whole).abs().max() / scale)
    without = float((alone - whole).abs().max() / scale)
    continues = err <= CONTINUE_TOLERANCE or err <= CONTINUE_SHARE * without
    kv: dict[int, tuple[int, int, int]] = {}
    states: dict[str, list[tuple[int, tuple[int, ...], torch.dtype]]] = {}
    for i, layer in enumerate(cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(keys, torch.Tensor) and keys.numel():
            kv[i] = (keys.shape[1], keys.shape[-1], values.shape[-1])
        for kind in ("conv", "recurrent"):
            for idx, t in (getattr(layer, f"{kind}_states", None) or {}).items():
                if isinstance(t, torch.Tensor):
                    if t.shape[0] != 1:
                        raise ValueError(f"layer {i}'s {kind} state has batch {t.shape[0]} for one sequence")
                    states.setdefault(f"{kind}{idx}", []).append((i, tuple(t.shape[1:]), t.dtype))
    if not states:
        raise ValueError(
            "no layer kept a state in transformers' cache: its recurrent layers keep their state elsewhere "
            "(on the module, as RecurrentGemma, or through a legacy cache API)"
        )
    # What transformers' cache holds is not always what attention receives (latent attention caches
    # the compressed latent): where a layer's attention call was seen, its shapes are taken.
    seen = attention_shapes(model)
    if seen is not None:
        kv.update({i: shape for i, shape in seen.shapes.items() if i in kv})
    groups = [kv_group(kv, dtype, block_size)]
    for name, entries in sorted(states.items()):
        dtypes = {d for _, _, d in entries}
        if len(dtypes) > 1:
            raise ValueError(f"state {name} comes in several dtypes {dtypes}")
        groups.append(
            CacheGroup(
                "state",
                tuple(i for i, _, _ in entries),
                dtypes.pop(),
                state_shapes=tuple(s for _, s, _ in entries),
                name=name,
            )
        )
    layers = {i for _, entries in states.items() for i, _, _ in entries}
    # A prefill cut at a multiple of every mixer's chunk keeps each chunk form's partition; a model
    # that cannot continue a multi-token forward prefills each prompt in one piece (align 0).
    align = math.lcm(1, *(_chunk(m) for m in _mixers(model, layers).values()))
    if not continues:
        align = 0
    return CacheLayout(tuple(groups), align=align)


def _mixers(model: torch.nn.Module, layers: set[int]) -> dict[int, torch.nn.Module]:
    """The module of each state layer that reads the state (the one with ``layer_idx`` and
    ``conv1d``/``conv`` weights, or a chunk size)."""
    found: dict[int, torch.nn.Module] = {}
    for m in model.modules():
        idx = getattr(m, "layer_idx", None)
        if idx in layers and (
            hasattr(m, "chunk_size") or hasattr(m, "conv1d") or hasattr(m, "conv") or _named_chunk(m)
        ):
            found.setdefault(idx, m)
    return found


def _named_chunk(m: torch.nn.Module) -> int | None:
    name = type(m).__name__
    return next((c for key, c in _DEFAULT_CHUNKS.items() if key in name), None)


def _chunk(m: torch.nn.Module) -> int:
    """The sequence chunk of a mixer's prefill form (1: a sequential scan or a convolution, which any
    cut computes the same way)."""
    chunk = getattr(m, "chunk_size", None)
    if isinstance(chunk, int) and chunk > 0:
        return chunk
    return _named_chunk(m) or 1


class StepStates:
    """The cache object one forward of a step hands the model (see the module docstring).

    ``slots``: the state slot of each batch row (``[B]``); ``fresh``: the rows start their
    sequences (no state yet: the mixers compute from zero, and their final states are stored);
    ``derived``: the forward's ``AttentionMetadata.derived``.
    A single row reads and writes its slot in place; a batch of rows works on gathered copies that
    :meth:`store` writes back after the forward.  ``in_place``: the states (name, layer) that a cbgen
    kernel updates in the slots themselves (:mod:`cbgen.model.state_kernels`); for them the getters
    give a stand-in (NaNs, so any other use shows) that the kernel maps back to the slots
    (:meth:`in_place_target`), and nothing is gathered or stored.
    """

    def __init__(
        self,
        states: dict[tuple[str, int], torch.Tensor],
        slots: torch.Tensor,
        fresh: bool,
        past: int,
        derived: dict | None = None,
        in_place: frozenset[tuple[str, int]] = frozenset(),
    ) -> None:
        self._states = states
        # The forward's attention metadata's ``derived``: where ``update`` says which layer attends
        # next, for attention blocks shared by several layers.
        self._derived = derived if derived is not None else {}
        self._slots = slots
        self._one = int(slots.shape[0]) == 1
        self._slot0 = int(slots[0]) if self._one else -1
        self._fresh = fresh
        self._past = past
        self._rows: dict[tuple[str, int], torch.Tensor] = {}
        # A batch's states already written to their slots (the rest may have changed in place).
        self._stored: set[tuple[str, int]] = set()
        self._in_place = in_place
        self._stand_ins: dict[tuple[str, int], torch.Tensor] = {}
        self._stand_in_keys: dict[int, tuple[str, int]] = {}  # id(stand-in) -> its state

    def _view(self, name: str, layer: int) -> torch.Tensor:
        key = (name, layer)
        rows = self._rows.get(key)
        if rows is None:
            pool = self._states.get(key)
            if pool is None:
                raise RuntimeError(
                    f"layer {layer} asked for state {name!r}, which the start-up forward did not show it keeps"
                )
            rows = pool.narrow(0, self._slot0, 1) if self._one else pool.index_select(0, self._slots)
            self._rows[key] = rows
        return rows

    # ---------------------------------------------------------------- what the mixers call
    def _state(self, name: str, layer: int) -> torch.Tensor | None:
        if self._fresh:
            return None
        key = (name, layer)
        if key not in self._in_place:
            return self._view(name, layer)
        stand_in = self._stand_ins.get(key)
        if stand_in is None:
            pool = self._states[key]
            stand_in = pool.new_full((1,) * (pool.dim() - 1), float("nan"))
            stand_in = self._stand_ins[key] = stand_in.expand(self._slots.shape[0], *pool.shape[1:])
            self._stand_in_keys[id(stand_in)] = key
        return stand_in

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The rows' convolution state (None for rows that start their sequences)."""
        return self._state(f"conv{state_idx}", layer_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The rows' recurrent state (None for rows that start their sequences)."""
        return self._state(f"recurrent{state_idx}", layer_idx)

    def in_place_target(self, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The slot pool and slots that a kernel updates in place for ``state``, when ``state`` is a
        stand-in from a getter (else None: the state is an ordinary tensor)."""
        key = self._stand_in_keys.get(id(state))
        if key is None or self._stand_ins[key] is not state:
            return None
        return self._states[key], self._slots

    def update_conv_state(
        self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs
    ) -> torch.Tensor:
        """Keeps the last columns of the convolution input and returns the input with the kept
        columns before it (zeros for a new sequence), as transformers' cache does."""
        state = self._view(f"conv{state_idx}", layer_idx)
        width = state.shape[-1]
        if self._fresh:
            full = conv_states
            if full.shape[-1] < width:
                full = F.pad(full, (width - full.shape[-1], 0))
        else:
            full = torch.cat([state, conv_states.to(state.dtype)], dim=-1)
        state.copy_(full[..., -width:])
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs
    ) -> torch.Tensor:
        """Stores the rows' new recurrent state (a batch's straight into its slots)."""
        key = (f"recurrent{state_idx}", layer_idx)
        if recurrent_states is self._stand_ins.get(key):
            return recurrent_states  # the kernel wrote the slots already
        if self._one:
            state = self._view(*key)
            state.copy_(recurrent_states)
            return state
        self._states[key].index_copy_(0, self._slots, recurrent_states.to(self._states[key].dtype))
        self._stored.add(key)
        return recurrent_states

    def is_recording_past(self, layer_idx: int = 0) -> bool:
        """cbgen keeps no past states in the layers (no rollback through the cache object)."""
        return False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Attention layers' keys and values pass through: cbgen's paged attention stores them (in
        ``layer_idx``'s cache, which a shared attention block learns from here)."""
        self._derived["cache_layer"] = layer_idx
        return key_states, value_states

    def get_mask_sizes(self, *args, **kwargs):
        """Refused: a layer that sizes its own mask or position bias from the cache computes
        positions cbgen's paged attention does not see (Inkling's relative bias)."""
        raise NotImplementedError(
            "the model computes attention positions from the cache object (get_mask_sizes): its own "
            "position bias or mask, which cbgen's paged attention does not apply"
        )

    get_query_offset = get_mask_sizes

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens before this forward's (of its first row)."""
        return self._past

    # ---------------------------------------------------------------- after the forward
    def store(self) -> None:
        """Writes a batch's gathered states back to their slots."""
        if self._one:
            return
        for key, rows in self._rows.items():
            if key not in self._stored:
                self._states[key].index_copy_(0, self._slots, rows)


def projections(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The decoder's projections worth a packed GEMM (:mod:`cbgen.model.cpu_fast.packed_linears`):
    every ``nn.Linear`` with a 2-D weight of at least the packing threshold, LM head included."""
    from cbgen.model.cpu_fast.packed_linears import packable

    return [
        m
        for m in model.modules()
        if type(m) is torch.nn.Linear and m.weight.dim() == 2 and packable(m.weight.numel())
    ]


def choose_projection_gemms(model: torch.nn.Module, prepack: bool):
    """The projection GEMM per row class for a state model's module forward: measured once per
    machine and set of shapes (:func:`cbgen.model.cpu_fast.gemm_choice.choose`), or plain
    ``F.linear`` without ``prepack``."""
    from cbgen.model.cpu_fast import gemm_choice

    if not prepack:
        return gemm_choice.GemmPlan(gemm_choice.PLAIN, gemm_choice.PLAIN, source="prepack_weights=False")
    linears = projections(model)
    dtype = linears[0].weight.dtype
    shapes = sorted({tuple(m.weight.shape) for m in linears})

    def make_layers() -> list[list[torch.Tensor]]:
        per_layer = sum(n * k for n, k in shapes) * linears[0].weight.element_size()
        count = gemm_choice.timing_layer_count(per_layer, max(1, len(linears) // max(1, len(shapes))))
        by_shape: dict[tuple, list[torch.Tensor]] = {}
        for m in linears:
            by_shape.setdefault(tuple(m.weight.shape), []).append(m.weight.detach())
        return [[ws[i % len(ws)] for ws in by_shape.values()] for i in range(count)]

    return gemm_choice.choose(dtype, shapes, make_layers)
