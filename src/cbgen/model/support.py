"""Which models cbgen runs, decided once at engine start.

cbgen runs the user's module unmodified and reaches its attention through transformers'
``AttentionInterface``: every step is one packed row of many sequences, and only attention knows
where one sequence ends.  So a model runs exactly when everything that mixes tokens of a sequence
goes through that interface, and the rest of the model is per-token.  A model that breaks this is
refused, with a reason naming the part, never run into a silently wrong answer.

Two checks, both at engine start:

* :func:`check_model` (static, before the KV cache is sized) refuses what the config already says:
  encoder-decoders, layer kinds that keep state outside a KV cache (state-space, linear-attention,
  recurrent and convolution layers, named by the config's per-layer types), bidirectional attention,
  and models with no attention module that transformers routes through the interface.
* :func:`probe` (dynamic, once the runner exists) runs two short sequences through the engine's own
  forward the way steps run them: packed together, one of them split into two chunks, the other
  continued by a decode row.  It compares every position's logits with the model's plain forward of
  each sequence alone.  What the static check cannot see (a token-shift convolution, positions
  computed from the row instead of ``position_ids``, an attention module that bypasses the
  interface, an attention kwarg the paged kernels do not implement) shows up as a mismatch there,
  and the first decoder layer whose output differs is named in the refusal.

The dynamic checks, :func:`probe` and the parity plan's :func:`check_direct_forward`, see the engine
only through a :class:`cbgen.model.startup.StartupTarget` (the runner, its KV cache and a few facts
about the model), which the engine builds and passes in.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from cbgen.model import thread_view

if TYPE_CHECKING:
    from cbgen.model.startup import StartupTarget

# Per-layer kinds the paged cache holds exactly.  Chunked attention (Llama 4) is local attention
# in fixed chunks: exact while a sequence fits in one chunk, which length_limit() enforces.
ATTENTION_KINDS = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})
_LAYER_TYPE_FIELDS = ("layer_types", "layers_block_type", "block_types")
# Nemotron-H style patterns: one character per layer.
_PATTERN_KINDS = {"*": "attention", "-": "MLP", "E": "mixture of experts"}


class UnsupportedModelError(ValueError):
    """The model cannot run exactly under cbgen's paged cache; the message says which part and why."""


def text_config(model: torch.nn.Module):
    """The config that describes the model's decoder stack."""
    config = model.config
    try:
        return config.get_text_config(decoder=True)
    except (TypeError, ValueError, AttributeError):
        return config


def _layer_kinds(config) -> dict[str, list[int]]:
    """Per-layer kind -> layer indices, from whichever per-layer field the config has."""
    for name in _LAYER_TYPE_FIELDS:
        kinds = getattr(config, name, None)
        if isinstance(kinds, (list, tuple)) and kinds:
            out: dict[str, list[int]] = {}
            for i, kind in enumerate(kinds):
                out.setdefault(str(kind), []).append(i)
            return out
    pattern = getattr(config, "hybrid_override_pattern", None)
    if isinstance(pattern, str) and pattern:
        out = {}
        for i, ch in enumerate(pattern):
            kind = _PATTERN_KINDS.get(ch, f"'{ch}' (a state-space or other non-attention mixer)")
            out.setdefault(kind, []).append(i)
        return {k: v for k, v in out.items() if k not in ("MLP", "mixture of experts")}
    return {}


# Per-layer kinds that name a layer's feed-forward part, which is per token (Nemotron-H's pattern).
_PER_TOKEN_KINDS = frozenset({"mlp", "moe", "mixture of experts"})


def _is_sparse(kind: str) -> bool:
    k = kind.lower()
    return "index" in k or "compress" in k or "sparse" in k


def _kind_reason(kind: str) -> str:
    if _is_sparse(kind):
        return "sparse attention that keeps its own compressed or indexer cache"
    return "a layer whose state is not a KV cache"


def _layers_text(indices: list[int]) -> str:
    shown = ", ".join(map(str, indices[:6])) + (", ..." if len(indices) > 6 else "")
    return f"layer{'s' if len(indices) > 1 else ''} {shown}"


# transformers dropped the cached recurrent state on multi-token forwards over a cache (chunked
# prefill, resumed sequences) until its PR 45513, merged 2026-04-23; 5.7.0 is the first release after.
STATE_MIN_TRANSFORMERS = (5, 7)


def state_kinds(model: torch.nn.Module) -> dict[str, list[int]]:
    """The config's per-layer kinds that are neither attention nor per-token (state-space,
    linear-attention, convolution and hybrid layers), with their layers."""
    kinds = _layer_kinds(text_config(model))
    return {k: v for k, v in kinds.items() if k not in ATTENTION_KINDS and k.lower() not in _PER_TOKEN_KINDS}


def has_state_layers(model: torch.nn.Module) -> bool:
    """Whether some layer keeps a state per sequence (the cache layout then has state groups)."""
    return bool(state_kinds(model))


def _transformers_version() -> tuple[int, int]:
    import transformers

    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def check_model(model: torch.nn.Module) -> None:
    """Raises :class:`UnsupportedModelError` when the config or module tree already shows that
    ``model`` cannot run exactly (see the module docstring)."""
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is an encoder-decoder model; cbgen runs decoder-only models")
    foreign = state_kinds(model)
    sparse = {k: v for k, v in foreign.items() if _is_sparse(k)}
    if sparse:
        described = "; ".join(f"'{k}' at {_layers_text(v)}: {_kind_reason(k)}" for k, v in sparse.items())
        raise UnsupportedModelError(
            f"{name} has layers that are not softmax attention over a KV cache ({described}); "
            "cbgen's paged cache holds keys and values per token and states per sequence"
        )
    if foreign and _transformers_version() < STATE_MIN_TRANSFORMERS:
        raise UnsupportedModelError(
            f"{name} has state layers ({', '.join(foreign)}), and transformers before "
            f"{'.'.join(map(str, STATE_MIN_TRANSFORMERS))} drops their cached state on multi-token "
            "forwards (chunked prefill); upgrade transformers"
        )
    attention = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "config")]
    if not attention:
        candidates = sorted(
            {type(m).__name__ for m in model.modules() if "attention" in type(m).__name__.lower()}
        )
        found = f" (its attention modules: {', '.join(candidates[:4])})" if candidates else ""
        raise UnsupportedModelError(
            f"{name}'s attention modules carry no `layer_idx`{found}: they do not go through "
            "transformers' attention interface, the only way cbgen reaches a model's attention"
        )
    bidirectional = [m for m in attention if getattr(m, "is_causal", True) is False]
    if bidirectional:
        raise UnsupportedModelError(
            f"{name}'s attention module {type(bidirectional[0]).__name__} is not causal (is_causal=False): "
            "bidirectional attention (for BERT-style models, `is_decoder=False` in the config) or "
            "cross-attention to an encoder, neither of which a decoder-only paged cache serves"
        )


def length_limit(model: torch.nn.Module) -> int | None:
    """The longest sequence the model runs exactly under cbgen, where the architecture sets one:
    chunked-attention layers attend within fixed chunks, and the paged kernels attend the whole
    context, so the two agree only while a sequence fits in one chunk."""
    config = text_config(model)
    if "chunked_attention" in _layer_kinds(config):
        chunk = getattr(config, "attention_chunk_size", None)
        return int(chunk) if chunk else None
    return None


def geometry_error(model: torch.nn.Module, exc: Exception) -> UnsupportedModelError:
    """The refusal for a model whose KV-cache shape cannot be read as one size for every layer."""
    return UnsupportedModelError(
        f"cbgen cannot read one KV-cache shape (layers, KV heads, head size) for {type(model).__name__} "
        f"from its config: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    )


# ----------------------------------------------------------------------------------------- probe

_A_LEN, _B_LEN, _B_SPLIT = 9, 13, 6


def _probe_tokens(vocab: int, salt: int = 0) -> tuple[list[int], list[int]]:
    # Deterministic, spread over the vocabulary, away from the lowest ids (often special tokens).
    lo = min(3, vocab - 1)
    span = max(vocab - lo, 1)
    a = [lo + (7919 * i + 17 + 31 * salt) % span for i in range(_A_LEN + 1)]
    b = [lo + (104729 * i + 5 + 97 * salt) % span for i in range(_B_LEN)]
    return a, b


def _tolerance(dtype: torch.dtype) -> float:
    """Largest accepted |logit difference| relative to the largest |logit|: far above the rounding
    of a packed against a padded computation, far below what a leaked state or a wrong position does."""
    return 2e-3 if dtype in (torch.float32, torch.float64) else 8e-2


def _decoder_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The decoder stack's layers, in order (the largest ModuleList of the model)."""
    best: tuple[str, torch.nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and (best is None or len(module) > len(best[1])):
            best = (name, module)
    if best is None:
        return []
    return [(f"{best[0]}.{i}", layer) for i, layer in enumerate(best[1])]


class _LayerTaps:
    """Records each decoder layer's first output tensor while active."""

    def __init__(self, layers: list[tuple[str, torch.nn.Module]]) -> None:
        self.layers = layers
        self.outputs: list[list[torch.Tensor]] = [[] for _ in layers]
        self.handles = []

    def __enter__(self) -> _LayerTaps:
        for i, (_, layer) in enumerate(self.layers):
            self.handles.append(layer.register_forward_hook(self._hook(i)))
        return self

    def _hook(self, i: int):
        def hook(_module, _args, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(out, torch.Tensor):
                self.outputs[i].append(out.detach().float().reshape(-1, out.shape[-1]).clone())

        return hook

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()


def probe(target: StartupTarget) -> None:
    """Runs the engine's forward on two short sequences as steps run them (packed together, split
    into chunks, continued by a decode row) and compares every position's logits with the model's
    plain forward of each sequence alone; raises :class:`UnsupportedModelError` naming the first
    decoder layer whose output differs (see the module docstring)."""
    setup = _probe_setup(target)
    if setup is None:
        return
    builder, need = setup
    model = target.model
    tokens = _probe_tokens(target.vocab_size)
    tol = _tolerance(target.dtype)
    paged, _ = _paged_logits(target, builder, tokens, need, layers=None)
    plain, _ = _plain_logits(model, tokens, target.device, layers=None)
    off = _positions_off(paged, plain, tol)
    if off:
        # A near-tied discrete choice inside the model (an MoE router's top-k, in bf16 most of all)
        # can go the other way in either computation at one position: the logits there differ by
        # far more than rounding, though both are right.  A structural difference shows at the same
        # positions (sequence starts, chunk boundaries, the decode row) whatever the tokens, so a
        # second token set must fail at one of the same positions too.
        other = _probe_tokens(target.vocab_size, salt=1)
        off &= _positions_off(
            _paged_logits(target, builder, other, need, layers=None)[0],
            _plain_logits(model, other, target.device, layers=None)[0],
            tol,
        )
    if not off:
        return
    err = _relative_error(paged, plain)
    # Run both again with every decoder layer's output recorded, to name where they part.  (Not on
    # the first run: hooks change the model's structure, which makes the runner re-plan.)
    layers = _decoder_layers(model)
    _, paged_layers = _paged_logits(target, builder, tokens, need, layers)
    _, plain_layers = _plain_logits(model, tokens, target.device, layers)
    where = _first_divergent_layer(layers, paged_layers, plain_layers, target.dtype)
    raise UnsupportedModelError(
        f"{type(model).__name__} gives different logits under cbgen's packed, paged forward than its "
        f"own forward (relative error {err:.2g}{where}): a part of it mixes tokens outside "
        "transformers' attention interface (a convolution, a recurrent state, positions computed from "
        "the row) or passes attention an argument the paged kernels do not implement, or a cbgen kernel "
        "on this machine computes that layer wrong (then it is a cbgen bug: please report it)"
    )


def _probe_setup(target: StartupTarget):
    """(input builder, blocks needed) for the probe's steps, with the cache allocated; None when
    the cache or the length limit is too small for them."""
    from cbgen.model.input_batch import InputBuilder

    bs = target.kv_cache.block_size
    need = -(-(_A_LEN + 1) // bs) + -(-_B_LEN // bs)
    with_state = bool(target.kv_cache.layout.state_groups)
    if target.kv_cache.num_blocks < need or target.max_model_len < _B_LEN:
        return None
    if with_state and target.kv_cache.num_slots < 2:
        return None
    # Row prefill (short chunks as decode rows) is part of what runs, so the probe builds like the engine.
    builder = InputBuilder(
        bs,
        target.device,
        row_prefill_max=target.plan.row_prefill_max,
        num_blocks=need,
        rope_extents=target.rope_extents,
        with_state=with_state,
    )
    target.kv_cache.allocate()
    return builder, need


def paged_probe_logits(target: StartupTarget) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The logits of the probe's two sequences at every position as the engine's forward computes
    them in the probe's two steps (see :func:`probe`), or None when the cache is too small for them."""
    setup = _probe_setup(target)
    if setup is None:
        return None
    builder, need = setup
    return _paged_logits(target, builder, _probe_tokens(target.vocab_size), need, layers=None)[0]


def check_direct_forward(target: StartupTarget) -> bool | None:
    """Whether the runner's direct forward (the parity plan's,
    :mod:`cbgen.batch_invariant.direct_forward`) gives the module forward's logits bit for bit on
    the start-up probe's two steps (:func:`paged_probe_logits`); None when the cache is too small
    for them.  Called at engine start when the plan chose the direct forward; the runner runs the
    module forward unless it passed."""
    runner = target.runner
    direct = paged_probe_logits(target)
    if direct is None:
        return None
    with runner.module_forward():
        module = paged_probe_logits(target)
    return all(torch.equal(a, b) for a, b in zip(direct, module))


def _paged_logits(
    target: StartupTarget, builder, tokens, need: int, layers
) -> tuple[tuple[torch.Tensor, torch.Tensor], list]:
    """Logits of sequences A and B at every position, as two engine steps compute them: step 1
    packs A's prompt with B's first chunk, step 2 A's decode row with B's second chunk."""
    from cbgen.request import Request
    from cbgen.sampling_params import SamplingParams

    a_tokens, b_tokens = tokens
    bs = target.kv_cache.block_size
    params = SamplingParams(max_tokens=1)
    a = Request("cbgen-probe-a", a_tokens[:_A_LEN], params)
    b = Request("cbgen-probe-b", b_tokens, params)
    a.block_ids = list(range(-(-(_A_LEN + 1) // bs)))
    b.block_ids = list(range(len(a.block_ids), need))
    a.state_slot, b.state_slot = 0, 1  # read only by models with state layers
    # A model that prefills each prompt in one piece (CacheLayout.align 0) continues B by one token.
    split = (
        _B_LEN - 1 if target.kv_cache.layout.state_groups and target.kv_cache.layout.align == 0 else _B_SPLIT
    )
    steps = [[(a, _A_LEN), (b, split)], [(a, 1), (b, _B_LEN - split)]]
    got = []
    taps = _LayerTaps(layers or [])
    try:
        with taps:
            for step in steps:
                batch = builder.build(step, target.kv_cache.layers)
                batch.logits_indices = torch.arange(batch.num_tokens, device=target.device)
                # One record per forward: a state model's step is several (cbgen.model.state_pieces).
                metas = [batch.meta] if batch.pieces is None else [p.meta for p in batch.pieces]
                records: list[list[int]] = [[] for _ in metas]
                for meta, calls in zip(metas, records):
                    meta.derived["attention_calls"] = calls
                got.append(target.runner.execute(batch).float().cpu())
                for calls in records:
                    _check_one_call_per_layer(target.model, calls)
                for r, n in step:
                    r.num_computed_tokens += n
                if step is steps[0]:
                    a.token_ids.append(a_tokens[_A_LEN])
    except UnsupportedModelError:
        raise
    except Exception as exc:  # a failing packed forward is a refusal, with its cause
        raise UnsupportedModelError(
            f"{type(target.model).__name__} fails under cbgen's packed, paged forward: {_one_line(exc)}"
        ) from exc
    finally:
        with torch.inference_mode():
            for layer in target.kv_cache.layers:
                for t in layer or ():
                    t[:need].zero_()
    s1, s2 = got
    # Packed order: decode rows first, then prefill chunks in order.
    return (torch.cat([s1[:_A_LEN], s2[:1]]), torch.cat([s1[_A_LEN:], s2[1:]])), taps.outputs


def _check_one_call_per_layer(model: torch.nn.Module, calls: list[int]) -> None:
    """Each layer's cache belongs to one attention call per forward.  A model that runs a layer's
    attention more than once per forward (looped or recurrent-depth models) would overwrite the
    K/V of one pass with the next's."""
    repeated = sorted({i for i in calls if calls.count(i) > 1})
    if repeated:
        raise UnsupportedModelError(
            f"{type(model).__name__} runs the attention of layer {repeated[0]} {calls.count(repeated[0])} "
            "times per forward (a looped model, or differential attention): cbgen's paged cache holds one set "
            "of keys and values per layer and token"
        )


def _plain_logits(model, tokens, device, layers) -> tuple[tuple[torch.Tensor, torch.Tensor], list]:
    """The model's own forward of A and of B, each alone."""
    taps = _LayerTaps(layers or [])
    # Eval mode for the check, as every engine forward runs (no dropout, no RNG draw that would
    # disturb a trainer's random stream), on this thread only (the user's flags stay as they are).
    try:
        # no_grad, not inference mode: a model that caches tensors in its forward must not end up
        # holding inference tensors because of a check it did not ask for.
        with torch.no_grad(), taps, thread_view.eval_mode():
            out = tuple(
                model(torch.tensor([t], device=device), use_cache=False).logits[0].float().cpu()
                for t in tokens
            )
    except Exception as exc:
        raise UnsupportedModelError(
            f"{type(model).__name__}'s own forward on input_ids alone fails ({_one_line(exc)}); cbgen "
            "feeds the model token ids and positions only"
        ) from exc
    return out, taps.outputs


def _positions_off(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], tol: float) -> set[int]:
    """Positions (A's, then B's) whose largest |logit difference| exceeds ``tol`` times the largest
    |reference logit| (at least 1); NaN counts as off."""
    scale = max(max(float(w.abs().max()) for w in want), 1.0)
    diff = torch.cat([(g - w).abs().amax(-1) for g, w in zip(got, want, strict=True)]) / scale
    return set((~(diff <= tol)).nonzero().flatten().tolist())


def _relative_error(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> float:
    """Largest |difference| over the largest |reference value| (at least 1)."""
    scale = max(max(float(w.abs().max()) for w in want), 1.0)
    return max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True)) / scale


def _one_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0][:240] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"


def _first_divergent_layer(
    layers, paged: list[list[torch.Tensor]], plain: list[list[torch.Tensor]], dtype
) -> str:
    """``; the first layer whose output differs is ...`` or ``""`` where the layers' outputs cannot
    be compared (the fused forward calls no layer module)."""
    for (name, layer), p_out, r_out in zip(layers, paged, plain, strict=False):
        if len(p_out) != 2 or len(r_out) != 2 or p_out[0].shape[0] != _A_LEN + _B_SPLIT:
            return ""
        s1, s2 = p_out
        got = (torch.cat([s1[:_A_LEN], s2[:1]]), torch.cat([s1[_A_LEN:], s2[1:]]))
        if any(g.shape != w.shape for g, w in zip(got, r_out, strict=True)):
            return ""
        err = _relative_error(got, tuple(r_out))
        if not math.isfinite(err) or err > _tolerance(dtype):
            mixers = sorted(
                {
                    type(m).__name__
                    for m in layer.children()
                    if not any(k in type(m).__name__.lower() for k in ("norm", "mlp", "dropout", "linear"))
                }
            )
            inside = f", which holds {', '.join(mixers)}" if mixers else ""
            return f"; the first layer whose output differs is {name} ({type(layer).__name__}{inside})"
    return ""
