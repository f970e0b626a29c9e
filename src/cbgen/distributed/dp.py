"""Data parallelism under ``torch.distributed``: one engine per replica, each generating its share.

Errors reach every rank.  A rank that raised and left the collectives would leave the others waiting
in theirs until the process group's timeout (30 minutes by default), or until its process exits; and
a rank that caught its error and called again would pair its next collective with the others' old
one.  So :func:`generate_dp` never leaves a collective early: every rank checks the whole call the way
``LLM.generate`` does (the same checks on every rank, before any collective), the ranks exchange
an ok/error status, and the outputs exchange carries a generation error in place of outputs.  Where
any rank failed, every rank raises the same exception (the failing rank's type and message, naming
that rank, its traceback attached as a note), and the next call starts with the ranks in step.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cbgen.topology import topology_of


@dataclass(frozen=True)
class RankFailure:
    """An exception of one rank, as plain data every rank can rebuild (a pickled exception may not
    unpickle on the others, and its class may not be importable there)."""

    rank: int
    module: str
    qualname: str
    message: str
    traceback: str

    @classmethod
    def of(cls, rank: int, exc: BaseException) -> RankFailure:
        """The failure ``exc`` of ``rank``."""
        kind = type(exc)
        text = "".join(traceback.format_exception(exc))
        return cls(rank, kind.__module__, kind.__qualname__, str(exc), text)

    def exception(self, message: str, source: str) -> Exception:
        """The failing rank's exception class with ``message`` (RuntimeError where this process has
        not loaded that class or it takes more than a message), ``source``'s traceback attached."""
        kind: Any = sys.modules.get(self.module)
        for part in self.qualname.split("."):
            kind = getattr(kind, part, None)
        if not (isinstance(kind, type) and issubclass(kind, Exception)):
            kind = RuntimeError
        try:
            error = kind(message)
        except Exception:
            error = RuntimeError(message)
        if hasattr(error, "add_note"):  # Python 3.11+
            error.add_note(f"{source}'s traceback:\n{self.traceback}")
        return error


def raise_failures(failures: Sequence[RankFailure | None], what: str) -> None:
    """Raises, identically on every rank that calls it with the same ``failures``, the lowest
    failing rank's exception (its type where it can be rebuilt from a message, else RuntimeError);
    the message names the failing ranks.  Does nothing when no rank failed."""
    failed = sorted((f for f in failures if f is not None), key=lambda f: f.rank)
    if not failed:
        return
    first = failed[0]
    ranks = ", ".join(str(f.rank) for f in failed)
    message = f"{what} failed on rank{'s' if len(failed) > 1 else ''} {ranks}: {first.message}"
    if len(failed) > 1:
        message += f" (rank {first.rank}'s error)"
    raise first.exception(message, f"rank {first.rank}")


def check_inputs(llm: Any, prompts: Any, params: Any) -> tuple[list, list]:
    """The prompts as a list and one ``SamplingParams`` per prompt, after every check
    ``LLM.generate`` makes before it runs anything (its messages): ``ValueError`` on a bad input."""
    if isinstance(prompts, str) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
    ):
        prompts = [prompts]  # one prompt, as LLM.generate takes it
    prompts = list(prompts)
    per_prompt = llm._params_list(params, len(prompts))
    for prompt, p in zip(prompts, per_prompt):
        ids, _ = llm._encode(prompt)
        llm.engine.validate(ids, p)
    return prompts, per_prompt


def _all_gather(value: Any, group: Any) -> list:
    gathered: list = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(gathered, value, group=group)
    return gathered


def generate_dp(
    llm: Any, prompts: Sequence[Any], params: Any = None, group: Any = None, **kwargs: Any
) -> list:
    """Every data-parallel replica generates a share of ``prompts`` (round-robin, so long and short
    prompts spread evenly); every rank returns all outputs, in input order.

    ``llm`` is this rank's :class:`cbgen.LLM`.  ``group`` is the data-parallel process group (default:
    every rank).  With tensor parallelism each tensor-parallel group is one replica: call this on
    every rank with the same arguments (the ranks of a group generate the same share in lockstep).
    ``params`` is one ``SamplingParams`` or one per prompt; ``kwargs`` go to ``llm.generate``.
    Without ``torch.distributed`` this is just ``llm.generate``.

    An exception on any rank (a bad input, found before anything runs, or an error while generating)
    is raised on every rank, the same type and message, naming the rank (module docstring); the
    ranks stay in step for the next call.
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return llm.generate(prompts, params, **kwargs)
    rank = dist.get_rank()
    root, failure = None, None
    try:
        prompts, per_prompt = check_inputs(llm, prompts, params)
        root = topology_of(llm.model).tp_ranks[0]
    except Exception as exc:
        failure = RankFailure.of(rank, exc)
    statuses = _all_gather((root, failure), group)
    raise_failures([f for _, f in statuses], "generate_dp")

    replicas = sorted({r for r, _ in statuses})
    replica, count = replicas.index(root), len(replicas)
    mine = list(range(replica, len(prompts), count))
    outputs, failure = [], None
    if mine:
        try:
            outputs = llm.generate([prompts[i] for i in mine], [per_prompt[i] for i in mine], **kwargs)
        except Exception as exc:  # sent instead of outputs: leaving the collective would hang the others
            outputs, failure = [], RankFailure.of(rank, exc)
    gathered = _all_gather((mine, outputs, failure), group)
    raise_failures([f for _, _, f in gathered], "generate_dp")

    result: list = [None] * len(prompts)
    for indices, outs, _ in gathered:  # the ranks of one tensor-parallel group send the same outputs
        for i, out in zip(indices, outs):
            result[i] = out
    return result
