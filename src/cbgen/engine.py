"""The engine: add_request / step / abort over the scheduler, the block manager and the model runner.

One step is: watch weights -> schedule -> pack inputs -> forward (logits only where sampled) ->
sample -> update (append tokens, stop checks, publish full blocks, fork n>1 samples, free finished
requests) -> outputs for the groups that changed.  Every sequence ends exactly once, as finished,
aborted or failed, and its blocks are freed at that moment.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cbgen.config import EngineConfig
from cbgen.core.block_manager import BlockManager
from cbgen.core.scheduler import Scheduler, SchedulerOutput
from cbgen.model.backends import select_backend
from cbgen.model.input_batch import InputBuilder, ModelInput
from cbgen.model.kv_cache import KVCache, KVGeometry, choose_num_blocks
from cbgen.model.runner import ModelRunner
from cbgen.model.weights import WeightWatcher
from cbgen.output_processor import OutputProcessor
from cbgen.outputs import RequestOutput
from cbgen.request import PENDING_TOKEN, Request, RequestStatus
from cbgen.sample.logits_processors import AllowedTokensProcessor, BadWordsProcessor
from cbgen.sample.sampler import Sampler, prompt_logprobs
from cbgen.sampling_params import SamplingParams

logger = logging.getLogger("cbgen")


@dataclass
class StepStats:
    """What one step did; passed to ``on_step`` callbacks and summed into :class:`EngineStats`."""

    step: int
    num_seqs: int
    num_tokens: int
    num_decode: int
    num_prefill_tokens: int
    num_sampled: int
    preempted: int
    running: int
    waiting: int
    kv_usage: float
    times: dict[str, float] = field(default_factory=dict)


@dataclass
class EngineStats:
    """Cumulative counters (see README for meanings)."""

    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of added requests (a group's prompt counted once)
    prompt_tokens_computed: int = 0  # prompt tokens actually run through the model
    generated_tokens: int = 0
    preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_failed: int = 0
    weight_changes: int = 0
    batched_seqs: int = 0
    times: dict[str, float] = field(default_factory=dict)

    @property
    def mean_batch_size(self) -> float:
        """Average sequences per step."""
        return self.batched_seqs / self.steps if self.steps else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens served from the prefix cache."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass
class _StepResult:
    """A step that was run and sampled but whose tokens are not applied yet."""

    batch: ModelInput
    sampled: Any  # SamplerOutput | None
    crossed: list[Request]  # requests whose computed tokens completed a block in this step

    def sample_index(self) -> dict[int, int]:
        """id(request) -> its row in the sampled tensors."""
        return {id(r): i for i, r in enumerate(self.batch.sample_requests)}


@dataclass
class RequestGroup:
    """One user request: its ``n`` sequences and how its outputs are reported."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[Request]
    stream: bool = False
    finished: bool = False

    def all_finished(self) -> bool:
        """True once every sample reached a terminal status."""
        return all(s.is_finished for s in self.samples)


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
        self.tokenizer = tokenizer
        param = next(model.parameters())
        self.device = param.device
        self.dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        text_config = (
            model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        )
        self.vocab_size = int(text_config.vocab_size)
        self.max_model_len = int(
            config.max_model_len or getattr(text_config, "max_position_embeddings", None) or 1 << 20
        )
        self.eos_token_ids = frozenset(self._eos_ids(model, tokenizer))

        geometry = KVGeometry.from_model(model, self.dtype)
        num_blocks = choose_num_blocks(
            geometry,
            config.block_size,
            self.device,
            config.num_blocks,
            config.kv_cache_memory,
            config.kv_cache_memory_fraction,
            max_useful_tokens=config.max_num_seqs * self.max_model_len + config.max_num_batched_tokens,
        )
        self.kv_cache = KVCache(geometry, num_blocks, config.block_size, self.device)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs)
        self.runner = ModelRunner(
            model,
            self.kv_cache,
            self.device,
            backend=select_backend(
                config.attention_backend,
                self.device,
                self.dtype,
                block_size=config.block_size,
                head_dim=geometry.head_dim,
            ),
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            enforce_eager=config.enforce_eager,
            compile=config.compile,
            cuda_graph_max_batch=config.cuda_graph_max_batch,
            fused_decode=config.fused_decode,
            prepack_weights=config.prepack_weights,
        )
        self.runner.warmup()
        # Short prefill chunks as decode-kernel rows: measured on the C kernels only (see input_batch).
        row_prefill = self.runner.attn_backend.row_prefill_max
        self.input_builder = InputBuilder(config.block_size, self.device, row_prefill_max=row_prefill)
        user_names = {p.name for p in logits_processors}
        builtins = [p for p in (AllowedTokensProcessor(), BadWordsProcessor()) if p.name not in user_names]
        self.sampler = Sampler(self.vocab_size, [*builtins, *logits_processors], seed=config.seed)
        self.output_processor = OutputProcessor(tokenizer)
        self.weights = WeightWatcher(model)
        self.groups: dict[str, RequestGroup] = {}
        self.stats = EngineStats()
        self._pending_copies: list[tuple[int, int]] = []
        self._counter = 0
        # Overlap scheduling: the last step, sampled but not yet read back, and groups it changed
        # that still owe an output.
        self.async_scheduling = (
            config.async_scheduling if config.async_scheduling is not None else self.device.type == "cuda"
        )
        self._deferred: _StepResult | None = None
        self._prepared: tuple[SchedulerOutput, ModelInput | None] | None = None
        self._carry: dict[str, RequestGroup] = {}

    @staticmethod
    def _eos_ids(model, tokenizer) -> set[int]:
        ids: set[int] = set()
        gen_config = getattr(model, "generation_config", None)
        eos = getattr(gen_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(model.config, "eos_token_id", None)
        if eos is None and tokenizer is not None:
            eos = tokenizer.eos_token_id
        if isinstance(eos, int):
            ids.add(eos)
        elif eos is not None:
            ids.update(int(e) for e in eos)
        return ids

    # ------------------------------------------------------------------ requests
    def new_request_id(self) -> str:
        """A fresh engine-unique request id."""
        self._counter += 1
        return f"req-{self._counter}"

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raises ``ValueError`` naming the problem; changes nothing."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt is empty: at least one token is needed")
        bad = next((t for t in prompt_token_ids if type(t) is not int or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens, longer than the model's context of "
                f"{self.max_model_len} tokens (at least one token must be generated)"
            )
        need = self.block_manager.blocks_needed(len(prompt_token_ids) + 1)
        if need > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt needs {need} KV blocks but the cache has only {self.block_manager.num_blocks}; "
                "raise num_blocks or kv_cache_memory"
            )
        params.verify_for_model(self.vocab_size, self.config.max_logprobs)
        unknown = set(params.logits_processor_args or ()) - set(self.sampler.logits_processor_names)
        if unknown:
            raise ValueError(
                f"SamplingParams.logits_processor_args: unknown processor(s) {sorted(unknown)}; "
                f"this engine has {self.sampler.logits_processor_names}"
            )

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        prompt: str | None = None,
        stream: bool = False,
    ) -> str:
        """Queues one request (``params.n`` samples).  Raises ``ValueError`` on bad input."""
        prompt_token_ids = _as_token_list(prompt_token_ids)
        self.validate(prompt_token_ids, params)
        request_id = request_id or self.new_request_id()
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.max_tokens is None or params.max_tokens > self.max_model_len - len(prompt_token_ids):
            params = _with_max_tokens(params, self.max_model_len - len(prompt_token_ids))
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        samples = [
            Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=prompt_token_ids,
                params=params,
                eos_token_ids=eos,
                group_id=request_id,
                sample_index=i,
                prompt=prompt,
                weight_version=self.weights.version,
            )
            for i in range(params.n)
        ]
        for sample in samples:
            if params.prompt_logprobs is not None and sample.sample_index == 0:
                sample.prompt_logprobs = [None]
            self.output_processor.init_request(sample, stream)
        leader = samples[0]
        leader.followers = samples[1:]
        for follower in leader.followers:
            follower.status = RequestStatus.WAITING_FOR_FORK
        self.groups[request_id] = RequestGroup(request_id, prompt, prompt_token_ids, params, samples, stream)
        self.scheduler.add(leader)
        self.stats.prompt_tokens += len(prompt_token_ids)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Aborts a request (all its samples); frees its blocks.  Returns its final output, or None if unknown."""
        group = self.groups.get(request_id)
        if group is None:
            return None
        for sample in group.samples:
            if not sample.is_finished:
                self._finish(sample, RequestStatus.FINISHED_ABORTED)
        self.scheduler.remove_finished()
        return self._group_output(group, delta=group.stream)

    def has_unfinished(self) -> bool:
        """True while any request is queued or running (or its last tokens are not read back)."""
        return bool(self.groups)

    # ------------------------------------------------------------------ weights
    def _check_weights(self) -> None:
        if not self.weights.changed():
            return
        # Tokens still on the device were sampled under the old weights: apply them first (their
        # outputs go out with the next step), then the policy below treats them like the others.
        self._finish_step(self._deferred, self._carry)
        self._deferred = None
        self._prepared = None  # built for the old state; the policy below reschedules everything
        self.stats.weight_changes += 1
        self.runner.weights_changed()
        self.reset_prefix_cache()
        # Policy: a request in flight when the weights change is recomputed from its prompt under the
        # new weights, discarding what it generated, so every output comes from one weight version.
        # A streamed request cannot take back what it already sent: it keeps its tokens and only its
        # K/V is recomputed under the new weights.
        for request in list(self.scheduler.running) + list(self.scheduler.waiting):
            if request.num_computed_tokens == 0 and request.num_output_tokens == 0:
                request.weight_version = self.weights.version
                continue
            self.scheduler.remove(request)
            if self.groups[request.group_id].stream:
                request.num_computed_tokens = 0
                request.weight_version = self.weights.version
            else:
                self._restart(request)
            self.scheduler.requeue(request)
        self.scheduler.remove_finished()

    def _restart(self, request: Request) -> None:
        del request.token_ids[request.num_prompt_tokens :]
        request.num_computed_tokens = 0
        request.token_logprobs.clear()
        request.raw_logprobs.clear()
        request.log_kept_mass.clear()
        if request.top_logprobs is not None:
            request.top_logprobs.clear()
        if request.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        request.weight_version = self.weights.version
        self.output_processor.init_request(request, self.groups[request.group_id].stream)

    def reset_prefix_cache(self) -> None:
        """Drops every cached prefix block (they stay valid for the requests that hold them)."""
        self.block_manager.reset_prefix_cache()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Runs one scheduling + forward + sampling step; returns outputs of groups that changed
        (every step for streamed groups, once at the end for the others).

        With overlap scheduling, a step launches its forward, then (while the device computes) applies
        the previous step's tokens and schedules and builds the next step, and only then samples.
        Sampled tokens stay on the device and feed the next step's inputs.  Stop checks lag one
        step: a token sampled for a request that had already stopped is dropped, never emitted.
        """
        if not self.kv_cache.allocated:
            raise RuntimeError("the KV cache was released: call resume_memory() before generating again")
        self._check_weights()
        changed, self._carry = self._carry, {}
        times: dict[str, float] = {}
        prepared, self._prepared = self._prepared, None
        if prepared is not None and all(r.is_finished for r, _ in prepared[0].scheduled):
            prepared = None  # every request in it ended (aborted) since it was built
        sched, batch = prepared or self._schedule_and_build(changed, times)
        logits = None
        crossed: list[Request] = []
        if batch is not None:
            self._patch_pending_inputs(batch)
            t = time.perf_counter()
            if self._pending_copies:
                self.kv_cache.copy_blocks(self._pending_copies)
                self._pending_copies = []
            logits = self.runner.execute(batch)
            crossed = self._advance(batch)
            if batch.prompt_rows:
                self._record_prompt_logprobs(batch, logits[: batch.num_prompt_rows])
            times["forward"] = time.perf_counter() - t
        # While the device runs this step's forward, the CPU applies the previous step's tokens.
        t = time.perf_counter()
        self._finish_step(self._deferred, changed)
        self._deferred = None
        outputs = self._collect_outputs(changed)
        update = time.perf_counter() - t
        if batch is not None and batch.sample_requests:
            sample_logits = logits[batch.num_prompt_rows :]
            if self.async_scheduling:
                sample = self._prepare_next_then_sample(batch, sample_logits, times)
                self._deferred = _StepResult(batch, sample, crossed)
            else:
                t = time.perf_counter()
                sample = self.sampler(sample_logits, batch.sample_requests)
                times["sample"] = time.perf_counter() - t
                t = time.perf_counter()
                self._finish_step(_StepResult(batch, sample, crossed), changed)
                outputs += self._collect_outputs(changed)
                update += time.perf_counter() - t
        elif batch is not None:
            self._publish(crossed)
        times["update"] = update
        self.scheduler.remove_finished()
        self._account(sched, batch, times)
        return outputs

    def _schedule_and_build(
        self, changed: dict[str, RequestGroup], times: dict[str, float]
    ) -> tuple[SchedulerOutput, ModelInput | None]:
        t0 = time.perf_counter()
        self.scheduler.remove_finished()
        sched = self.scheduler.schedule()
        for request in sched.failed:
            self._finish(request, RequestStatus.FINISHED_ERROR, error=request.error)
            changed[request.group_id] = self.groups[request.group_id]
        t1 = time.perf_counter()
        batch = None
        if sched.scheduled:
            batch = self.input_builder.build(sched.scheduled, self.kv_cache.layers)
            batch.pending_rows = [(row, r) for row, (r, _) in enumerate(batch.scheduled) if r.pending]
        times["schedule"] = times.get("schedule", 0.0) + t1 - t0
        times["build"] = times.get("build", 0.0) + time.perf_counter() - t1
        return sched, batch

    def _prepare_next_then_sample(self, batch: ModelInput, logits: torch.Tensor, times: dict[str, float]):
        """Overlap scheduling: reserve this step's tokens as placeholders, schedule and build the next
        step, then sample this one (the device has been busy with its forward all along)."""
        pending = [r for r in batch.sample_requests if r.status is RequestStatus.RUNNING]
        for r in pending:
            r.append_placeholder()
        # Groups failed by this schedule report with the next step's outputs.
        self._prepared = self._schedule_and_build(self._carry, times)
        # The sampler must see what a synchronous step would: no placeholder of this step's own.
        hidden = [r for r in pending if r.pending]
        for r in hidden:
            r.token_ids.pop()
        t = time.perf_counter()
        try:
            return self.sampler(logits, batch.sample_requests)
        finally:
            times["sample"] = time.perf_counter() - t
            for r in hidden:
                r.token_ids.append(PENDING_TOKEN)

    def _advance(self, batch: ModelInput) -> list[Request]:
        """Counts the step's tokens as computed; returns requests that completed a block (published
        once their tokens are all known)."""
        bs = self.block_manager.block_size
        crossed = []
        for r, n in batch.scheduled:
            before = r.num_computed_tokens
            r.num_computed_tokens += n
            if (before + n) // bs > before // bs:
                crossed.append(r)
        return crossed

    def _patch_pending_inputs(self, batch: ModelInput) -> None:
        """Feeds the previous step's device-side tokens to the rows built around a placeholder.

        The rows were recorded at build time: a request aborted since then has dropped its
        placeholder, but its row must still get a valid token (its result is discarded)."""
        if not batch.pending_rows:
            return
        index = self._deferred.sample_index()
        rows, src = [], []
        for row, r in batch.pending_rows:
            # Only a decode row can end in the placeholder: a recompute after preemption waits
            # until the placeholder is resolved.
            assert batch.scheduled[row][1] == 1, r.request_id
            rows.append(row)
            src.append(index[id(r)])
        dev = batch.input_ids.device
        tokens = self._deferred.sampled.device_token_ids
        batch.input_ids[torch.tensor(rows, device=dev)] = tokens[torch.tensor(src, device=tokens.device)].to(
            dev
        )

    def _collect_outputs(self, changed: dict[str, RequestGroup]) -> list[RequestOutput]:
        outputs = []
        for group in changed.values():
            if group.all_finished():
                outputs.append(self._group_output(group, delta=group.stream))
            elif group.stream:
                outputs.append(self._group_output(group, delta=True))
        changed.clear()
        return outputs

    def _record_prompt_logprobs(self, batch: ModelInput, logits: torch.Tensor) -> None:
        targets = []
        for rows in batch.prompt_rows:
            r = rows.request
            targets.extend(r.token_ids[rows.first_token : rows.first_token + rows.count])
        k = max(rows.request.params.prompt_logprobs or 0 for rows in batch.prompt_rows)
        target_lp, top_ids, top_lp = prompt_logprobs(logits, torch.tensor(targets, device=logits.device), k)
        target_lp = target_lp.tolist()
        top_ids = top_ids.tolist() if top_ids is not None else None
        top_lp = top_lp.tolist() if top_lp is not None else None
        for rows in batch.prompt_rows:
            r = rows.request
            want = r.params.prompt_logprobs or 0
            for j in range(rows.row_start, rows.row_start + rows.count):
                entry = {targets[j]: target_lp[j]}
                if want and top_ids is not None:
                    for tok, lp in zip(top_ids[j][:want], top_lp[j][:want]):
                        entry.setdefault(tok, lp)
                r.prompt_logprobs.append(entry)

    def _finish_step(self, result: _StepResult | None, changed: dict[str, RequestGroup]) -> None:
        """Reads a step's sampled tokens back and applies them: append, stop checks, forks, frees,
        and publishes the blocks the step completed."""
        if result is None:
            return
        batch, sampled = result.batch, result.sampled
        if sampled is None:
            self._publish(result.crossed)
            return
        tokens = sampled.token_ids.tolist()
        logprobs = sampled.logprobs.tolist()
        raw = sampled.raw_logprobs.tolist()
        kept = sampled.log_kept_mass.tolist()
        top_ids = sampled.topk_ids.tolist() if sampled.topk_ids is not None else None
        top_lp = sampled.topk_logprobs.tolist() if sampled.topk_logprobs is not None else None
        failed = sampled.failed

        # Fork n>1 samples first: their leader may finish in this very step and free its blocks.
        for r in batch.sample_requests:
            if r.status is RequestStatus.WAITING_FOR_FORK:
                self._fork(r)
        now = time.monotonic()
        groups, generated = self.groups, 0
        # This loop runs for every running request every step: it reads each attribute once.
        for i, r in enumerate(batch.sample_requests):
            if r.is_finished:
                continue
            changed[r.group_id] = groups[r.group_id]
            if i in failed:
                self._finish(r, RequestStatus.FINISHED_ERROR, error=failed[i])
                continue
            if r.first_token_time is None:
                r.first_token_time = now
            token = tokens[i]
            r.append_token(token)
            r.token_logprobs.append(logprobs[i])
            r.raw_logprobs.append(raw[i])
            r.log_kept_mass.append(kept[i])
            if r.top_logprobs is not None and top_ids is not None:
                k = r.params.logprobs or 0
                # Candidates cut by truncation carry -inf: they were never possible, so leave them out.
                r.top_logprobs.append(
                    {t: lp for t, lp in zip(top_ids[i][:k], top_lp[i][:k]) if lp > -math.inf}
                )
            generated += 1
            status = self._stop_status(r, token)
            if status is not None:
                self._finish(r, status)
        self.stats.generated_tokens += generated
        self._publish(result.crossed)

    def _publish(self, requests: list[Request]) -> None:
        for r in requests:
            if not r.is_finished and not r.pending:
                self.block_manager.cache_computed_blocks(r)

    def _fork(self, follower: Request) -> None:
        leader = self.groups[follower.group_id].samples[0]
        try:
            # The prompt only: with overlap scheduling the leader may already have computed its
            # first sampled token, which is not the follower's.
            pair = self.block_manager.fork(leader, follower, leader.num_prompt_tokens)
        except MemoryError:
            # No block for the private tail copy: recompute this sample from the prefix cache instead.
            follower.status = RequestStatus.WAITING
            self.scheduler.requeue(follower)
        else:
            if pair is not None:
                self._pending_copies.append(pair)
            self.scheduler.add_running(follower)
        if follower in leader.followers:
            leader.followers.remove(follower)

    def _stop_status(self, r: Request, token: int) -> RequestStatus | None:
        params = r.params
        num_tokens = len(r.token_ids)
        num_output = num_tokens - r.num_prompt_tokens
        if num_output >= params.min_tokens and (token in r.eos_token_ids or token in params.stop_token_ids):
            r.stop_reason = token if token in params.stop_token_ids else None
            return RequestStatus.FINISHED_STOPPED
        if r.output_state.matcher is not None:
            stop = self.output_processor.check_stop_strings(r, token)
            if stop is not None:
                r.stop_reason = stop
                return RequestStatus.FINISHED_STOPPED
        if num_output >= r.max_tokens or num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, r: Request, status: RequestStatus, error: str | None = None) -> None:
        """The one place a sequence ends: sets its status and frees its blocks."""
        assert not r.is_finished, f"{r.request_id} finished twice"
        r.drop_placeholder()
        r.status = status
        r.finish_reason = status.value
        r.error = error
        if status is RequestStatus.FINISHED_ERROR:
            self.stats.requests_failed += 1
            logger.warning("request %s failed: %s", r.request_id, error)
        elif status is RequestStatus.FINISHED_ABORTED:
            self.stats.requests_aborted += 1
        else:
            self.stats.requests_finished += 1
        group = self.groups.get(r.group_id)
        leader = group.samples[0] if group else None
        if leader is not None and r in leader.followers:
            leader.followers.remove(r)  # never forked: it holds no blocks
        elif r.status is not RequestStatus.WAITING_FOR_FORK:
            if r in self.scheduler.waiting:
                self.scheduler.waiting.remove(r)
            self.block_manager.free(r)
        if r is leader and r.followers and r.num_output_tokens == 0:
            # The leader ended before its prompt was computed (abort/failure): so do its followers.
            for follower in list(r.followers):
                self._finish(follower, status, error)

    def _group_output(self, group: RequestGroup, delta: bool = False) -> RequestOutput:
        out = self.output_processor.make_output(group, delta=delta)
        if group.all_finished():
            self.groups.pop(group.request_id, None)
        return out

    def _account(self, sched, batch: ModelInput | None, times: dict[str, float]) -> StepStats:
        s = self.stats
        s.steps += 1
        s.preemptions += len(sched.preempted)
        s.prefix_cache_queries = self.block_manager.stats.queries
        s.prefix_cache_hits = self.block_manager.stats.hits
        s.prompt_tokens_computed = self.scheduler.stats.prompt_tokens_computed
        s.batched_seqs += len(sched.scheduled)
        for key, value in times.items():
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
            times=times,
        )
        return self.last_step

    # ------------------------------------------------------------------ memory
    def release_memory(self) -> None:
        """Frees the KV cache tensors.  Only allowed when no request is in flight."""
        if self.has_unfinished():
            raise RuntimeError("release_memory() needs an idle engine: requests are still in flight")
        self._prepared = self._deferred = None  # only ended requests can be left in them
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


def _as_token_list(token_ids: Sequence[int]) -> list:
    """Plain Python ints (numpy and tensor integers included); anything else is left for validation."""
    out = []
    for t in token_ids:
        try:
            out.append(operator.index(t))
        except TypeError:
            out.append(t)
    return out
