"""The update rules of a step: what its computed and sampled tokens do to the requests.

Torch-free like the rest of ``core/``.  The engine calls these functions with the tokens it read
back from the device; the property tests call the very same functions with generated tokens, so
the rules that run are the rules that are tested.

A step, seen from here:

1. :func:`advance` when the forward is launched: the scheduled positions count as computed,
   provisionally (a drafted position whose token is not accepted is rolled back in 2).
2. :func:`apply_sampled` once the sampled tokens are on the host: forks n>1 samples off their
   leader's prompt, commits each sampled row's *run* of tokens (one token, or the accepted drafts
   and the token sampled after them) one token at a time, checking stops, ``max_tokens`` and the
   length limit after each, so a stop inside a run drops the rest of it; rolls back the positions
   computed for drafts that were not accepted (their blocks freed); ends sequences (:func:`finish`,
   the one place a sequence ends and frees its blocks); and publishes the full blocks the step
   completed to the prefix cache.

With overlap scheduling (2) runs one step after (1), so the next step may already be scheduled
around a token that is still on the device (``Request.pending``); a token sampled for a sequence
that ended in between is dropped.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cbgen.core.cache_pools import BlockCopy, ForkCopies
from cbgen.core.scheduler import Scheduler
from cbgen.request import Request, RequestGroup, RequestStatus

# (request, its newest token) -> the stop string that token completed, or None.
StopStringCheck = Callable[[Request, int], "str | None"]


@dataclass
class SampledTokens:
    """One step's sampled rows on the host; row ``i`` belongs to the step's ``i``-th sampling sequence.

    The per-token fields (``top_ids``/``top_logprobs`` included) hold every row's run, concatenated
    in row order: row ``i`` owns ``runs[i]`` consecutive entries (one each when ``runs`` is None, a
    step without drafts).  ``failed`` is keyed by row.  ``rejected[i]``: positions computed for
    row ``i``'s drafts whose tokens were not accepted (rolled back)."""

    token_ids: list[int]
    logprobs: list[float]
    raw_logprobs: list[float]
    log_kept_mass: list[float]
    kept_counts: list[int] = field(default_factory=list)  # the kept-set record (SamplerOutput)
    kept_thresholds: list[float] = field(default_factory=list)
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    failed: dict[int, str] = field(default_factory=dict)  # row -> why nothing could be sampled
    runs: list[int] | None = None
    rejected: list[int] | None = None


@dataclass
class StepUpdate:
    """What applying a step changed."""

    touched: list[Request] = field(default_factory=list)  # got a token or ended
    ended: list[Request] = field(default_factory=list)  # reached a terminal status, in order
    copies: list[BlockCopy] = field(default_factory=list)  # copy-on-fork blocks
    state_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-fork (src, dst) state slots
    num_generated: int = 0


def sampling_sequences(request: Request, num_new_tokens: int) -> list[Request]:
    """The sequences that sample from ``request``'s last row in a step that computes
    ``num_new_tokens`` of it: none mid-prefill, else the request itself, followed by its n>1
    followers when this completes the group's shared prompt.  (A row with drafts reaches past its
    tokens by its drafts, and samples at each of their positions and after them.)"""
    if request.num_computed_tokens + num_new_tokens != request.num_tokens + len(request.draft_token_ids):
        return []
    if request.followers and request.num_tokens == request.num_prompt_tokens:
        return [request, *request.followers]
    return [request]


def advance(scheduled: list[tuple[Request, int]], block_size: int) -> list[Request]:
    """Counts a launched step's tokens as computed; returns the requests that completed a block
    (published by :func:`apply_sampled` once all their tokens are known)."""
    crossed = []
    for r, n in scheduled:
        before = r.num_computed_tokens
        r.num_computed_tokens = before + n
        if (before + n) // block_size > before // block_size:
            crossed.append(r)
    return crossed


def publish(scheduler: Scheduler, requests: list[Request]) -> None:
    """Offers the full computed blocks of ``requests`` to the prefix cache."""
    for r in requests:
        if not r.is_finished and not r.pending:
            scheduler.block_manager.cache_computed_blocks(r)


def apply_sampled(
    scheduler: Scheduler,
    requests: list[Request],
    sampled: SampledTokens,
    crossed: list[Request],
    *,
    max_model_len: int,
    stop_string: StopStringCheck | None = None,
) -> StepUpdate:
    """Applies one step's sampled tokens to its sampling sequences ``requests`` (see module docstring)."""
    update = StepUpdate()
    # Forks first: a leader may finish in this very step and free its blocks.
    for r in requests:
        if r.status is RequestStatus.WAITING_FOR_FORK:
            forked = fork_follower(scheduler, r)
            if forked is not None:
                update.copies += forked.blocks
                if forked.state is not None:
                    update.state_copies.append(forked.state)
    tokens, failed, runs, rejected = sampled.token_ids, sampled.failed, sampled.runs, sampled.rejected
    logprobs, raw, kept_mass = sampled.logprobs, sampled.raw_logprobs, sampled.log_kept_mass
    kept_counts, kept_thresholds = sampled.kept_counts, sampled.kept_thresholds
    top_ids, top_lps = sampled.top_ids, sampled.top_logprobs
    now = time.monotonic()
    end = 0  # past the row's last entry in the per-token fields
    # Runs for every sampled sequence every step: each attribute is read once, and the tokens of a
    # run are committed in the loop itself (a call per token showed in the overhead workload).
    for i, r in enumerate(requests):
        start = end
        end += 1 if runs is None else runs[i]
        if rejected is not None and rejected[i]:
            rollback(scheduler, r, rejected[i])
        if r.draft_token_ids:
            r.draft_token_ids = []  # consumed by this step, accepted or not
        if r.is_finished:
            continue  # ended (stopped, aborted) after this step was launched: its tokens are dropped
        update.touched.append(r)
        if i in failed:
            update.ended += finish(scheduler, r, RequestStatus.FINISHED_ERROR, failed[i])
            continue
        if r.first_token_time is None:
            r.first_token_time = now
        for j in range(start, end):
            token = tokens[j]
            r.append_token(token)
            r.token_logprobs.append(logprobs[j])
            r.raw_logprobs.append(raw[j])
            r.log_kept_mass.append(kept_mass[j])
            if kept_counts:
                r.kept_counts.append(kept_counts[j])
                r.kept_thresholds.append(kept_thresholds[j])
            else:
                r.kept_counts.append(0)
                r.kept_thresholds.append(-math.inf)
            if r.top_logprobs is not None and top_ids is not None:
                k = r.params.logprobs or 0
                # Candidates cut by truncation carry -inf: they were never possible, so leave them out.
                pairs = zip(top_ids[j][:k], top_lps[j][:k])
                r.top_logprobs.append({t: lp for t, lp in pairs if lp > -math.inf})
            update.num_generated += 1
            status = stop_status(r, token, max_model_len, stop_string)
            if status is not None:
                if not r.pending:
                    # Its blocks stay findable once freed: a prompt that ends at its first token
                    # (max_tokens=1, scoring) would otherwise never serve the prompts that share it.
                    scheduler.block_manager.cache_computed_blocks(r)
                update.ended += finish(scheduler, r, status)
                break  # the rest of the run is dropped (its blocks went with the request)
    publish(scheduler, crossed)
    return update


def rollback(scheduler: Scheduler, r: Request, num_positions: int) -> None:
    """Takes back the last ``num_positions`` positions :func:`advance` counted as computed for ``r``
    (drafts whose tokens were not accepted) and frees the blocks past its tokens.  Nothing from them
    was published: publishing happens after this, and only over computed positions."""
    r.num_computed_tokens -= num_positions
    assert r.num_computed_tokens >= 0, (r.request_id, num_positions)
    if not r.is_finished:
        scheduler.block_manager.truncate(r, max(r.num_tokens, r.num_computed_tokens))


def stop_status(
    r: Request, token: int, max_model_len: int, stop_string: StopStringCheck | None = None
) -> RequestStatus | None:
    """The terminal status ``token`` (just appended) puts ``r`` in, or None to go on.  Sets
    ``stop_reason`` for stop tokens and strings."""
    params = r.params
    num_tokens = len(r.token_ids)
    num_output = num_tokens - r.num_prompt_tokens
    if num_output >= params.min_tokens and (token in r.eos_token_ids or token in params.stop_token_ids):
        r.stop_reason = token if token in params.stop_token_ids else None
        return RequestStatus.FINISHED_STOPPED
    if stop_string is not None and params.stop:
        matched = stop_string(r, token)
        if matched is not None:
            r.stop_reason = matched
            return RequestStatus.FINISHED_STOPPED
    if num_output >= r.max_tokens or num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def fork_follower(scheduler: Scheduler, follower: Request) -> ForkCopies | None:
    """Starts an n>1 sample off its leader's computed prompt; returns the copies it needs.

    Full prompt blocks are shared; the partial last one is copied, and so is the leader's state slot
    (models with state layers).  When that is not possible (no seat reserved for it, no free block
    or slot for the copy, the leader lost its prompt's K/V to a preemption, or its state already
    holds its first sampled token) the sample is queued on its own instead and recomputes the
    prompt, usually from the prefix cache."""
    leader = follower.leader
    assert leader is not None, follower.request_id
    leader.followers.remove(follower)
    follower.leader = None
    seated = leader.fork_seats > 0
    leader.fork_seats -= seated
    pools = scheduler.block_manager
    # A state is the whole prefix's: the leader's is the prompt's only until its first sampled token
    # is computed (overlap scheduling may already have done that).
    prompt_state = pools.slots is None or leader.num_computed_tokens == leader.num_prompt_tokens
    if seated and leader.num_computed_tokens >= leader.num_prompt_tokens and prompt_state:
        try:
            # The prompt only: with overlap scheduling the leader may already have computed its
            # first sampled token, which is not the follower's.
            copies = pools.fork(leader, follower, leader.num_prompt_tokens)
        except MemoryError:
            pass
        else:
            scheduler.add_running(follower)
            return copies
    scheduler.requeue(follower)
    return None


def finish(
    scheduler: Scheduler, r: Request, status: RequestStatus, error: str | None = None
) -> list[Request]:
    """The one place a sequence ends: sets its status and frees its blocks.  A leader that ends
    before its prompt produced anything takes its unforked followers with it.  Returns every
    sequence that ended here.  ``running`` is swept later by :meth:`Scheduler.remove_finished`."""
    assert not r.is_finished, f"{r.request_id} finished twice"
    was_forking = r.status is RequestStatus.WAITING_FOR_FORK
    was_waiting = r.status is RequestStatus.WAITING
    r.pending = False
    r.status = status
    r.finish_reason = status.value
    r.error = error
    ended = [r]
    if was_forking:
        leader = r.leader
        leader.followers.remove(r)  # never forked: it holds no blocks
        leader.fork_seats = min(leader.fork_seats, len(leader.followers))  # nor a seat any more
        r.leader = None
    else:
        if was_waiting and r in scheduler.waiting:
            scheduler.waiting.remove(r)
        scheduler.block_manager.free(r)
    if r.followers and r.num_output_tokens == 0:
        for follower in list(r.followers):
            ended += finish(scheduler, follower, status, error)
    return ended


def restart_group(scheduler: Scheduler, group: RequestGroup) -> list[Request]:
    """Puts a group back in the state it was added in (a weight change: every output must come from
    one weight version).  Every sample forgets its tokens, those that had finished included; those
    that did not end by abort or error run again, the first of them prefilling for the others.
    Returns the revived samples, leader first (the caller queues the leader and resets their text
    state)."""
    samples = []
    for sample in group.samples:
        if sample.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
            sample.reset_outputs()  # it stays ended, but what it had came from the old weights
            continue
        if sample.is_finished:
            scheduler.stats.requests_finished -= 1  # it ends again, under the new weights
        scheduler.remove(sample)  # an ended sample may still sit in ``running`` until swept
        sample.reset_outputs()
        sample.finish_reason = sample.stop_reason = None
        sample.first_token_time = None
        samples.append(sample)
    if samples:
        leader, followers = samples[0], samples[1:]
        leader.leader, leader.followers, leader.fork_seats = None, followers, 0
        leader.status = RequestStatus.WAITING
        for follower in followers:
            follower.leader, follower.followers = leader, []
            follower.status = RequestStatus.WAITING_FOR_FORK
    return samples
