"""The engine: add_request / step / abort over the scheduler, the block manager and the model runner.

One step, as data (see docs/design.md and :mod:`cbgen.step`):

    StepPlan   = schedule() + build()        which tokens of which requests, packed for the model,
                                             and the block copies its launch performs first
    LaunchedStep = launch(plan)              forward over the plan; logits only where a token is sampled
    sample(launched)                         one token per sampling sequence (+ logprobs)
    apply(launched) -> Applied               core.update: append, stop checks, forks, frees, publish

``step()`` runs ``_step(in_flight) -> StepResult``: synchronously, those stages in order.  With
overlap scheduling the sampled tokens stay on the device and the launched step is handed to the next
``step()`` as a value (``InFlight``): that call launches the plan scheduled while the device was busy,
feeding it the in-flight tokens on the device, then applies the in-flight step on the CPU while the
new forward runs.  Nothing else carries state from one step to the next.  Tensor-parallel lockstep is
not a branch of the step: the engine composes a :class:`~cbgen.lockstep.StepSync` whose
hooks decide locally (a rank alone) or with the group's root.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import torch

from cbgen import envs
from cbgen.config import EngineConfig
from cbgen.core import update as step_update
from cbgen.core.cache_pools import StateCopy
from cbgen.core.stats import EngineStats, StepStats
from cbgen.engine_control import EngineControl
from cbgen.inputs import as_token_ids
from cbgen.limits import RequestLimits
from cbgen.lockstep import step_sync
from cbgen.model import support
from cbgen.model.cpu_threads import ThreadGovernor
from cbgen.model.device_side import build_device_side
from cbgen.model.facts import ModelFacts
from cbgen.model.input_batch import ModelInput
from cbgen.model.loading.weights import WeightWatcher
from cbgen.model.plan import ExecutionPlan
from cbgen.output_processor import OutputProcessor
from cbgen.outputs import RequestOutput
from cbgen.request import Request, RequestGroup, RequestStatus, RopeSwitch
from cbgen.sample.logits_processors import AllowedTokensProcessor, BadWordsProcessor
from cbgen.sample.prompt_logprobs import record_prompt_logprobs
from cbgen.sample.sampler import Sampler
from cbgen.sample.structured import StructuredOutputs
from cbgen.sampling_params import SamplingParams
from cbgen.step import Applied, BlockCopies, InFlight, LaunchedStep, StepPlan, StepResult, sum_times
from cbgen.topology import topology_of

logger = logging.getLogger("cbgen")

__all__ = ["Engine", "EngineStats", "InFlight", "LaunchedStep", "StepPlan", "StepResult", "StepStats"]


class Engine:
    """Continuous-batching engine over a transformers causal LM (see module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer=None,
        config: EngineConfig | None = None,
        logits_processors: Sequence = (),
    ) -> None:
        self.config = config = config or EngineConfig()
        self.model = model
        support.check_model(model)
        self.tokenizer = tokenizer
        facts = ModelFacts.read(model, config, tokenizer)
        self.device, self.dtype, self.vocab_size = facts.device, facts.dtype, facts.vocab_size
        self.max_model_len, self.length_rotary = facts.max_model_len, facts.length_rotary
        self.eos_token_ids = facts.eos_token_ids
        # CPU steps leave out the threads whose cores other processes hold (model/cpu_threads.py).
        # Started before the device side, so that its first window (the rest of this constructor)
        # is read by the time the first step runs.
        self.threads = ThreadGovernor(
            enabled=self.device.type == "cpu" and envs.flag("CBGEN_FOLLOW_LOAD"), watch=True
        )
        side = build_device_side(model, config, facts)
        self.kv_cache, self.block_manager, self.scheduler = side.kv_cache, side.pools, side.scheduler
        self.runner, self.input_builder = side.runner, side.input_builder
        self.request_limits = RequestLimits(
            self.max_model_len, self.block_manager.block_size, self.block_manager.num_blocks
        )
        user_names = {p.name for p in logits_processors}
        builtins = [p for p in (AllowedTokensProcessor(), BadWordsProcessor()) if p.name not in user_names]
        # Tensor parallelism (transformers' own): the group's root decides each step (see lockstep).
        self.topology = topology_of(model)
        self.lockstep = step_sync(self.topology, config.distributed_timeout)
        # Unseeded sampling differs between data-parallel replicas by default, never inside a group.
        seed = config.seed if config.seed is not None else self.topology.replica
        self.structured = StructuredOutputs(tokenizer, self.vocab_size, self.eos_token_ids)
        self.sampler = Sampler(
            self.vocab_size,
            [*builtins, *logits_processors],
            seed=seed,
            structured=self.structured,
            sync_free=self.plan.sampled_rows == "sync_free",
            greedy_kernel=self.plan.greedy_kernel(),
            parity=self.plan.parity,
        )
        self.output_processor = OutputProcessor(tokenizer)
        self.weights = WeightWatcher(model)
        self.groups: dict[str, RequestGroup] = {}
        self.stats: EngineStats = self.block_manager.stats
        self.last_step: StepStats | None = None
        self._counter = 0
        self.async_scheduling = (
            config.async_scheduling if config.async_scheduling is not None else self.device.type == "cuda"
        )
        if self.lockstep.active and self.async_scheduling:
            if config.async_scheduling:
                raise ValueError(
                    "async_scheduling is not used with tensor parallelism (ranks exchange each step's tokens)"
                )
            self.async_scheduling = False
        # The one value carried from a step to the next (overlap scheduling only).
        self.in_flight: InFlight | None = None
        # Receives the final output of every non-streamed request an abort ends: such a request
        # never comes out of a step, and LLM.drive_until_empty still owes it to its caller.
        # Streamed ones belong to their stream's reader (AsyncEngine, the server).
        self.on_abort: Callable[[RequestOutput], None] | None = None

    @property
    def control(self) -> EngineControl:
        """The front ends' handle on this engine (policy, pauses, gauges).  Made on each access
        rather than kept: an engine that held its own handle would be a reference cycle, and an
        engine in a cycle keeps its KV cache and packed weights until Python's cycle collector runs,
        long after the last user reference is gone."""
        return EngineControl(self)

    @property
    def plan(self) -> ExecutionPlan:
        """The execution plan in force: resolved at start, re-resolved by the runner when the
        model's structure changes (see :mod:`cbgen.model.plan`)."""
        return self.runner.plan

    # ------------------------------------------------------------------ requests
    def new_request_id(self) -> str:
        """A fresh engine-unique request id."""
        self._counter += 1
        return f"req-{self._counter}"

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raises ``ValueError`` naming the problem.  Changes nothing, except that bad words given as
        strings are resolved to token ids on ``params`` (vLLM's form; repeating it is a no-op)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt is empty: at least one token is needed")
        bad = next((t for t in prompt_token_ids if type(t) is not int or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        self.request_limits.check_prompt(len(prompt_token_ids))
        params.verify_for_model(self.vocab_size, self.config.max_logprobs, tokenizer=self.tokenizer)
        if params.stop and self.tokenizer is None:
            raise ValueError(
                "SamplingParams.stop: stop strings need a tokenizer (pass one to LLM/Engine, or use "
                "stop_token_ids)"
            )
        unknown = set(params.logits_processor_args or ()) - set(self.sampler.logits_processor_names)
        if unknown:
            raise ValueError(
                f"SamplingParams.logits_processor_args: unknown processor(s) {sorted(unknown)}; "
                f"this engine has {self.sampler.logits_processor_names}"
            )
        self.structured.validate(params)  # compiles the constraint (cached), if there is one

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        prompt: str | None = None,
        stream: bool = False,
    ) -> str:
        """Queues one request (``params.n`` samples).  Raises ``ValueError`` on bad input."""
        prompt_token_ids = as_token_ids(prompt_token_ids)
        self.validate(prompt_token_ids, params)
        request_id = request_id or self.new_request_id()
        if request_id in self.groups or self.lockstep.reserves(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.lockstep.on_add(request_id, prompt_token_ids, params, prompt, stream):
            self._queue(request_id, prompt_token_ids, params, prompt, stream)
        return request_id  # else a follower queues it when the root's copy arrives

    def _queue(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None,
        stream: bool,
    ) -> None:
        max_tokens = self.request_limits.max_tokens_of(len(prompt_token_ids), params.max_tokens)
        if max_tokens != params.max_tokens:
            params = _with_max_tokens(params, max_tokens)
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        group = RequestGroup.create(
            request_id,
            prompt_token_ids,
            params,
            eos,
            prompt,
            stream,
            weight_version=self.weights.version,
            cache_salt=self.cache_salt(len(prompt_token_ids)),
            rope_switch=self._rope_switch(len(prompt_token_ids)),
        )
        for sample in group.samples:
            self.output_processor.init_request(sample, stream)
        self.groups[request_id] = group
        leader = group.samples[0]
        self.scheduler.add(leader)
        self.stats.prompt_tokens += len(prompt_token_ids)

    def cache_salt(self, prompt_len: int) -> int | None:
        """The prefix-cache salt of a prompt of ``prompt_len`` tokens: the rotary frequency set its
        tokens get on models where that depends on the length (cbgen.model.rotary), else None."""
        return None if self.length_rotary is None else self.length_rotary.cache_key(prompt_len)

    def _rope_switch(self, prompt_len: int) -> RopeSwitch | None:
        found = self.length_rotary.switch_for(prompt_len) if self.length_rotary is not None else None
        return RopeSwitch(*found) if found is not None else None

    def _switch_rotary_sets(self) -> None:
        """Requests that reached their ``rope_switch`` length drop their K/V and are recomputed with
        every token under the new set, as the model's ``generate()`` does (cbgen.model.rotary)."""
        for r in [*self.scheduler.running, *self.scheduler.waiting]:
            switch = r.rope_switch
            if switch is None or r.rope_switched or r.num_tokens < switch.at or r.is_finished:
                continue
            if r.num_computed_tokens or r.status is RequestStatus.RUNNING:
                self.scheduler.remove(r)
                r.num_computed_tokens = 0
                self.scheduler.requeue(r)
            r.forget_hashes()
            r.rope_switched = True

    def abort(self, request_id: str) -> RequestOutput | None:
        """Aborts a request (all its samples) and frees its blocks; returns its final output, or
        None if the id is unknown.  A sample id (``"<request id>#<i>"``, n>1) aborts that sample
        only; the group's output then comes when the group ends (returned here if that is now).
        With tensor parallelism only the root's aborts count (they reach the others next step)."""
        if not self.lockstep.on_abort(request_id):
            return None
        return self._abort_local(request_id)

    def _abort_local(self, request_id: str) -> RequestOutput | None:
        group = self.groups.get(request_id)
        samples = group.samples if group is not None else None
        if group is None:
            group_id, _, index = request_id.rpartition("#")
            group = self.groups.get(group_id)
            if group is None or not index.isdecimal() or int(index) >= len(group.samples):
                return None
            samples = [group.samples[int(index)]]
        ended = []
        for sample in samples:
            if not sample.is_finished:
                ended += step_update.finish(self.scheduler, sample, RequestStatus.FINISHED_ABORTED)
        self._count_ended(ended)
        self.scheduler.remove_finished()
        out = self._group_output(group) if len(samples) > 1 or group.all_finished() else None
        if out is not None and out.finished and not group.stream and self.on_abort is not None:
            self.on_abort(out)
        return out

    def abort_all(self, error: str) -> list[RequestOutput]:
        """Ends every request in flight as failed with ``error`` (after a step raised: the state of
        its batch is unknown); returns their final outputs."""
        self.in_flight = None
        outputs = []
        for group in list(self.groups.values()):
            ended = []
            for sample in group.samples:
                if not sample.is_finished:
                    ended += step_update.finish(self.scheduler, sample, RequestStatus.FINISHED_ERROR, error)
            self._count_ended(ended)
            outputs.append(self._group_output(group))
        self.scheduler.remove_finished()
        return outputs

    def has_unfinished(self) -> bool:
        """True while any request is queued or running (or its last tokens are not read back)."""
        return bool(self.groups) or self.lockstep.has_pending()

    @property
    def num_unfinished(self) -> int:
        """Requests (groups of ``n`` samples) not finished yet."""
        return len(self.groups)

    # ------------------------------------------------------------------ weights
    def check_weights(self) -> list[RequestOutput]:
        """Applies the weight-change policy now if the weights changed since the last step; returns
        outputs of requests that ended meanwhile (their in-flight tokens are applied first)."""
        if self.lockstep.active or not self.weights.changed():
            return []  # tensor parallelism: the root's next step decides for the whole group
        last, self.in_flight = self.in_flight, None
        return self._outputs(self._weights_changed(last))

    def _weights_changed(self, last: InFlight | None) -> list[RequestGroup]:
        """The weight-change policy; returns the groups that moved.  ``last`` (still in flight) is
        applied first and the step planned after it dropped."""
        # Tokens still on the device were sampled under the old weights: apply them first, then the
        # policy below treats them like the others.  The step planned after them was built for the
        # old state and is dropped: the policy reschedules everything.
        applied = self._apply(last)
        dropped = last.next.copies if last is not None and last.next is not None else []
        self.kv_cache.copy_blocks([*dropped, *applied.copies])  # no plan is left to carry them
        self.stats.weight_changes += 1
        self.runner.weights_changed()
        self.reset_prefix_cache()
        # Policy: a request in flight when the weights change is recomputed from its prompt under the
        # new weights, discarding what it generated, so every output comes from one weight version;
        # for n>1 that includes samples that already finished (the whole group restarts).  A streamed
        # request cannot take back what it already sent: it keeps its tokens and only its K/V is
        # recomputed under the new weights.
        version = self.weights.version
        requeue: list[Request] = []
        for group in list(self.groups.values()):
            if not group.stream and any(
                s.num_computed_tokens or s.num_output_tokens or s.is_finished for s in group.samples
            ):
                requeue += self._restart_group(group)
                continue
            for sample in group.samples:
                if sample.is_finished:
                    continue
                if sample.num_computed_tokens:
                    self.scheduler.remove(sample)
                    sample.num_computed_tokens = 0
                    requeue.append(sample)
                sample.weight_version = version
        for request in reversed(requeue):  # at the front of the queue, in their original order
            self.scheduler.requeue(request)
        self.scheduler.remove_finished()
        return applied.touched

    def _restart_group(self, group: RequestGroup) -> list[Request]:
        samples = step_update.restart_group(self.scheduler, group)
        for sample in group.samples:
            sample.weight_version = self.weights.version
            self.output_processor.init_request(sample, group.stream)
        return samples[:1]

    def follow(self) -> None:
        """The loop of a non-root rank that serves behind its tensor-parallel root (``cbgen serve``):
        runs the steps the root runs until the root calls :meth:`stop_followers`."""
        while self.lockstep.following:
            self.step()

    def stop_followers(self) -> None:
        """Root: one last exchange that ends the other ranks' :meth:`follow` loops."""
        if self.lockstep.request_stop():
            self.step()

    def reset_prefix_cache(self) -> None:
        """Drops every cached prefix block (they stay valid for the requests that hold them)."""
        self.block_manager.reset_prefix_cache()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Runs one step; returns outputs of groups that changed (every step for streamed groups,
        once at the end for the others).  See the module docstring for the overlapped variant, whose
        stop checks lag one step: a token sampled for a request that already stopped is dropped."""
        if not self.kv_cache.allocated:
            raise RuntimeError("the KV cache was released: call resume_memory() before generating again")
        last, self.in_flight = self.in_flight, None  # a step that raises leaves nothing in flight
        with self.threads.governed() as threads:
            result = self._step(last)
        self.in_flight = result.in_flight
        self._account(result, threads)
        return result.outputs

    def _step(self, last: InFlight | None) -> StepResult:
        """One step after ``last``, the step still in flight (None when synchronous)."""
        changed, outputs = self.lockstep.begin_step(self.weights.changed, self._queue, self._abort_local)
        touched = self._weights_changed(last) if changed else []
        last = None if changed else last
        plan = self._plan(last)
        # What this call scheduled and applied, in order (their times and the groups they touched).
        stages: list[StepPlan | Applied] = [] if last is not None and plan is last.next else [plan]
        launched = self._launch(plan, last) if plan.batch is not None else None
        # While the device runs this step's forward, the CPU applies the previous step's tokens.
        stages.append(self._apply(last))
        in_flight = None
        if launched is not None and not launched.batch.sample_requests:
            step_update.publish(self.scheduler, launched.crossed)
        elif launched is not None and self.async_scheduling:
            # The plan scheduled meanwhile carries the fork copies: its launch performs them.
            in_flight = self._sample_ahead(launched, stages[-1].copies)
            stages[-1].copies = []
            stages.append(in_flight.next)
        elif launched is not None:
            stages.append(self._apply(self._sample(launched)))
        # Fork copies no plan carries: performed now, so any later forward finds them done.
        self.kv_cache.copy_blocks([pair for s in stages if isinstance(s, Applied) for pair in s.copies])
        self.scheduler.remove_finished()
        outputs += self._outputs(touched + [g for s in stages for g in s.touched])
        times = sum_times(*(s.times for s in stages), launched.times if launched is not None else {})
        # With no request left, only ended requests are in flight: hold nothing between rounds.
        return StepResult(outputs, in_flight if self.groups else None, plan, times)

    def _plan(self, last: InFlight | None) -> StepPlan:
        """The step planned while ``last`` computed, unless every request in it has ended since (its
        block copies then go with the plan that replaces it)."""
        nxt = last.next if last is not None else None
        if nxt is not None and any(not r.is_finished for r, _ in nxt.sched.scheduled):
            return nxt
        return self._schedule(nxt.copies if nxt is not None else [])

    def _schedule(self, copies: BlockCopies) -> StepPlan:
        """Schedules and builds a step; it carries ``copies`` (fork copies of steps applied before it)
        and its own partial prefix hits.  Requests that can never be scheduled end here."""
        t0 = time.perf_counter()
        self.scheduler.remove_finished()
        if self.length_rotary is not None and self.length_rotary.recomputes:
            self._switch_rotary_sets()
        sched = self.scheduler.schedule()
        for request in sched.failed:
            ended = step_update.finish(self.scheduler, request, RequestStatus.FINISHED_ERROR, request.error)
            self._count_ended(ended)
        failed = [self.groups[r.group_id] for r in sched.failed]
        t1 = time.perf_counter()
        self.lockstep.check_schedule(sched.scheduled)
        batch = self.input_builder.build(sched.scheduled, self.kv_cache.layers) if sched.scheduled else None
        times = {"schedule": t1 - t0, "build": time.perf_counter() - t1}
        return StepPlan(sched, batch, [*copies, *sched.copies], times, failed)

    def _launch(self, plan: StepPlan, last: InFlight | None) -> LaunchedStep:
        """Runs the forward (on CUDA: enqueues it) and counts the scheduled tokens as computed."""
        t = time.perf_counter()
        batch = plan.batch
        if batch.pending_rows:
            self._patch_pending_inputs(batch, last)
        self.kv_cache.copy_blocks(plan.copies)
        logits = self.runner.execute(batch)
        # State checkpoints are the states this forward left (cbgen.core.checkpoints).
        self.kv_cache.copy_blocks(plan.sched.checkpoints)
        crossed = step_update.advance(batch.scheduled, self.block_manager.block_size)
        if batch.prompt_rows:
            record_prompt_logprobs(
                batch.prompt_rows, logits[: batch.num_prompt_rows], parity=self.plan.parity
            )
        times = {"forward": time.perf_counter() - t}
        return LaunchedStep(batch, crossed, logits[batch.num_prompt_rows :], times=times)

    def _sample(self, launched: LaunchedStep) -> LaunchedStep:
        t = time.perf_counter()
        launched.sampled, launched.host = self.lockstep.sample(
            lambda: self.sampler(launched.logits, launched.batch.sample_requests)
        )
        launched.logits = None
        launched.times["sample"] = time.perf_counter() - t
        return launched

    def _sample_ahead(self, launched: LaunchedStep, copies: BlockCopies) -> InFlight:
        """Overlap scheduling: mark this step's tokens pending, schedule and build the next step
        around them (it carries ``copies``), then sample this one (the device has been busy with its
        forward all along)."""
        for r in launched.batch.sample_requests:
            if r.status is RequestStatus.RUNNING:
                r.pending = True
        launched.next = self._schedule(copies)
        return self._sample(launched)

    def _patch_pending_inputs(self, batch: ModelInput, last: InFlight | None) -> None:
        """Feeds the previous step's device-side tokens to the rows built around them.

        The rows were recorded at build time: a request aborted since then has no pending token
        any more, but its row must still get a valid token (its result is discarded)."""
        if last is None or last.sampled is None:
            raise RuntimeError("a step was built around tokens of a step that is no longer in flight")
        index = {id(r): i for i, r in enumerate(last.batch.sample_requests)}
        rows = [row for row, _ in batch.pending_rows]
        src = [index[id(r)] for _, r in batch.pending_rows]
        tokens = last.sampled.device_token_ids
        dev = batch.input_ids.device
        batch.input_ids[torch.tensor(rows, device=dev)] = tokens[torch.tensor(src, device=tokens.device)].to(
            dev
        )

    def _apply(self, launched: LaunchedStep | None) -> Applied:
        """Reads a sampled step's tokens back and applies the update rules of :mod:`cbgen.core.update`."""
        if launched is None:
            return Applied()
        t = time.perf_counter()
        update = step_update.apply_sampled(
            self.scheduler,
            launched.batch.sample_requests,
            launched.host if launched.host is not None else launched.sampled.to_host(),
            launched.crossed,
            max_model_len=self.max_model_len,
            stop_string=self.output_processor.check_stop_strings,
        )
        self.stats.generated_tokens += update.num_generated
        self._count_ended(update.ended)
        touched = [self.groups[r.group_id] for r in update.touched]
        return Applied(
            touched,
            [*update.copies, *(StateCopy(*c) for c in update.state_copies)],
            {"update": time.perf_counter() - t},
        )

    def _count_ended(self, ended: list[Request]) -> None:
        s = self.stats
        for r in ended:
            if r.status is RequestStatus.FINISHED_ERROR:
                s.requests_failed += 1
                logger.warning("request %s failed: %s", r.request_id, r.error)
            elif r.status is RequestStatus.FINISHED_ABORTED:
                s.requests_aborted += 1
            else:
                s.requests_finished += 1

    def _outputs(self, touched: list[RequestGroup]) -> list[RequestOutput]:
        """Final outputs of groups that ended, and deltas of streamed groups that moved (each once,
        in the order they were first touched)."""
        groups = {g.request_id: g for g in touched}
        return [self._group_output(g) for g in groups.values() if g.stream or g.all_finished()]

    def _group_output(self, group: RequestGroup) -> RequestOutput:
        out = self.output_processor.make_output(group, delta=group.stream)
        if group.all_finished():
            self.groups.pop(group.request_id, None)
        return out

    def _account(self, result: StepResult, threads: int) -> None:
        s = self.stats
        sched, batch = result.plan.sched, result.plan.batch
        s.steps += 1
        s.batched_seqs += len(sched.scheduled)
        for key, value in result.times.items():
            s.times[key] = s.times.get(key, 0.0) + value
        nd = batch.meta.num_decode if batch is not None else 0
        self.last_step = StepStats(
            step=s.steps,
            num_seqs=len(sched.scheduled),
            num_tokens=sched.num_tokens,
            num_decode=nd,
            num_prefill_tokens=sched.num_tokens - nd,
            num_sampled=len(batch.sample_requests) if batch is not None else 0,
            preempted=len(sched.preempted),
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_usage=self.block_manager.usage,
            times=result.times,
            threads=threads,
        )

    # ------------------------------------------------------------------ memory
    def release_memory(self) -> None:
        """Frees the KV cache tensors.  Only allowed when no request is in flight."""
        if self.has_unfinished():
            raise RuntimeError("release_memory() needs an idle engine: requests are still in flight")
        self.in_flight = None  # only ended requests can be left in it
        self.block_manager.reset_prefix_cache()
        self.kv_cache.release()
        self.runner.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        """Re-allocates the KV cache (and static decode buffers) after :meth:`release_memory`."""
        self.kv_cache.allocate()
        self.runner.resume()
        self.runner.warmup()


def _with_max_tokens(params: SamplingParams, limit: int) -> SamplingParams:
    return dataclasses.replace(params, max_tokens=limit, min_tokens=min(params.min_tokens, limit))
