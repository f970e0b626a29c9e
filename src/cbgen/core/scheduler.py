"""Token-budget scheduler: running requests first, chunked prefill, recompute preemption.

Each step hands out at most ``max_num_batched_tokens`` tokens.  Running requests come first, in
arrival order, each asking for what it still lacks (one token when decoding, the rest of its prompt
when prefilling, capped by the budget, which is what chunks a long prefill).  If the block pool
runs dry, the newest running request is preempted: its blocks are freed and it goes back to the
front of the queue to be recomputed later (the prefix cache usually makes that cheap).  Waiting
requests are admitted first come, first served, only while budget, sequence slots and blocks remain,
and never in a step that had to preempt, so admission cannot evict work that was already running.

A running request whose newest token is still on the device (overlap scheduling) is scheduled as
usual: that token is its next input, patched in on the device.  A preempted one waits until the
token is read back, since a prefill needs its value.

With ``n > 1`` only sample 0 (the leader) is queued; it reserves a seat for each follower that fits
in ``max_num_seqs`` now.  Those join ``running`` when the leader's prompt is computed (they fork its
blocks); the rest are queued on their own and run in later waves from the cached prompt blocks.

A request whose tokens need more blocks than the whole pool fails with a reason instead of
preempting itself forever.

Models with state layers (``prefill_align`` set, :mod:`cbgen.model.state_cache`) chunk by one more
rule, :meth:`Scheduler.span`: a prompt chunk that does not finish the prompt ends at a multiple of
``prefill_align`` (their mixers' chunk size, so each chunk computes what ``generate()``'s one-piece
prefill does; 0: the prompt goes in one piece, for models that cannot continue a multi-token
forward), and tokens past the prompt (generated ones, recomputed after a preemption) go one per
step, in the decode form ``generate()`` computed them in.  When the budget left holds no whole
aligned chunk, a prompt still takes one chunk of up to ``prefill_align`` tokens (its whole rest with
0), so a step can pass the budget rather than leave prompts waiting behind decodes.

Two policies sit on top, each in its own module: jobs, pauses and fairness
(:mod:`cbgen.core.fairness`: with ``Scheduler.fairness`` set, jobs are served least attained
service first instead of first come, first served), and cache-aware admission
(:mod:`cbgen.core.cache_aware`: a prompt waits one step for a block another request completes in
this step instead of computing it twice).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from cbgen.core.block_manager import BlockManager
from cbgen.core.cache_aware import ComputingBlocks
from cbgen.core.cache_pools import BlockCopy, CachePools, StateCopy
from cbgen.core.fairness import Fairness, Jobs, RequestFilter
from cbgen.request import Request, RequestStatus

__all__ = ["Fairness", "RequestFilter", "Scheduler", "SchedulerOutput"]


@dataclass
class SchedulerOutput:
    """What to compute this step: ``(request, num_new_tokens)`` pairs, plus requests that changed state."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)
    # Blocks the runner copies before this step's forward: partial prefix hits (and states served
    # from a checkpoint).
    copies: list[BlockCopy | StateCopy] = field(default_factory=list)
    # States copied into checkpoint slots after this step's forward (cbgen.core.checkpoints).
    checkpoints: list[StateCopy] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens computed by this step."""
        return sum(n for _, n in self.scheduled)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens computed by this step (the rest are generated tokens, or recomputed ones)."""
        return sum(max(0, min(r.num_prompt_tokens - r.num_computed_tokens, n)) for r, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    """Decides which tokens of which requests are computed in each step (see module docstring)."""

    def __init__(
        self,
        block_manager: CachePools | BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        fairness: Fairness | None = None,
        prefill_align: int | None = None,
    ) -> None:
        # Every cache group's pool (a lone BlockManager is the one-group cache).
        if isinstance(block_manager, BlockManager):
            block_manager = CachePools([block_manager])
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        # State layers' chunk rule (see the module docstring; 0: a prompt in one piece); None: none.
        self.prefill_align = prefill_align
        ckpt = self.block_manager.checkpoints
        self._checkpoint_grid = (
            ckpt.grid if ckpt is not None and self.block_manager.enable_prefix_caching else 0
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = block_manager.stats  # one record for the whole engine
        self.jobs = Jobs(fairness)  # jobs, pauses, service and the fair policy

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
        paused = self.paused
        return bool(self.running) or any(r.group_id not in paused for r in self.waiting)

    # ------------------------------------------------------------------ jobs, pauses, fairness
    @property
    def fairness(self) -> Fairness | None:
        """The fair policy (None: first come, first served); settable."""
        return self.jobs.fairness

    @fairness.setter
    def fairness(self, fairness: Fairness | None) -> None:
        self.jobs.fairness = fairness

    @property
    def paused(self) -> set[str]:
        """Ids of the paused groups (see :meth:`pause`)."""
        return self.jobs.paused

    @paused.setter
    def paused(self, group_ids: set[str]) -> None:
        self.jobs.paused = group_ids

    def set_job(self, group_id: str, job: str) -> None:
        """Counts the group's service towards ``job`` (shared with the other groups set to it)."""
        self.jobs.set_job(group_id, job)

    def release(self, group_id: str) -> None:
        """Forgets what :meth:`set_job` and :meth:`pause` recorded for a group that ended."""
        self.jobs.release(group_id)

    def pause(self, group_id: str) -> None:
        """Stops scheduling the group: it is preempted at the next schedule and waits until resumed."""
        self.jobs.pause(group_id)

    def resume(self, group_id: str) -> None:
        """Lets a paused group be admitted again (it recomputes what its preemption dropped)."""
        self.jobs.resume(group_id)

    def served(self, request: Request) -> int:
        """Tokens scheduled so far for the job ``request`` belongs to."""
        return self.jobs.served(request)

    def is_young(self, request: Request) -> bool:
        """Whether the request's job has computed fewer than ``fairness.quantum`` tokens."""
        return self.jobs.is_young(request)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        """Builds the next step's batch within the token budget and the block pool."""
        out = SchedulerOutput()
        if self.block_manager.checkpoints is not None:
            self.block_manager.checkpoints.new_step()
        self.jobs.preempt_paused(self, out)
        if self.fairness is None:
            budget, victims = self.serve_running(out, self.max_num_batched_tokens)
            if not victims:
                self.admit(out, budget)
        else:
            self.jobs.schedule_fair(self, out)
            self.jobs.charge(out.scheduled, self.running, self.waiting)
        self.stats.prompt_tokens_computed += out.num_prompt_tokens
        return out

    def span(self, request: Request, start: int, budget: int) -> int:
        """Tokens of ``request`` to compute from token ``start`` on within ``budget`` (0: none this
        step); the one place chunk sizes are decided."""
        num = min(request.num_tokens - start, budget)
        align = self.prefill_align
        if align is None:
            return num
        prompt = request.num_prompt_tokens
        if start >= prompt:
            return min(num, 1)
        end = min(prompt, start + num)
        grid = self._checkpoint_grid
        if grid:
            # End a chunk at the prompt's last grid point before its end: its checkpoint is what a
            # resubmission of the prompt hits (cbgen.core.checkpoints).
            last = (prompt - 1) // grid * grid
            if start < last < end:
                end = last
        if end < prompt:
            end = end - end % align if align else start
            if end <= start:
                end = min(prompt, start - start % align + align) if align else prompt
        return end - start

    def _file_checkpoint(self, request: Request, num_new: int, out: SchedulerOutput) -> None:
        copy = self.block_manager.checkpoint(request, num_new) if self._checkpoint_grid else None
        if copy is not None:
            out.checkpoints.append(copy)

    def preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Frees the blocks of ``request`` (already out of ``running``) and requeues it at the front,
        to be recomputed."""
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.draft_token_ids.clear()  # proposals for the step after its last token, not a recompute
        request.num_preemptions += 1
        self.stats.preemptions += 1
        self.requeue(request)
        out.preempted.append(request)

    def _fail_never_fits(self, request: Request, num_tokens: int, out: SchedulerOutput) -> None:
        """Fails ``request``: ``num_tokens`` of it need more blocks than the pool can give it, so no
        preemption can make room and retrying would loop forever.  The caller takes it off its queue."""
        request.error = (
            f"request needs {self.block_manager.describe_need(num_tokens)} for {num_tokens} tokens; raise "
            "num_blocks/kv_cache_memory or shorten the request"
        )
        out.failed.append(request)

    def serve_running(
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
            num_new = self.span(request, request.num_computed_tokens, budget)
            if num_new < 1:
                i += 1  # nothing left to compute (its last token's logits are being sampled)
                continue
            if request.draft_token_ids:
                num_new = self._with_drafts(request, num_new, budget)
            if not bm.fits(request.num_computed_tokens + num_new):
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
                self.preempt(victim, out)
                victims.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append((request, num_new))
                self._file_checkpoint(request, num_new, out)
                scheduled.add(id(request))
                budget -= num_new
                i += 1
                continue
            break
        return budget, victims

    @staticmethod
    def _with_drafts(request: Request, num_new: int, budget: int) -> int:
        """A decode row's tokens with its drafts after them, as many as ``budget`` leaves room for
        (the drafts it cannot take are dropped); a row mid-prefill keeps them for its last chunk.
        A row whose last token is still on the device takes none (its input is patched in there),
        and so does a row whose last token was computed already: the drafts are scored from the
        logits of their own step's rows, the first of which is that token's."""
        if num_new != request.num_tokens - request.num_computed_tokens:
            return num_new
        keep = 0 if request.pending or num_new < 1 else min(len(request.draft_token_ids), budget - num_new)
        del request.draft_token_ids[keep:]
        return num_new + keep

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
        self.preempt(victim, out)
        return True

    def admit(
        self,
        out: SchedulerOutput,
        budget: int,
        wanted: RequestFilter | None = None,
        evict: RequestFilter | None = None,
    ) -> int:
        """Admits waiting requests (those ``wanted`` and not paused, in :meth:`Jobs.admission_order`)
        while budget, seats and blocks last, preempting running sequences that are ``evict``-able to
        make room; returns the budget left."""
        bm, paused = self.block_manager, self.paused
        waiting = [r for r in self.waiting if r.group_id not in paused and (not wanted or wanted(r))]
        computing = ComputingBlocks(bm, out.scheduled)
        for request in self.jobs.admission_order(waiting):
            while evict and self.num_seats_used >= self.max_num_seqs and self._evict(out, evict):
                pass
            seats = self.num_seats_used
            if budget <= 0 or seats >= self.max_num_seqs or request.pending:
                break  # pending: preempted with a token still on the device, which a prefill needs
            hit = bm.match_prefix(request)
            if computing.holds_back(request, hit.num_blocks):
                continue
            first_chunk = hit.tokens + self.span(request, hit.tokens, budget)
            fits = bm.fits(first_chunk)
            placed = self._allocate_first(out, request, budget, evict) if fits else None
            if placed is None:
                # Room comes back as running work ends, and as the blocks of a request that failed in
                # this step are freed (after schedule() returns): either way the pool is not as empty
                # as it will get.
                if fits and (self.running or out.scheduled or any(r.block_ids for r in out.failed)):
                    break
                # No preemption can make room: the first chunk needs more than the pool, or the pool
                # is as empty as it will ever be.
                self.waiting.remove(request)
                self._fail_never_fits(request, first_chunk if not fits else request.num_tokens, out)
                continue
            num_new = self._start(out, request, placed, seats)
            computing.add(request, num_new)
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
            hit = bm.match_partial(request, bm.match_prefix(request))
            partial = hit.partial
            num_cached_tokens = hit.tokens + (partial[1] if partial else 0)
            num_new = self.span(request, num_cached_tokens, budget)
            if bm.allocate(request, num_new, hit):
                if partial is not None:
                    out.copies.append(BlockCopy(partial[0], request.block_ids[hit.num_blocks]))
                if hit.state is not None:
                    out.copies.append(StateCopy(hit.state, request.state_slot))
                self._file_checkpoint(request, num_new, out)
                return num_new, num_cached_tokens
            if not evict or not self._evict(out, evict):
                return None

    def _start(self, out: SchedulerOutput, request: Request, placed: tuple[int, int], seats: int) -> int:
        """Moves an admitted request, its blocks ``placed``, from the queue to ``running`` with its
        first chunk scheduled; returns that chunk's tokens.

        An n>1 leader reserves a seat for each follower that fits now (``seats`` were taken before
        it); the others are queued on their own when the prompt is computed (a later wave that reuses
        the cached prompt blocks)."""
        num_new, num_cached_tokens = placed
        self.waiting.remove(request)
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_cached_tokens
            self.jobs.charge_cached(request, num_cached_tokens)
        self.stats.prefix_cache_queries += request.num_tokens
        self.stats.prefix_cache_hits += num_cached_tokens
        request.status = RequestStatus.RUNNING
        request.fork_seats = min(len(request.followers), self.max_num_seqs - seats - 1)
        self.running.append(request)
        out.scheduled.append((request, num_new))
        return num_new
