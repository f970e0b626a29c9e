"""Fakes of flash-attn 2's two entry points cbgen calls, written from their documented semantics
(flash-attn itself needs a GPU), and :func:`install`, which puts them in place of ``flash_attn``."""

from __future__ import annotations

import sys
import types

import torch

from cbgen.model.kernels.flash import ops as flash_ops


class FakeFlash:
    """``flash_attn_with_kvcache`` in plain torch; records the arguments of every call."""

    def __init__(self, page_multiple: int = 256) -> None:
        self.page_multiple = page_multiple
        self.calls: list[dict] = []

    def __call__(
        self,
        q,
        k_cache,
        v_cache,
        k=None,
        v=None,
        rotary_cos=None,
        rotary_sin=None,
        cache_seqlens=None,
        cache_batch_idx=None,
        cache_leftpad=None,
        block_table=None,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        rotary_interleaved=True,
        alibi_slopes=None,
        num_splits=0,
        return_softmax_lse=False,
    ):
        self.calls.append(
            dict(
                q=q,
                k_cache=k_cache,
                cache_seqlens=cache_seqlens,
                block_table=block_table,
                softmax_scale=softmax_scale,
                causal=causal,
                window_size=window_size,
                softcap=softcap,
                extra=(k, v, rotary_cos, cache_batch_idx, cache_leftpad, alibi_slopes),
            )
        )
        # The real function's checks (flash_attn_interface.py asserts, flash_api.cpp TORCH_CHECKs).
        assert k is None and v is None and cache_batch_idx is None and cache_leftpad is None
        assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
        assert q.dim() == 4 and q.stride(-1) == 1
        assert q.dtype == k_cache.dtype == v_cache.dtype
        batch, seqlen_q, num_heads, head_dim = q.shape
        _, page, num_kv_heads, cache_dim = k_cache.shape
        assert v_cache.shape == k_cache.shape and cache_dim == head_dim
        assert page % self.page_multiple == 0, "Paged KV cache block size must be divisible by 256"
        assert num_heads % num_kv_heads == 0
        assert block_table.dtype == torch.int32 and block_table.stride(-1) == 1
        assert block_table.shape[0] == batch
        assert isinstance(cache_seqlens, torch.Tensor)
        assert cache_seqlens.dtype == torch.int32 and cache_seqlens.is_contiguous()
        assert cache_seqlens.shape == (batch,)
        assert isinstance(window_size, tuple) and len(window_size) == 2
        assert all(isinstance(w, int) for w in window_size)
        assert isinstance(softmax_scale, float) and isinstance(softcap, float)

        left, right = window_size
        if causal:
            right = 0
        group = num_heads // num_kv_heads
        out = torch.zeros(batch, seqlen_q, num_heads, head_dim, dtype=torch.float32)
        for b in range(batch):
            n = int(cache_seqlens[b])
            if n == 0:
                continue
            used = block_table[b, : -(-n // page)].long()
            keys = k_cache[used].reshape(-1, num_kv_heads, head_dim)[:n].float()
            values = v_cache[used].reshape(-1, num_kv_heads, head_dim)[:n].float()
            keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, n, D]
            values = values.repeat_interleave(group, dim=1).transpose(0, 1)
            scores = q[b].float().transpose(0, 1) @ keys.transpose(1, 2) * softmax_scale  # [H, sq, n]
            if softcap > 0:
                scores = softcap * torch.tanh(scores / softcap)
            # Query i sits at i + n - seqlen_q (bottom-right alignment); it sees keys in
            # [pos - left, pos + right], -1 meaning unbounded.
            pos = torch.arange(seqlen_q)[:, None] + n - seqlen_q
            j = torch.arange(n)[None, :]
            visible = torch.ones(seqlen_q, n, dtype=torch.bool)
            if left >= 0:
                visible &= j >= pos - left
            if right >= 0:
                visible &= j <= pos + right
            scores = scores.masked_fill(~visible, float("-inf"))
            probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an empty row gives zeros
            out[b] = (probs @ values).transpose(0, 1)
        return out.to(q.dtype)


class FakeFlashVarlen:
    """``flash_attn_varlen_func`` with a ``block_table`` (paged K/V) in plain torch, from its
    docstring: causal masks aligned to the bottom right, ``window_size`` keys either side, soft-cap;
    records the arguments of every call."""

    def __init__(self, page_multiple: int = 256) -> None:
        self.page_multiple = page_multiple
        self.calls: list[dict] = []

    def __call__(
        self,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
        block_table=None,
    ):
        self.calls.append(
            dict(
                q=q,
                k=k,
                cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k,
                max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k,
                softmax_scale=softmax_scale,
                causal=causal,
                window_size=window_size,
                softcap=softcap,
                block_table=block_table,
            )
        )
        # flash_api.cpp's mha_varlen_fwd checks for a paged cache.
        assert dropout_p == 0.0 and alibi_slopes is None and not return_attn_probs
        assert q.dim() == 3 and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
        assert q.dtype == k.dtype == v.dtype
        total_q, num_heads, head_dim = q.shape
        _, page, num_kv_heads, cache_dim = k.shape
        assert v.shape == k.shape and cache_dim == head_dim and num_heads % num_kv_heads == 0
        assert page % self.page_multiple == 0, "Paged KV cache block size must be divisible by 256"
        batch = cu_seqlens_q.numel() - 1
        for t in (cu_seqlens_q, cu_seqlens_k):
            assert t.dtype == torch.int32 and t.is_contiguous() and t.shape == (batch + 1,)
        assert (
            block_table.dtype == torch.int32 and block_table.stride(-1) == 1 and block_table.shape[0] == batch
        )
        assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
        assert isinstance(softmax_scale, float) and isinstance(softcap, float)
        assert isinstance(window_size, tuple) and all(isinstance(w, int) for w in window_size)

        left, right = window_size
        if causal:
            right = 0
        group = num_heads // num_kv_heads
        out = torch.zeros(total_q, num_heads, head_dim, dtype=torch.float32)
        for b in range(batch):
            lo, hi = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
            n = int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
            assert hi - lo <= max_seqlen_q and n <= max_seqlen_k
            used = block_table[b, : -(-n // page)].long()
            keys = k[used].reshape(-1, num_kv_heads, head_dim)[:n].float().repeat_interleave(group, dim=1)
            values = v[used].reshape(-1, num_kv_heads, head_dim)[:n].float().repeat_interleave(group, dim=1)
            scores = q[lo:hi].float().transpose(0, 1) @ keys.permute(1, 2, 0) * softmax_scale  # [H, sq, n]
            if softcap > 0:
                scores = softcap * torch.tanh(scores / softcap)
            pos = torch.arange(hi - lo)[:, None] + n - (hi - lo)
            j = torch.arange(n)[None, :]
            visible = torch.ones(hi - lo, n, dtype=torch.bool)
            if left >= 0:
                visible &= j >= pos - left
            if right >= 0:
                visible &= j <= pos + right
            probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
            out[lo:hi] = (probs @ values.transpose(0, 1)).transpose(0, 1)
        return out.to(q.dtype)


def _varlen_without_block_table(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs):
    raise AssertionError("a flash-attn without paged varlen must not be called")


def install(monkeypatch, page_multiple: int = 256, version: str = "2.8.3", varlen="paged") -> FakeFlash:
    """Installs a :class:`FakeFlash` as ``flash_attn`` (through ``monkeypatch``) and re-probes
    ``flash_ops``.  ``varlen``: the paged ``flash_attn_varlen_func`` fake (default, as
    ``FakeFlash.varlen``), ``"unpaged"`` (an older signature without ``block_table``) or None."""
    fake = FakeFlash(page_multiple)
    module = types.ModuleType("flash_attn")
    module.__version__ = version
    module.flash_attn_with_kvcache = fake
    fake.varlen = FakeFlashVarlen(page_multiple) if varlen == "paged" else None
    if varlen is not None:
        module.flash_attn_varlen_func = fake.varlen or _varlen_without_block_table
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    state = flash_ops._probe()
    monkeypatch.setattr(flash_ops, "_FLASH", state)
    monkeypatch.setattr(flash_ops, "HAS_FLASH_ATTN", state.fn is not None)
    monkeypatch.setattr(flash_ops, "PAGE_BLOCK_MULTIPLE", page_multiple)
    return fake
