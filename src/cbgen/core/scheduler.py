"""Token-budget scheduler: running requests first, chunked prefill, recompute preemption.

Each step hands out at most ``max_num_batched_tokens`` tokens.  Running requests come first, in
arrival order, each asking for what it still lacks (one token when decoding, the rest of its prompt
when prefilling, capped by the budget, which is what chunks a long prefill).  If the block pool
runs dry, the newest running request is preempted: its blocks are freed and it goes back to the
front of the queue to be recomputed later (the prefix cache usually makes that cheap).  Waiting
requests are admitted only while budget, sequence slots and blocks remain, and never in a step
that had to preempt, so admission cannot evict work that was already running.

A running request whose newest token is still on the device (overlap scheduling) is scheduled as
usual: that token is its next input, patched in on the device.  A preempted one waits until the
token is read back, since a prefill needs its value.

With ``n > 1`` only sample 0 (the leader) is queued; it reserves a seat for each follower that fits
in ``max_num_seqs`` now.  Those join ``running`` when the leader's prompt is computed (they fork its
blocks); the rest are queued on their own and run in later waves from the cached prompt blocks.

A request whose tokens need more blocks than the whole pool fails with a reason instead of
preempting itself forever.

Pausing: a paused group (:meth:`Scheduler.pause`; the async front end pauses a stream whose reader
fell behind) is preempted at the next schedule, keeping every token it generated, and is not admitted
again until :meth:`Scheduler.resume`.

Fairness (opt-in: ``Scheduler.fairness``; the server turns it on).  First come, first served lets one
huge request hold every seat, block and token of the budget for as long as it generates.  With a
:class:`Fairness` policy, groups belong to *jobs* (a job is one group unless :meth:`Scheduler.set_job`
puts several in one, e.g. the prompts of one HTTP request) and jobs are served least attained service
first (service: the tokens computed for a job, and the prompt tokens it found in the prefix cache),
for the budget and for admission alike.  A job is *young* until it has computed
``Fairness.quantum`` tokens, *old* after.  A young job that lacks a seat or blocks preempts the
newest sequences of the most-served old jobs.  While young jobs compute, old jobs get
``Fairness.old_share`` tokens per young token, counted over those steps (a credit: with a share of
1/4 and one young decode row per step, one old row every fourth step), and only decode rows while the
young jobs decode (a prefill chunk would take a decode step off its fast path: fused CPU kernels,
CUDA graphs).  So a small request waits for at most the step in progress, then gets its first token
after its own prefill, in steps that cost about what they would alone (at most ``1 + old_share``
times, where a step's cost grows with its tokens), whatever the size or length of the old work.
Old work never waits for young work that is blocked, and gets the whole budget once no young job
computes; young work is bounded (``quantum`` tokens per job), so old jobs always progress.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from cbgen.core.block_manager import BlockManager
from cbgen.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """What to compute this step: ``(request, num_new_tokens)`` pairs, plus requests that changed state."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)
    # (src, dst) blocks the runner copies before this step's forward: partial prefix hits.
    copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens computed by this step."""
        return sum(n for _, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass
class Fairness:
    """How a fair scheduler shares steps between jobs (see the module docstring).

    ``quantum``: tokens a job computes while it is young.  ``old_share``: while young jobs compute, old
    jobs get this many tokens per young token (None: no cap, which suits devices where a bigger step
    costs little more).
    """

    quantum: int = 512
    # A quarter: on a CPU, one more decode row can cost most of what the first one does.
    old_share: float | None = 0.25

    def __post_init__(self) -> None:
        if self.quantum < 0:
            raise ValueError(f"Fairness.quantum must be >= 0, got {self.quantum!r}")
        if self.old_share is not None and not self.old_share > 0:
            raise ValueError(f"Fairness.old_share must be > 0 or None, got {self.old_share!r}")


RequestFilter = Callable[[Request], bool]


class Scheduler:
    """Decides which tokens of which requests are computed in each step (see module docstring)."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        fairness: Fairness | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.fairness = fairness
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = block_manager.stats  # one record for the whole engine
        self.paused: set[str] = set()  # group ids
        self._job_of: dict[str, str] = {}  # group id -> job, where set_job said so
        self._job_groups: dict[str, int] = {}  # job -> groups set_job put in it and not released
        self._served: dict[str, int] = {}  # job -> tokens scheduled for it so far
        self._old_credit = 0.0  # tokens old jobs may still add to steps with young work

    # ------------------------------------------------------------------ queue management
    def add(self, request: Request) -> None:
        """Queues a new request (the leader of its group when n > 1)."""
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Adds a forked sample whose blocks are already set up; its seat was reserved by the leader."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def requeue(self, request: Request) -> None:
        """Puts a request with no blocks back at the front of the queue (it will be recomputed)."""
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def remove(self, request: Request) -> None:
        """Takes a request out of the queues and frees its blocks (it finished, failed or was aborted)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.free(request)

    def remove_finished(self) -> None:
        """Drops finished requests from ``running`` in one pass (their blocks are already freed)."""
        self.running = [r for r in self.running if not r.is_finished]

    @property
    def num_seats_used(self) -> int:
        """Running sequences plus seats reserved for followers that have not forked yet."""
        return sum(1 + r.fork_seats for r in self.running)

    def has_work(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.waiting or self.running)

    def has_runnable_work(self) -> bool:
        """True while some request could be scheduled: one runs, or one waits and is not paused."""
        return bool(self.running) or any(r.group_id not in self.paused for r in self.waiting)

    # ------------------------------------------------------------------ jobs and pauses
    def set_job(self, group_id: str, job: str) -> None:
        """Counts the group's service towards ``job`` (shared with the other groups set to it)."""
        self.release(group_id)
        self._job_of[group_id] = job
        self._job_groups[job] = self._job_groups.get(job, 0) + 1

    def release(self, group_id: str) -> None:
        """Forgets what :meth:`set_job` and :meth:`pause` recorded for a group that ended."""
        self.paused.discard(group_id)
        job = self._job_of.pop(group_id, None)
        if job is not None:
            left = self._job_groups[job] - 1
            if left:
                self._job_groups[job] = left
            else:
                del self._job_groups[job]
                self._served.pop(job, None)

    def pause(self, group_id: str) -> None:
        """Stops scheduling the group: it is preempted at the next schedule and waits until resumed."""
        self.paused.add(group_id)

    def resume(self, group_id: str) -> None:
        """Lets a paused group be admitted again (it recomputes what its preemption dropped)."""
        self.paused.discard(group_id)

    def served(self, request: Request) -> int:
        """Tokens scheduled so far for the job ``request`` belongs to."""
        return self._served.get(self._job_of.get(request.group_id, request.group_id), 0)

    def is_young(self, request: Request) -> bool:
        """Whether the request's job has computed fewer than ``fairness.quantum`` tokens."""
        return self.fairness is not None and self.served(request) < self.fairness.quantum

    def _is_old(self, request: Request) -> bool:
        return not self.is_young(request)

    def _charge(self, out: SchedulerOutput) -> None:
        served = self._served
        for request, n in out.scheduled:
            job = self._job_of.get(request.group_id, request.group_id)
            served[job] = served.get(job, 0) + n
        # Groups nobody released (no set_job) leave entries behind: drop those of jobs that are gone.
        if len(served) > 2 * (len(self.running) + len(self.waiting)) + 64:
            live = {self._job_of.get(r.group_id, r.group_id) for r in (*self.running, *self.waiting)}
            self._served = {job: n for job, n in served.items() if job in live or job in self._job_groups}

    # ------------------------------------------------------------------ the step
    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.preemptions += 1
        self.requeue(request)

    def _preempt_paused(self, out: SchedulerOutput) -> None:
        paused = [r for r in self.running if r.group_id in self.paused]
        if paused:
            self.running = [r for r in self.running if r.group_id not in self.paused]
            for request in reversed(paused):  # requeued at the front, in their running order
                self._preempt(request)
                out.preempted.append(request)

    def _fail_never_fits(self, request: Request, num_tokens: int, out: SchedulerOutput) -> None:
        """Fails ``request``: ``num_tokens`` of it need more blocks than the whole pool holds, so no
        preemption can make room and retrying would loop forever."""
        bm = self.block_manager
        request.error = (
            f"request needs {bm.blocks_needed(num_tokens)} KV blocks of {bm.block_size} tokens for "
            f"{num_tokens} tokens but the cache has only {bm.num_blocks}; raise num_blocks/kv_cache_memory "
            "or shorten the request"
        )
        out.failed.append(request)

    def schedule(self) -> SchedulerOutput:
        """Builds the next step's batch within the token budget and the block pool."""
        out = SchedulerOutput()
        self._preempt_paused(out)
        if self.fairness is None:
            budget, victims = self._serve_running(out, self.max_num_batched_tokens)
            if not victims:
                self._admit(out, budget)
        else:
            self._schedule_fair(out)
            self._charge(out)
        self.stats.prompt_tokens_computed += sum(
            max(0, min(r.num_prompt_tokens - r.num_computed_tokens, n)) for r, n in out.scheduled
        )
        return out

    def _schedule_fair(self, out: SchedulerOutput) -> None:
        """Young jobs first (running or waiting, least attained service first; admitted by evicting old
        work), then old jobs within their share of the step (see the module docstring)."""
        young, old, served = self.is_young, self._is_old, self.served
        before = len(out.preempted)  # the paused, preempted above
        self.running.sort(key=served)  # stable: each job's sequences stay in admission order
        # A running young job that has had more service than a waiting one goes after its admission.
        waiting = [served(r) for r in self.waiting if r.group_id not in self.paused and young(r)]
        cut = min(waiting, default=math.inf)
        budget, victims = self._serve_running(
            out, self.max_num_batched_tokens, lambda r: young(r) and served(r) <= cut
        )
        if not any(young(v) for v in victims):
            budget = self._admit(out, budget, young, evict=old)
        budget, _ = self._serve_running(out, budget, young)
        young_tokens = out.num_tokens
        share = self.fairness.old_share if self.fairness is not None else None
        capped = share is not None and young_tokens > 0
        if capped:
            credit = self._old_credit + share * young_tokens
            self._old_credit = min(credit, float(self.max_num_batched_tokens))
            budget = min(budget, int(self._old_credit))
        else:
            self._old_credit = 0.0
        # A step of decode rows only takes the fast path (fused CPU kernels, CUDA graphs): old work
        # must not turn young decoding into a mixed step with a prefill chunk.
        decoding = young_tokens > 0 and all(n == 1 and _decode_row(r) for r, n in out.scheduled)
        old_wanted = (lambda r: old(r) and _decode_row(r)) if decoding else old
        left, _ = self._serve_running(out, budget, old_wanted)
        if len(out.preempted) == before and not decoding:  # old work is admitted only in steps
            left = self._admit(out, left, old)  # that preempted nothing
        if capped:
            self._old_credit -= budget - left

    def _serve_running(
        self, out: SchedulerOutput, budget: int, wanted: RequestFilter | None = None
    ) -> tuple[int, list[Request]]:
        """Gives running requests (those ``wanted`` and not scheduled yet), in order, what they lack
        within ``budget``, preempting the newest unscheduled running sequences when blocks run out;
        returns the budget left and the sequences preempted."""
        bm = self.block_manager
        scheduled = {id(r) for r, _ in out.scheduled}
        victims: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if id(request) in scheduled or (wanted is not None and not wanted(request)):
                i += 1
                continue
            if request.pending and request.num_output_tokens + 1 >= request.max_tokens:
                i += 1  # its last token is in flight and ends it: nothing left to compute
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if bm.blocks_needed(request.num_computed_tokens + num_new) > bm.num_blocks:
                if request.pending:
                    i += 1  # decide once its in-flight token is known: it may stop the request
                    continue
                self._fail_never_fits(request, request.num_computed_tokens + num_new, out)
                self.running.pop(i)
                continue
            while not bm.allocate(request, num_new):
                # Newest (fair: most served) first; ``request`` itself is unscheduled, so one is found
                # at or after it and ``i`` stays valid.
                victim = self._pop_victim(scheduled)
                self._preempt(victim)
                out.preempted.append(victim)
                victims.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append((request, num_new))
                scheduled.add(id(request))
                budget -= num_new
                i += 1
                continue
            break
        return budget, victims

    def _pop_victim(self, scheduled: set[int], evictable: RequestFilter | None = None) -> Request | None:
        """Takes the last running sequence that is not scheduled in this step (and ``evictable``)."""
        for i in range(len(self.running) - 1, -1, -1):
            r = self.running[i]
            if id(r) not in scheduled and (evictable is None or evictable(r)):
                return self.running.pop(i)
        return None

    def _evict(self, out: SchedulerOutput, evictable: RequestFilter) -> bool:
        """Preempts the last running sequence that is ``evictable`` and not scheduled in this step."""
        victim = self._pop_victim({id(r) for r, _ in out.scheduled}, evictable)
        if victim is None:
            return False
        self._preempt(victim)
        out.preempted.append(victim)
        return True

    def _admit(
        self,
        out: SchedulerOutput,
        budget: int,
        wanted: RequestFilter | None = None,
        evict: RequestFilter | None = None,
    ) -> int:
        """Admits waiting requests (those ``wanted`` and not paused; fair: least served first) while
        budget, seats and blocks last, preempting running sequences that are ``evict``-able to make
        room; returns the budget left.

        An n>1 leader reserves a seat for each follower that fits now; the others are queued on
        their own when the prompt is computed (a later wave that reuses the cached prompt blocks)."""
        bm = self.block_manager
        candidates = [r for r in self.waiting if r.group_id not in self.paused and (not wanted or wanted(r))]
        if self.fairness is not None:
            candidates.sort(key=self.served)
        # Blocks this step completes: a prompt whose next uncached block is among them waits one step
        # and then finds it cached, instead of computing it a second time in the same step (64 chat
        # prompts sharing a system prompt computed ~3,000 prompt tokens where ~1,600 are distinct).
        # Only when something waits: every running row's hashes on every decode step cost ~0.1 ms.
        computing = {h for r, n in out.scheduled for h in bm.completed_hashes(r, n)} if candidates else set()
        for request in candidates:
            while evict and self.num_seats_used >= self.max_num_seqs and self._evict(out, evict):
                pass
            seats = self.num_seats_used
            if budget <= 0 or seats >= self.max_num_seqs or request.pending:
                break  # pending: preempted with a token still on the device, which a prefill needs
            cached = bm.match_prefix(request)
            if (
                computing
                and request.num_computed_tokens == 0
                and _next_block(request, len(cached)) in computing
            ):
                continue
            num_tokens = len(cached) * bm.block_size + min(
                request.num_tokens - len(cached) * bm.block_size, budget
            )
            if bm.blocks_needed(num_tokens) > bm.num_blocks:
                self._fail_never_fits(request, num_tokens, out)
                self.waiting.remove(request)
                continue
            placed = self._allocate_first(out, request, budget, evict)
            if placed is None:
                if not self.running and not out.scheduled:
                    # The pool is as empty as it will ever be: this request can never fit.
                    self.waiting.remove(request)
                    need = bm.blocks_needed(request.num_tokens)
                    request.error = (
                        f"request needs {need} KV blocks of {bm.block_size} tokens but the cache has "
                        f"only {bm.num_blocks}; raise num_blocks/kv_cache_memory or shorten the request"
                    )
                    out.failed.append(request)
                    continue
                break
            num_new, num_cached_tokens = placed
            self.waiting.remove(request)
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached_tokens
                # Prompt served from the cache counts as service: a job cannot stay young (and
                # uncapped) by sending prompts it knows are cached.
                if self.fairness is not None and num_cached_tokens:
                    job = self._job_of.get(request.group_id, request.group_id)
                    self._served[job] = self._served.get(job, 0) + num_cached_tokens
            self.stats.prefix_cache_queries += request.num_tokens
            self.stats.prefix_cache_hits += num_cached_tokens
            request.status = RequestStatus.RUNNING
            request.fork_seats = min(len(request.followers), self.max_num_seqs - seats - 1)
            self.running.append(request)
            out.scheduled.append((request, num_new))
            computing.update(bm.completed_hashes(request, num_new))
            budget -= num_new
        return budget

    def _allocate_first(
        self, out: SchedulerOutput, request: Request, budget: int, evict: RequestFilter | None
    ) -> tuple[int, int] | None:
        """Blocks for a waiting request's first chunk, reusing its cached prefix, preempting
        ``evict``-able running sequences while the pool is short: ``(num_new, num_cached_tokens)``,
        or None if it does not fit."""
        bm = self.block_manager
        while True:
            cached = bm.match_prefix(request)
            partial = bm.match_partial(request, len(cached))
            num_cached_tokens = len(cached) * bm.block_size + (partial[1] if partial else 0)
            num_new = min(request.num_tokens - num_cached_tokens, budget)
            if bm.allocate(request, num_new, cached, partial):
                if partial is not None:
                    out.copies.append((partial[0], request.block_ids[len(cached)]))
                return num_new, num_cached_tokens
            if not evict or not self._evict(out, evict):
                return None


def _next_block(request: Request, num_cached_blocks: int) -> int | None:
    """The prefix hash of the request's first block past its cached prefix (None: not a full block,
    or not hashed because the prefix cache does not serve this request)."""
    hashes = request.block_hashes
    return hashes[num_cached_blocks] if num_cached_blocks < len(hashes) else None


def _decode_row(request: Request) -> bool:
    """Whether computing the request's next tokens is one decode row (one token left to compute)."""
    return request.num_tokens - request.num_computed_tokens <= 1
