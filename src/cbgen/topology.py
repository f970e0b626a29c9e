"""Where this process sits: its tensor-parallel group (from the model's own device mesh) and the
data-parallel replica it belongs to.

cbgen writes no distributed runtime: tensor parallelism is transformers' (DTensor over
``torch.distributed``), ranks come from ``torchrun`` (or any launcher that initialises
``torch.distributed``), and replicas are whatever the user runs side by side.  This module only
reads that state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def _dist_on() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _dtensor_param(model: torch.nn.Module) -> Any:
    for p in model.parameters():
        if hasattr(p, "device_mesh") and hasattr(p, "placements"):
            return p
    return None


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether transformers' tensor parallelism split the model's parameters (DTensors): its forward
    then needs every rank, so nothing may run it on one rank alone."""
    return _dtensor_param(model) is not None


@dataclass(frozen=True)
class Topology:
    """One process's place among the ranks.  ``tp_ranks`` are the global ranks of its
    tensor-parallel group (root first); a process without tensor parallelism is its own group."""

    rank: int = 0
    world_size: int = 1
    tp_ranks: tuple[int, ...] = (0,)
    tp_group: Any = None  # the model's TP process group (its own collectives run there)

    @property
    def tp_size(self) -> int:
        """Ranks in the tensor-parallel group."""
        return len(self.tp_ranks)

    @property
    def is_tp_root(self) -> bool:
        """Whether this rank decides for its tensor-parallel group (its lowest rank)."""
        return self.rank == self.tp_ranks[0]

    @property
    def replica(self) -> int:
        """A number unique to this tensor-parallel group (its root's global rank): what makes data-
        parallel replicas sample differently while the ranks of one group agree."""
        return self.tp_ranks[0]


def topology_of(model: torch.nn.Module) -> Topology:
    """The topology of a process running ``model``: its TP group is the mesh of the model's sharded
    (DTensor) parameters, if any.  Without ``torch.distributed`` everything is rank 0 of 1."""
    if not _dist_on():
        return Topology()
    dist = torch.distributed
    rank, world = dist.get_rank(), dist.get_world_size()
    param = _dtensor_param(model)
    if param is None:
        return Topology(rank, world, (rank,))
    mesh = param.device_mesh
    if mesh.ndim != 1:
        names = mesh.mesh_dim_names or ()
        if "tp" not in names:
            raise ValueError(f"cbgen runs tensor-parallel models on a 1-D or 'tp'-named mesh, got {mesh}")
        mesh = mesh["tp"]
    group = mesh.get_group()
    ranks = tuple(sorted(dist.get_process_group_ranks(group)))
    if len(ranks) == 1:
        return Topology(rank, world, ranks)
    return Topology(rank, world, ranks, group)


def local_kv_heads(model: torch.nn.Module, num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """How many KV heads the attention function of this rank receives: all of them without tensor
    parallelism; the rank's share when transformers split the heads (k_proj/v_proj column-wise).
    Raises ``ValueError`` for a plan cbgen cannot cache: heads that do not divide by the group size,
    or K/V projections that are not split by heads."""
    param = _dtensor_param(model)
    if param is None:
        return num_kv_heads
    tp = topology_of(model).tp_size
    if tp == 1:
        return num_kv_heads
    if num_heads % tp or num_kv_heads % tp:
        raise ValueError(
            f"tensor parallelism over {tp} ranks needs the attention heads ({num_heads}) and KV heads "
            f"({num_kv_heads}) to divide by {tp}"
        )
    plan = getattr(model, "_tp_plan", None) or {}
    for name in ("k_proj", "v_proj"):
        style = next((v for k, v in plan.items() if k.endswith(f"self_attn.{name}")), None)
        if style is not None and style != "colwise":
            raise ValueError(
                f"the tensor-parallel plan shards {name} as {style!r}; cbgen's paged cache needs the "
                "heads split across ranks ('colwise'), not gathered"
            )
    attn = next((m for m in model.modules() if hasattr(m, "k_proj") and hasattr(m, "layer_idx")), None)
    weight = getattr(getattr(attn, "k_proj", None), "weight", None)
    if weight is not None and hasattr(weight, "to_local"):
        rows = weight.to_local().shape[0]
        if rows % head_dim:
            raise ValueError(
                f"k_proj's local shard ({rows} rows) is not a whole number of {head_dim}-wide heads"
            )
        return rows // head_dim
    return num_kv_heads // tp
