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
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from cbgen.core.block_manager import BlockManager
from cbgen.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """What to compute this step: ``(request, num_new_tokens)`` pairs, plus requests that changed state."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens computed by this step."""
        return sum(n for _, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    """Decides which tokens of which requests are computed in each step (see module docstring)."""

    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = block_manager.stats  # one record for the whole engine

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

    # ------------------------------------------------------------------ the step
    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.preemptions += 1
        self.requeue(request)

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
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
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
                victim = self.running.pop()  # newest first
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append((request, num_new))
                budget -= num_new
                i += 1
                continue
            break

        if not out.preempted:
            budget = self._admit(out, budget)
        self.stats.prompt_tokens_computed += sum(
            max(0, min(r.num_prompt_tokens - r.num_computed_tokens, n)) for r, n in out.scheduled
        )
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        """Admits waiting requests, in order, while budget, seats and blocks last; returns the budget left.

        An n>1 leader reserves a seat for each follower that fits now; the others are queued on
        their own when the prompt is computed (a later wave that reuses the cached prompt blocks)."""
        bm = self.block_manager
        seats = self.num_seats_used
        while self.waiting and budget > 0 and seats < self.max_num_seqs:
            request = self.waiting[0]
            if request.pending:
                break  # preempted with a token still on the device: a prefill needs its value
            cached = bm.match_prefix(request)
            num_cached_tokens = len(cached) * bm.block_size
            num_new = min(request.num_tokens - num_cached_tokens, budget)
            if bm.blocks_needed(num_cached_tokens + num_new) > bm.num_blocks:
                self._fail_never_fits(request, num_cached_tokens + num_new, out)
                self.waiting.popleft()
                continue
            if not bm.allocate(request, num_new, cached):
                if not self.running and not out.scheduled:
                    # The pool is as empty as it will ever be: this request can never fit.
                    self.waiting.popleft()
                    need = bm.blocks_needed(request.num_tokens)
                    request.error = (
                        f"request needs {need} KV blocks of {bm.block_size} tokens but the cache has "
                        f"only {bm.num_blocks}; raise num_blocks/kv_cache_memory or shorten the request"
                    )
                    out.failed.append(request)
                    continue
                break
            self.waiting.popleft()
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached_tokens
            self.stats.prefix_cache_queries += request.num_tokens
            self.stats.prefix_cache_hits += num_cached_tokens
            request.status = RequestStatus.RUNNING
            request.fork_seats = min(len(request.followers), self.max_num_seqs - seats - 1)
            self.running.append(request)
            out.scheduled.append((request, num_new))
            budget -= num_new
            seats += 1 + request.fork_seats
        return budget
