"""cbgen's C kernels for the state mixers' arithmetic, swapped in for the engine's own forwards only.

transformers' mixers call module-level functions for their arithmetic; Gated DeltaNet (Qwen3.5,
Qwen3-Next, OLMo-Hybrid) decodes through ``torch_recurrent_gated_delta_rule``, whose torch version
makes about eight passes over every head's float32 state a token in separate ops, on states the cache
object gathered from the slots and scatters back.  That was three quarters of a Qwen3.5 decode step
on CPU.  The C kernel (:func:`cbgen.model.kernels.cpu.state_ops.gdn_recurrent`) updates each slot in
place in two passes and computes the same bits as the torch function (same products, same order of
additions: ``csrc/cpu_state.c``), so tokens and logprobs do not change with it.

The swap is scoped like every other view of the user's model (:mod:`cbgen.model.thread_view`): for
the engine's thread, during one decode forward, the mixers' module calls the kernel; every other
thread (a trainer's forward or backward beside the engine) calls transformers' function, and nothing
stays replaced after the engine closes.  :func:`choose` is the one place that decides whether it
runs; ``CBGEN_STATE_KERNELS=0`` keeps transformers' functions (to compare, or to rule the kernel out).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from cbgen import envs
from cbgen.model import thread_view
from cbgen.model.cache_groups import CacheLayout
from cbgen.model.kernels.cpu import ops as cpu_kernels
from cbgen.model.kernels.cpu.state_ops import gdn_recurrent
from cbgen.model.state_cache import StepStates

GDN_RECURRENT = "torch_recurrent_gated_delta_rule"


@dataclass(frozen=True)
class StateKernels:
    """The mixer functions the engine's decode forwards replace: ``modules``, whose global
    ``torch_recurrent_gated_delta_rule`` runs the C kernel for the mixers of ``layers``."""

    modules: tuple[ModuleType, ...] = ()
    layers: frozenset[int] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.layers)


def _gdn_mixers(model: nn.Module) -> list[nn.Module]:
    """Modules whose forward calls their modeling file's recurrent gated delta rule by name."""
    found = []
    for m in model.modules():
        # Through transformers' decorators to the forward's own code.
        forward = getattr(inspect.unwrap(type(m).forward), "__code__", None)
        module = sys.modules.get(type(m).__module__)
        if forward is None or module is None or not isinstance(getattr(m, "layer_idx", None), int):
            continue
        if GDN_RECURRENT in forward.co_names and callable(module.__dict__.get(GDN_RECURRENT)):
            found.append(m)
    return found


def choose(model: nn.Module, cache: CacheLayout, device: torch.device) -> tuple[StateKernels, str]:
    """Which mixer functions the engine replaces with C kernels, and why (or why none)."""
    recurrent = {
        layer: group.dtype
        for group in cache.state_groups
        if group.name.startswith("recurrent")
        for layer in group.layers
    }
    if not recurrent:
        return StateKernels(), ""
    mixers = [m for m in _gdn_mixers(model) if m.layer_idx in recurrent]
    if not mixers:
        return StateKernels(), "transformers' functions (no mixer with a cbgen kernel)"
    if device.type != "cpu":
        return StateKernels(), f"transformers' functions (the C kernels run on the CPU, not {device.type})"
    if envs.get("CBGEN_STATE_KERNELS") == "0":
        return StateKernels(), "transformers' functions (CBGEN_STATE_KERNELS=0)"
    if not cpu_kernels.available():
        return (
            StateKernels(),
            f"transformers' functions (C kernels unavailable: {cpu_kernels.unavailable_reason()})",
        )
    if any(recurrent[m.layer_idx] != torch.float32 for m in mixers):
        return StateKernels(), "transformers' functions (the C kernel keeps float32 states)"
    modules = tuple({id(mod): mod for mod in (sys.modules[type(m).__module__] for m in mixers)}.values())
    kernels = StateKernels(modules, frozenset(m.layer_idx for m in mixers))
    return kernels, (
        f"Gated DeltaNet decode of {len(kernels.layers)} layers in C on the state slots in place "
        "(the torch function's bits; cbgen.model.state_kernels)"
    )


def hold(kernels: StateKernels, holder: thread_view.Hold) -> None:
    """Keeps the per-thread dispatch of the replaced functions installed while ``holder`` lives."""
    for module in kernels.modules:
        holder.function(module, GDN_RECURRENT)


@contextlib.contextmanager
def engaged(kernels: StateKernels, states: StepStates) -> Iterator[None]:
    """For this thread and the block: the mixers' recurrent gated delta rule runs the C kernel on
    ``states``' slots (only for the stand-ins ``states`` hands out; anything else goes to the
    function as it is)."""
    if not kernels:
        yield
        return

    def rule(original: Any, *args: Any, **kwargs: Any) -> Any:
        return _gdn_recurrent(states, original, *args, **kwargs)

    with contextlib.ExitStack() as stack:
        for module in kernels.modules:
            stack.enter_context(thread_view.function(module, GDN_RECURRENT, rule))
        yield


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
