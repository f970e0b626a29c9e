"""Trainer parity: generation whose ``raw_logprobs`` equal, bit for bit, the trainer's own forward.

The engine side is ``LLM(..., batch_invariant=True)`` (the execution plan's parity plan,
:mod:`cbgen.model.plan`); the trainer side is :func:`parity` and :func:`token_logprobs`, exported as
``cbgen.parity`` and ``cbgen.token_logprobs`` (also ``cbgen.parity.token_logprobs``).  See
docs/rl.md, "Trainer parity".

Modules: :mod:`~cbgen.batch_invariant.dispatch` (the dispatch mode both sides run under),
:mod:`~cbgen.batch_invariant.tiled_matmul` and :mod:`~cbgen.batch_invariant.lanes` (what it does
to matrix products and transcendental functions), :mod:`~cbgen.batch_invariant.attention_core`
(the torch form of the attention both sides compute), :mod:`~cbgen.batch_invariant.native` (whether
the C parity kernels or the torch forms run), :mod:`~cbgen.batch_invariant.packs` (the engine's
packed weights), :mod:`~cbgen.batch_invariant.trainer_attention` (the trainer side's attention,
registered with transformers), :mod:`~cbgen.batch_invariant.context` (the trainer context),
:mod:`~cbgen.batch_invariant.logprobs` (the log-softmaxes both sides use) and
:mod:`~cbgen.batch_invariant.behaviour` (processed logprobs from the kept-set record,
``cbgen.processed_logprobs``); :mod:`~cbgen.batch_invariant.kernels` holds the bindings of the
parity kernels themselves (C and Triton).

This package sits between two parts of ``cbgen.model``: it uses the kernels, attention and
per-thread views below it, and the plan, the runner, the backends and the start-up checks above it
choose and run it.  Nothing in ``model.kernels`` imports it (``tests/test_layering.py``).
"""

from cbgen.batch_invariant.behaviour import processed_logprobs
from cbgen.batch_invariant.context import parity
from cbgen.batch_invariant.logprobs import token_logprobs

# ``cbgen.parity.token_logprobs``: the helper next to the context it goes with.
parity.token_logprobs = token_logprobs  # type: ignore[attr-defined]

__all__ = ["parity", "processed_logprobs", "token_logprobs"]
