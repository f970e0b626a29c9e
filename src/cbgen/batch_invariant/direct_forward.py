"""Parity mode's engine forward without the module tree, for the Llama-family models the fused CPU
path knows.

The parity plan's general forward runs the model's modules under the parity dispatch mode
(:class:`cbgen.batch_invariant.dispatch.ParityOps`), as the trainer side does.  On a small model
most of that step is not arithmetic: ~60 aten ops per decoder layer each pass through the Python
dispatch mode, plus transformers' module calls (measured on SmolLM2, 32 decode rows, Zen 4: about
half of the step).  This forward issues the ops that reach the same kernels directly:

* every projection through :func:`cbgen.batch_invariant.kernels.cpu_parity.parity_linear_packed`,
  the kernel the mode routes ``linear`` to; q/k/v and gate/up as one product each, from one pack of
  the concatenated weights (each output element's chain reads only its own weight column, so the
  concatenation changes no bit);
* SwiGLU's ``silu(gate) * up`` as one C call that evaluates SiLU with torch's own vector exp
  (:func:`cbgen.batch_invariant.kernels.cpu_parity_rows.silu_mul`; used only where a check on every
  bfloat16 value and on float32 values over many scales finds torch's bits, otherwise torch's SiLU
  through the mode's whole-vector form, :mod:`cbgen.batch_invariant.lanes`); the rotary module's
  ``cos``/``sin`` run under the mode, once per step;
* attention through the same paged attention function and parity backend;
* RMSNorm, the rotary products and the residual adds as transformers' modules write them, in the
  same dtypes: the elementwise chains as one exact C call each
  (:mod:`cbgen.batch_invariant.kernels.cpu_parity_rows`), RMSNorm's mean as torch's own
  last-dimension reduction over rows of the same length.

So its logits equal the module forward's bit for bit, hence the trainer side's.  That is checked,
not assumed: at engine start :func:`cbgen.model.support.check_direct_forward` runs two probe steps
both ways and the runner falls back to the module forward if any bit differs (a transformers release
that changes the math).
Which models qualify is :func:`cbgen.model.cpu_fast.qualify.unsupported_reason`'s answer, the
fused path's; the runner re-plans when the model's structure changes (an adapter injected).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from cbgen.batch_invariant.dispatch import ParityOps
from cbgen.batch_invariant.kernels.cpu_parity import parity_linear_packed, parity_pack
from cbgen.batch_invariant.kernels.cpu_parity_rows import (
    add_square,
    mul,
    norm_apply,
    rope,
    silu_mul,
    torch_vector_exp,
)
from cbgen.batch_invariant.lanes import lanewise, lanewise_
from cbgen.batch_invariant.packs import WeightPacks
from cbgen.model.attention import AttentionMetadata, paged_attention_forward
from cbgen.model.cpu_fast.fused_forward import LayerModules, ModelModules

_SILU = torch.ops.aten.silu.default
_SILU_ = torch.ops.aten.silu_.default


def _norm(x: torch.Tensor, sq: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
    # LlamaRMSNorm's forward (and Mistral's, Qwen2's, Qwen3's) on x [T, N] given sq = x.float() ** 2:
    # its one reduction, the sum inside the mean, is torch's own call; the rest is one exact C call.
    weight, eps = norm
    return norm_apply(x, sq.sum(-1), eps, weight)


@functools.cache
def _c_silu(dtype: torch.dtype) -> tuple[int, int] | None:
    """torch's vector exp when the C SiLU-and-product through it gives the mode's bits for
    ``dtype`` (NaN payloads aside): checked on every bfloat16 value, and on float32 values over many scales with the
    special ones, against the mode's own ``lanewise(silu, gate) * up``.  None: the torch path."""
    exp = torch_vector_exp()
    if exp is None:
        return None
    gen = torch.Generator().manual_seed(0)
    if dtype == torch.bfloat16:
        gate = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    else:
        scales = torch.logspace(-8, 3, 45)
        gate = (torch.randn(45, 8192, generator=gen) * scales[:, None]).flatten()
        special = [
            0.0,
            -0.0,
            float("inf"),
            float("-inf"),
            float("nan"),
            88.7,
            -88.7,
            104.0,
            -104.0,
            1e-40,
            -1e-40,
        ]
        gate = torch.cat([gate, torch.tensor(special)])
    gate = gate.to(dtype)
    inter = 192  # a row length that is no multiple of any vector width ends each row on a partial one
    pad = -gate.numel() % inter
    gate = torch.cat([gate, gate[:pad]]).view(-1, inter)
    up = torch.randn(gate.shape, generator=gen).to(dtype)
    want = lanewise(_SILU, gate) * up
    got = silu_mul(torch.cat([gate, up], dim=1), inter, exp)
    # Bit for bit, except that a NaN may carry another payload (torch's bfloat16 rounding makes every
    # NaN one pattern, the C kernels keep the payload): it is a NaN either way.
    nan = want.isnan()
    same = torch.equal(got.isnan(), nan) and torch.equal(got[~nan], want[~nan])
    return exp if same else None


def _silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    # SwiGLU's act_fn(gate) * up: SiLU as the mode computes it (whole vectors), then one exact
    # product: one C call through torch's own vector exp where that gives the same bits, otherwise
    # torch's SiLU on a contiguous copy of the gate (in place when its size allows) and the C product.
    exp = _c_silu(gate_up.dtype)
    if exp is not None:
        return silu_mul(gate_up, inter, exp)
    gate = gate_up[:, :inter].contiguous()
    if not lanewise_(_SILU_, gate):
        gate = lanewise(_SILU, gate)
    return mul(gate, gate_up[:, inter:], out=gate)


def _rmsnorm(x: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
    return _norm(x, add_square(x)[1], norm)


class ParityDirectForward:
    """Runs parity-mode steps of a model the fused path qualifies (see the module docstring).
    ``packs`` are the runner's packed single weights (the LM head); the concatenated q/k/v and
    gate/up packs live here and go with :meth:`weights_changed`."""

    def __init__(self, model: nn.Module, packs: WeightPacks) -> None:
        self.model = model
        self.packs = packs
        self._mods: ModelModules | None = None
        self._groups: dict[tuple[int, int], tuple[torch.Tensor, int, list]] = {}

    def prepare(self) -> None:
        """Packs every weight the next step reads (the engine calls it at start, after the check)."""
        if self._mods is None:
            self._mods = ModelModules.of(self.model)
        for layer in self._mods.layers:
            for index, group in enumerate(layer.groups):
                self._group(layer.layer_idx, index, group)
        self.packs.get(self._mods.lm_head.weight)

    def weights_changed(self) -> None:
        """Drops the packed copies (the runner calls it on every weight change it is told of)."""
        self._groups.clear()

    def _group(self, layer: int, index: int, mods: tuple[nn.Linear, ...]) -> tuple:
        key = (layer, index)
        entry = self._groups.get(key)
        if entry is None:
            weights = [m.weight.detach() for m in mods]
            weight = weights[0] if len(weights) == 1 else torch.cat(weights)
            # Each member's bias over its own columns only: a member without one adds nothing.
            biases, start = [], 0
            for m, w in zip(mods, weights):
                if m.bias is not None:
                    biases.append((start, start + w.shape[0], m.bias.detach()))
                start += w.shape[0]
            entry = self._groups[key] = (parity_pack(weight), weight.shape[0], biases)
        return entry

    def _linear(self, x: torch.Tensor, layer: LayerModules, index: int) -> torch.Tensor:
        packed, n, biases = self._group(layer.layer_idx, index, layer.groups[index])
        out = parity_linear_packed(x, packed, n)
        # nn.Linear under the mode: the product, then ``+ bias``.
        for start, end, bias in biases:
            if start == 0 and end == n:
                out = out + bias
            else:
                out[:, start:end] += bias
        return out

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Logits ``[R, V]`` for ``rows`` of the packed batch, equal to the module forward's."""
        if self._mods is None:
            self._mods = ModelModules.of(self.model)
        mods = self._mods
        hidden = mods.embed(input_ids)
        tokens = hidden.shape[0]
        with ParityOps(self.packs):
            cos, sin = mods.rotary(hidden[None], positions[None])
        cos, sin = cos[0], sin[0]
        # hidden.float() ** 2 travels with hidden: each residual add writes both in one pass.
        hidden, sq = add_square(hidden)
        for layer in mods.layers:
            d = layer.head_dim
            qkv = self._linear(_norm(hidden, sq, layer.in_norm), layer, 0)
            nq = layer.qkv[0].weight.shape[0]
            nk = layer.qkv[1].weight.shape[0]
            q = qkv[:, :nq].view(tokens, -1, d)
            k = qkv[:, nq : nq + nk].view(tokens, -1, d)
            v = qkv[:, nq + nk :].view(tokens, -1, d)
            if layer.qk_norms is not None:
                # Over contiguous rows, as the module's norm sees its projection's fresh output.
                q = _rmsnorm(q.reshape(-1, d), layer.qk_norms[0]).view(tokens, -1, d)
                k = _rmsnorm(k.reshape(-1, d), layer.qk_norms[1]).view(tokens, -1, d)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            attn = layer.attn
            out, _ = paged_attention_forward(
                attn,
                q.transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                None,
                scaling=layer.scaling,
                sliding_window=layer.window or None,
                cbgen_meta=meta,
            )
            hidden, sq = add_square(hidden, self._linear(out[0].reshape(tokens, -1).contiguous(), layer, 1))
            gate_up = self._linear(_norm(hidden, sq, layer.post_norm), layer, 2)
            inter = layer.gate_up[0].weight.shape[0]
            hidden, sq = add_square(hidden, self._linear(_silu_mul(gate_up, inter), layer, 3))
        # The final norm is per row, so only the rows that are sampled need it.
        x = _norm(hidden.index_select(0, rows), sq.index_select(0, rows), mods.next_norms[-1])
        head = mods.lm_head.weight
        return parity_linear_packed(x, self.packs.get(head), head.shape[0])
