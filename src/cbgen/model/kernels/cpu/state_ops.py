"""The state mixers' C kernels (``csrc/cpu_state.c``), each checking its arguments before calling in.

:func:`gdn_recurrent` is the gated delta rule's recurrent form on state slots in place; which
mixers call it, and when, is :mod:`cbgen.model.state_kernels`' business.
"""

from __future__ import annotations

import torch

from cbgen.model.kernels.cpu.ops import library

# torch sums float32 over a non-contiguous dimension in blocks of 4 vectors of this many lanes (its
# sum kernel is dispatched at AVX2 width on every x86 build, AVX-512 included); lanes past the last
# block add in another order (csrc/cpu_state.c), which the kernel is told by where the blocks end.
_TORCH_SUM_LANES = 8


def torch_sum_split(width: int) -> int:
    """Where the lanes that torch sums as blocks end, for a sum over rows of ``width`` lanes."""
    if width >= _TORCH_SUM_LANES:
        return width // (4 * _TORCH_SUM_LANES) * (4 * _TORCH_SUM_LANES)
    return width // 4 * 4  # narrower rows: torch's scalar loop, also in blocks of 4 lanes


def _fail(name: str, want: str, t: torch.Tensor) -> ValueError:
    return ValueError(f"gdn_recurrent: {name} must be {want}, got {tuple(t.shape)} {t.dtype} on {t.device}")


def gdn_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """The gated delta rule over ``T`` tokens of ``B`` rows, one token at a time, on the rows' states
    ``states[slots]`` in place; returns the outputs ``[B, H, T, dv]``.

    All float32, contiguous, on the CPU: ``q``, ``k`` ``[B, Hk, T, dk]`` (as the rule takes them:
    normalised, ``q`` scaled), ``v`` ``[B, H, T, dv]``, ``decay`` (``exp(g)``) and ``beta``
    ``[B, H, T]``, ``states`` ``[num_slots, H, dk, dv]``; ``slots`` ``[B]`` int64, distinct (the C
    kernel checks their values).  Value head ``h`` reads query/key head ``h // (H // Hk)``.
    """
    if v.dim() != 4:
        raise _fail("v", "[B, H, T, dv]", v)
    b, h, t, dv = v.shape
    if k.dim() != 4 or k.shape[0] != b or k.shape[2] != t or k.shape[1] == 0 or h % k.shape[1]:
        raise _fail("k", f"[{b}, Hk, {t}, dk] with Hk dividing {h}", k)
    hk, dk = k.shape[1], k.shape[3]
    want = {"q": (q, (b, hk, t, dk)), "k": (k, (b, hk, t, dk)), "v": (v, (b, h, t, dv))}
    want |= {"decay": (decay, (b, h, t)), "beta": (beta, (b, h, t))}
    for name, (tensor, shape) in want.items():
        if tuple(tensor.shape) != shape or tensor.dtype != torch.float32 or not tensor.is_contiguous():
            raise _fail(name, f"a contiguous float32 {list(shape)}", tensor)
    if states.dim() != 4 or tuple(states.shape[1:]) != (h, dk, dv) or states.dtype != torch.float32:
        raise _fail("states", f"float32 [num_slots, {h}, {dk}, {dv}]", states)
    if not states.is_contiguous():
        raise _fail("states", "contiguous", states)
    if slots.shape != (b,) or slots.dtype != torch.int64 or not slots.is_contiguous():
        raise _fail("slots", f"a contiguous int64 [{b}]", slots)
    for name, tensor in (("q", q), ("states", states), ("slots", slots)):
        if tensor.device.type != "cpu":
            raise _fail(name, "on the CPU", tensor)
    out = torch.empty((b, h, t, dv), dtype=torch.float32)
    rc = library().cbgen_gdn_recurrent(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        decay.data_ptr(),
        beta.data_ptr(),
        states.data_ptr(),
        states.shape[0],
        slots.data_ptr(),
        out.data_ptr(),
        b,
        h,
        hk,
        t,
        dk,
        dv,
        torch_sum_split(dv),
    )
    if rc == 2:
        raise ValueError(
            f"gdn_recurrent: slots {slots.tolist()} must be distinct and below {states.shape[0]}"
        )
    if rc:
        raise ValueError(
            f"gdn_recurrent: the kernel refused its sizes (rc {rc}): q {tuple(q.shape)}, v {tuple(v.shape)}"
        )
    return out
