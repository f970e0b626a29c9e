"""The state mixers' C kernels (``csrc/cpu_state.c``), each checking its arguments before calling in.

:func:`gdn_recurrent` (the gated delta rule's recurrent form) and :func:`conv_update` (a causal
convolution's step) update state slots in place; which mixers call them, and when, is
:mod:`cbgen.model.state_kernels`' business.
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


def conv_update(
    x: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token of a causal depthwise convolution (``bias`` ``[C]`` or none), on the rows' kept inputs
    ``states[slots]`` in place (the window moves by ``x``); returns the convolution ``[B, C]``
    before any activation.

    float32 on the CPU: ``x`` ``[B, C]`` with unit column stride, ``states`` contiguous
    ``[num_slots, C, width]`` (each channel's last ``width >= K - 1`` inputs), ``weight`` contiguous
    ``[C, K]``; ``slots`` ``[B]`` int64, distinct (the C kernel checks their values)."""
    if (
        weight.dim() != 2
        or weight.dtype != torch.float32
        or not weight.is_contiguous()
        or weight.shape[1] < 2
    ):
        raise ValueError(
            f"conv_update: weight must be a contiguous float32 [C, K >= 2], got {tuple(weight.shape)}"
        )
    c, k = weight.shape
    if x.dim() != 2 or x.shape[1] != c or x.dtype != torch.float32 or x.stride(1) != 1:
        raise ValueError(
            f"conv_update: x must be float32 [B, {c}] with unit column stride, got {tuple(x.shape)}"
        )
    b = x.shape[0]
    if (
        states.dim() != 3
        or states.shape[1] != c
        or not k - 1 <= states.shape[2] <= 64
        or states.dtype != torch.float32
        or not states.is_contiguous()
    ):
        raise ValueError(
            f"conv_update: states must be a contiguous float32 [num_slots, {c}, {k - 1}..64], got {tuple(states.shape)}"
        )
    if slots.shape != (b,) or slots.dtype != torch.int64 or not slots.is_contiguous():
        raise ValueError(
            f"conv_update: slots must be a contiguous int64 [{b}], got {tuple(slots.shape)} {slots.dtype}"
        )
    if bias is not None and (bias.shape != (c,) or bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise ValueError(
            f"conv_update: bias must be a contiguous float32 [{c}], got {tuple(bias.shape)} {bias.dtype}"
        )
    if any(t.device.type != "cpu" for t in (x, states, slots, weight, *([] if bias is None else [bias]))):
        raise ValueError("conv_update: every tensor must be on the CPU")
    out = torch.empty((b, c), dtype=torch.float32)
    rc = library().cbgen_conv_update(
        x.data_ptr(),
        max(x.stride(0), c),
        states.data_ptr(),
        states.shape[0],
        slots.data_ptr(),
        states.shape[2],
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        b,
        c,
        k,
    )
    if rc == 2:
        raise ValueError(f"conv_update: slots {slots.tolist()} must be distinct and below {states.shape[0]}")
    if rc:
        raise ValueError(
            f"conv_update: the kernel refused its sizes (rc {rc}): x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    return out
