"""An engine's device side, built in one order: the execution plan with the model's cache layout,
the block count for the memory budget, the cache and its block pools, the scheduler over them, the
runner that follows the plan (warmed up, then checked against the model), and the input builder with
the backend's metadata deriver.

The engine owns what this returns; nothing here keeps a reference to the engine.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from cbgen.config import EngineConfig
from cbgen.core.block_manager import BlockManager
from cbgen.core.cache_pools import CachePools
from cbgen.core.checkpoints import Checkpoints
from cbgen.core.scheduler import Scheduler
from cbgen.core.slots import SlotPool
from cbgen.model import support
from cbgen.model.facts import ModelFacts
from cbgen.model.input_batch import InputBuilder
from cbgen.model.kv_cache import KVCache, choose_num_blocks, choose_num_slots
from cbgen.model.paged_metadata import PagedMetadata
from cbgen.model.plan import resolve_plan
from cbgen.model.runner import ModelRunner
from cbgen.model.startup import StartupTarget

logger = logging.getLogger("cbgen")


@dataclass
class DeviceSide:
    """The parts of one engine that hold device memory or decide what runs on the device."""

    kv_cache: KVCache
    pools: CachePools
    scheduler: Scheduler
    runner: ModelRunner
    input_builder: InputBuilder


def build_device_side(model: torch.nn.Module, config: EngineConfig, facts: ModelFacts) -> DeviceSide:
    """Builds them in the module docstring's order; refuses a model the start-up checks find
    computed wrongly (:class:`~cbgen.model.support.UnsupportedModelError`)."""
    plan = resolve_plan(model, config, facts.device, facts.dtype)
    logger.info("cbgen: execution plan: %s", plan)
    layout = plan.cache
    # Models with state layers: one state slot per running sequence, which also bounds how many run.
    with_checkpoints = bool(layout.state_groups) and config.enable_prefix_caching and layout.align > 0
    num_slots = (
        choose_num_slots(layout, facts.device, config, per_sequence=2 if with_checkpoints else 1)
        if layout.state_groups
        else 0
    )
    max_num_seqs = min(config.max_num_seqs, num_slots) if num_slots else config.max_num_seqs
    checkpoints = None
    state_rows = num_slots
    if with_checkpoints:
        # As many checkpoints as running sequences, after them in the state tensors.
        grid = math.lcm(layout.align, *(g.block_size for g in layout.kv_groups))
        checkpoints = Checkpoints(num_slots, num_slots, grid)
        state_rows += checkpoints.capacity
    num_blocks = choose_num_blocks(
        layout,
        facts.device,
        config.num_blocks,
        config.kv_cache_memory,
        config.kv_cache_memory_fraction,
        max_useful_tokens=max_num_seqs * facts.max_model_len + config.max_num_batched_tokens,
        num_slots=state_rows,
    )
    kv_cache = KVCache(layout, num_blocks, facts.device, num_slots=state_rows)
    pools = CachePools(
        [
            BlockManager(num_blocks, g.block_size, config.enable_prefix_caching, group=i)
            for i, g in enumerate(layout.kv_groups)
        ],
        SlotPool(num_slots) if num_slots else None,
        checkpoints,
    )
    scheduler = Scheduler(
        pools,
        config.max_num_batched_tokens,
        max_num_seqs,
        prefill_align=layout.align if layout.state_groups else None,
    )
    runner = ModelRunner(
        model,
        kv_cache,
        plan,
        max_num_seqs=config.max_num_seqs,
        max_model_len=facts.max_model_len,
        cuda_graph_max_batch=config.cuda_graph_max_batch,
        length_rotary=facts.length_rotary,
    )
    runner.warmup()
    _check(model, config, facts, runner, kv_cache, direct=plan.forward == "direct")
    input_builder = InputBuilder(
        [g.block_size for g in layout.kv_groups],
        facts.device,
        num_blocks=num_blocks,
        rope_extents=facts.length_rotary is not None,
        metadata=PagedMetadata(plan.row_prefill_max),
        with_state=bool(num_slots),
    )
    return DeviceSide(kv_cache, pools, scheduler, runner, input_builder)


def _check(
    model: torch.nn.Module,
    config: EngineConfig,
    facts: ModelFacts,
    runner: ModelRunner,
    kv_cache: KVCache,
    direct: bool,
) -> None:
    """The start-up checks, through their typed view of the engine (model/startup.py); ``direct``:
    the plan as resolved (before the probe's hooks re-plan) runs the parity direct forward."""
    target = StartupTarget(
        runner=runner,
        kv_cache=kv_cache,
        model=model,
        vocab_size=facts.vocab_size,
        dtype=facts.dtype,
        device=facts.device,
        max_model_len=facts.max_model_len,
        rope_extents=facts.length_rotary is not None,
    )
    if config.verify_model:
        support.probe(target)
        # The probe's sequences are short: where the rotary switches sets with the length, the
        # per-token tables are checked against the module at the switch too.
        why = facts.length_rotary.check(facts.dtype) if facts.length_rotary is not None else None
        if why is not None:
            raise support.UnsupportedModelError(why)
    if direct:
        runner.direct_check_done(support.check_direct_forward(target))
