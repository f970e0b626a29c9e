"""cbgen's C kernels for the state mixers' arithmetic, swapped in for the engine's own forwards only.

transformers' mixers call module-level functions for their arithmetic; Gated DeltaNet (Qwen3.5,
Qwen3-Next, OLMo-Hybrid) decodes through ``torch_recurrent_gated_delta_rule``, whose torch version
makes about eight passes over every head's float32 state a token in separate ops, on states the cache
object gathered from the slots and scatters back.  That was three quarters of a Qwen3.5 decode step
on CPU.  The C kernel (:func:`cbgen.model.kernels.cpu.state_ops.gdn_recurrent`) updates each slot in
place in two passes and computes the same bits as the torch function (same products, same order of
additions: ``csrc/cpu_state.c``), so tokens and logprobs do not change with it.  The same goes for
the convolution's decode step (``causal_conv1d_update``: a gathered window, a concatenation, a
copy and a oneDNN depthwise convolution per call; :func:`~cbgen.model.kernels.cpu.state_ops.conv_update`).

The swap is scoped like every other view of the user's model (:mod:`cbgen.model.thread_view`): for
the engine's thread, during one decode forward, the mixers' module calls the kernel; every other
thread (a trainer's forward or backward beside the engine) calls transformers' function, and nothing
stays replaced after the engine closes.  :func:`choose` is the one place that decides whether it
runs; ``CBGEN_STATE_KERNELS=0`` keeps transformers' functions (to compare, or to rule the kernel out).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn
from transformers.activations import ACT2FN

from cbgen import envs
from cbgen.model import thread_view
from cbgen.model.cache_groups import CacheLayout
from cbgen.model.kernels.cpu import ops as cpu_kernels
from cbgen.model.kernels.cpu.state_ops import conv_update, gdn_recurrent
from cbgen.model.state_cache import StepStates

GDN_RECURRENT = "torch_recurrent_gated_delta_rule"
CONV_UPDATE = "causal_conv1d_update"
# Each function the engine swaps, and the state its kernel updates in the slots.
_STATE_OF = {GDN_RECURRENT: "recurrent0", CONV_UPDATE: "conv0"}


@dataclass(frozen=True)
class StateKernels:
    """The mixer functions the engine's decode forwards replace: ``swaps``, (modeling module,
    function name) pairs, and ``in_place``, the states (name, layer) their kernels update in the
    slots (:class:`StepStates` hands the mixers stand-ins for those)."""

    swaps: tuple[tuple[ModuleType, str], ...] = ()
    in_place: frozenset[tuple[str, int]] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.in_place)

    def describe(self) -> str:
        """The swapped functions in words."""
        names = {"torch_recurrent_gated_delta_rule": "Gated DeltaNet", "causal_conv1d_update": "convolution"}
        layers = {
            name: sum(1 for state, _ in self.in_place if state == _STATE_OF[name]) for _, name in self.swaps
        }
        return ", ".join(f"{names[name]} ({count} layers)" for name, count in layers.items())


def _calls(m: nn.Module) -> tuple[ModuleType | None, tuple[str, ...]]:
    """The modeling module of ``m``'s class, and the global names its forward's own code uses
    (through transformers' decorators)."""
    code = getattr(inspect.unwrap(type(m).forward), "__code__", None)
    return sys.modules.get(type(m).__module__), (code.co_names if code is not None else ())


def choose(model: nn.Module, cache: CacheLayout, device: torch.device) -> tuple[StateKernels, str]:
    """Which mixer functions the engine replaces with C kernels, and why (or why none): a mixer
    whose forward calls one by name, on the CPU, with the kernels built and a float32 state."""
    dtypes = {(group.name, layer): group.dtype for group in cache.state_groups for layer in group.layers}
    if not dtypes:
        return StateKernels(), ""
    swaps: dict[tuple[int, str], tuple[ModuleType, str]] = {}
    in_place = set()
    for m in model.modules():
        layer = getattr(m, "layer_idx", None)
        module, names = _calls(m)
        if module is None or not isinstance(layer, int):
            continue
        for name, state in _STATE_OF.items():
            if (
                name in names
                and callable(module.__dict__.get(name))
                and dtypes.get((state, layer)) == torch.float32
            ):
                swaps[(id(module), name)] = (module, name)
                in_place.add((state, layer))
    if not in_place:
        return StateKernels(), "transformers' functions (no mixer with a cbgen kernel and a float32 state)"
    if device.type != "cpu":
        return StateKernels(), f"transformers' functions (the C kernels run on the CPU, not {device.type})"
    if envs.get("CBGEN_STATE_KERNELS") == "0":
        return StateKernels(), "transformers' functions (CBGEN_STATE_KERNELS=0)"
    if not cpu_kernels.available():
        return (
            StateKernels(),
            f"transformers' functions (C kernels unavailable: {cpu_kernels.unavailable_reason()})",
        )
    kernels = StateKernels(tuple(swaps.values()), frozenset(in_place))
    return kernels, (
        f"decode steps of {kernels.describe()} in C on the state slots in place "
        "(the torch functions' bits; cbgen.model.state_kernels)"
    )


def hold(kernels: StateKernels, holder: thread_view.Hold) -> None:
    """Keeps the per-thread dispatch of the replaced functions installed while ``holder`` lives."""
    for module, name in kernels.swaps:
        holder.function(module, name)


@contextlib.contextmanager
def engaged(kernels: StateKernels, states: StepStates) -> Iterator[None]:
    """For this thread and the block: the swapped functions run their C kernels on ``states``'
    slots (only for the stand-ins ``states`` hands out; anything else goes to the function as it
    is)."""
    if not kernels:
        yield
        return
    kernel_of = {GDN_RECURRENT: _gdn_recurrent, CONV_UPDATE: _conv_update}
    with contextlib.ExitStack() as stack:
        for module, name in kernels.swaps:
            stack.enter_context(
                thread_view.function(module, name, functools.partial(kernel_of[name], states))
            )
        yield


def _conv_update(
    states: StepStates,
    original: Any,
    hidden_states: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """transformers' ``causal_conv1d_update`` (same arguments and result) for a conv state that is a
    :class:`StepStates` stand-in: the C kernel convolves and moves the window in the slots, the
    activation is transformers' own."""
    target = states.in_place_target(conv_state)
    if target is None:
        return original(hidden_states, conv_state, weight, bias, activation, **kwargs)
    pool, slots = target
    rows, channels, tokens = hidden_states.shape
    # One channel is no depthwise convolution for oneDNN (another order); other token counts and
    # dtypes are outside what the kernel follows too: transformers' function on gathered states.
    if tokens != 1 or channels < 2 or {weight.dtype, hidden_states.dtype} != {torch.float32}:
        gathered = pool.index_select(0, slots)
        out = original(hidden_states, gathered, weight, bias, activation, **kwargs)
        pool.index_copy_(0, slots, gathered)
        return out
    bias = None if bias is None else bias.to(torch.float32).contiguous()
    out = conv_update(hidden_states.view(rows, channels), pool, slots, weight.contiguous(), bias)
    if activation is None:
        return out.view(rows, channels, 1)
    # transformers activates the last column of a conv output as long as the kept inputs allow; an
    # activation's bits depend on its input's layout (vector or scalar loop), so it gets the same one.
    width = pool.shape[-1] - weight.shape[-1] + 2
    if width == 1:
        return ACT2FN[activation](out.view(rows, channels, 1))
    full = out.new_empty((rows, channels, width))
    full[:, :, -1] = out
    return ACT2FN[activation](full[:, :, -1:])


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _gdn_recurrent(
    states: StepStates,
    original: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' recurrent gated delta rule (same arguments and results), for a state that is a
    :class:`StepStates` stand-in: the C kernel updates the slots, and the stand-in is the final state
    (``update_recurrent_state`` recognises it).  The inputs are prepared with the same torch ops
    the function applies (float32 ``[B, H, T, d]``, l2-normalised, the query scaled by ``dk ** -0.5``,
    the decay exponentiated a token at a time), so the kernel sees the function's values."""
    target = states.in_place_target(initial_state)
    if target is None:
        return original(
            query,
            key,
            value,
            g=g,
            beta=beta,
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            **kwargs,
        )
    pool, slots = target
    if value.shape[-1] == 1:
        # One value lane: torch sums it as a contiguous row, in an order the kernel does not follow.
        out, final = original(
            query,
            key,
            value,
            g=g,
            beta=beta,
            initial_state=pool.index_select(0, slots),
            output_final_state=True,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            **kwargs,
        )
        pool.index_copy_(0, slots, final)
        return out, (initial_state if output_final_state else None)
    q, k, v, decay, beta = (
        x.transpose(1, 2).to(torch.float32).contiguous() for x in (query, key, value, g, beta)
    )
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    q = q / (q.shape[-1] ** 0.5)
    tokens = decay.shape[-1]
    decay = torch.stack([decay[:, :, t].exp() for t in range(tokens)], dim=-1)
    out = gdn_recurrent(q, k, v, decay, beta, pool, slots)
    out = out.transpose(1, 2).contiguous().to(query.dtype)
    return out, (initial_state if output_final_state else None)
