"""Data parallelism under ``torch.distributed``: one engine per replica, each generating its share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from cbgen.distributed.topology import topology_of


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
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return llm.generate(list(prompts), params, **kwargs)
    root = topology_of(llm.model).tp_ranks[0]
    roots: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(roots, root, group=group)
    replicas = sorted(set(roots))
    replica, count = replicas.index(root), len(replicas)
    mine = list(range(replica, len(prompts), count))
    per_prompt = list(params) if isinstance(params, (list, tuple)) else None
    local_params = [per_prompt[i] for i in mine] if per_prompt is not None else params
    outputs = llm.generate([prompts[i] for i in mine], local_params, **kwargs) if mine else []
    gathered: list = [None] * len(roots)
    dist.all_gather_object(gathered, (mine, outputs), group=group)
    result: list = [None] * len(prompts)
    for indices, outs in gathered:  # the ranks of one tensor-parallel group send the same outputs
        for i, out in zip(indices, outs):
            result[i] = out
    return result
