"""The run driver of the step-contract tests: schedule -> propose drafts -> advance -> verify (fake)
-> apply, as the engine would, with a stand-in model (:func:`sched_driver.fake_token`)."""

from __future__ import annotations

import random

from sched_driver import MAX_MODEL_LEN, fake_token, make_group

from cbgen.core import update
from cbgen.core.block_manager import BlockManager
from cbgen.core.cache_pools import BlockCopy, CachePools
from cbgen.core.scheduler import Scheduler
from cbgen.core.slots import SlotPool
from cbgen.core.update import SampledTokens
from cbgen.request import Request, RequestStatus


def make_pools(num_blocks: int, block_sizes: tuple[int, ...], slots: int | None, caching: bool) -> CachePools:
    pools = [BlockManager(num_blocks, bs, caching, group=g) for g, bs in enumerate(block_sizes)]
    for p in pools[1:]:
        p.stats = pools[0].stats
    return CachePools(pools, SlotPool(slots) if slots else None)


class RunDriver:
    """Schedule -> propose drafts -> advance -> verify (fake) -> apply, as the engine would."""

    def __init__(self, pools: CachePools, budget: int, max_seqs: int, rng: random.Random) -> None:
        self.pools = pools
        self.sched = Scheduler(pools, budget, max_seqs)
        self.rng = rng
        self.all: list[Request] = []
        self.rejected_total = 0
        self.accepted_total = 0
        self.copies: list[BlockCopy] = []
        self.state_copies: list[tuple[int, int]] = []
        # Fork copies of the last applied step, which the next forward performs first.
        self.pending_blocks: list[BlockCopy] = []
        self.pending_states: list[tuple[int, int]] = []
        self.propose_drafts = True

    def add(self, rid: str, prompt: list[int], max_tokens: int, n: int, eos: bool) -> None:
        samples = make_group(rid, prompt, max_tokens, n, eos)
        self.all += samples
        self.sched.add(samples[0])

    def _propose(self) -> None:
        """Up to 4 drafts for decoding rows, each right (the stand-in's next token) with chance 1/2."""
        if not self.propose_drafts:
            return
        for r in self.sched.running:
            if r.num_tokens - r.num_computed_tokens != 1 or self.rng.random() < 0.3:
                continue
            seq = list(r.token_ids)
            drafts = []
            for _ in range(self.rng.randrange(1, 5)):
                right = fake_token(seq, r.sample_index)
                tok = right if self.rng.random() < 0.5 else (right + 1 + self.rng.randrange(90)) % 97
                drafts.append(tok)
                seq.append(tok)
            r.draft_token_ids = drafts

    def forward(
        self, scheduled: list[tuple[Request, int]], copies: list[BlockCopy]
    ) -> dict[int, list[int]] | None:
        """The step's forward, before its tokens count as computed, after ``copies`` (this step's and
        the pending fork copies) are performed: per sampling sequence (by ``id``), the model's token
        at each sampled position (one per draft and one after them).  None: no model; the stand-in
        reads the sequence itself."""
        return None

    def _verify(self, r: Request, predicted: list[int] | None) -> tuple[list[int], int]:
        """The run for ``r``'s row: its drafts as far as the model agrees, then the model's token
        after them; and how many drafted positions were not accepted."""
        seq = list(r.token_ids)
        run: list[int] = []
        for d in r.draft_token_ids:
            right = fake_token(seq, r.sample_index) if predicted is None else predicted[len(run)]
            if d != right:
                break
            run.append(d)
            seq.append(d)
        run.append(fake_token(seq, r.sample_index) if predicted is None else predicted[len(run)])
        return run, len(r.draft_token_ids) - (len(run) - 1)

    def step(self) -> None:
        self._propose()
        out = self.sched.schedule()
        assert out.num_tokens <= self.sched.max_num_batched_tokens
        self.copies += out.copies
        for r in out.failed:
            update.finish(self.sched, r, RequestStatus.FINISHED_ERROR, r.error)
        requests = []
        for r, n in out.scheduled:
            assert n >= 1 and r.num_computed_tokens + n <= r.num_tokens + len(r.draft_token_ids)
            for p in self.pools.pools:
                table = r.block_tables[p.group]
                assert len(table) * p.block_size >= r.num_computed_tokens + n, (p.group, r.request_id)
            if self.pools.slots is not None:
                assert r.state_slot is not None
            requests += update.sampling_sequences(r, n)
        # A request whose drafts were scheduled but that does not sample here (mid-prefill) keeps
        # them for its last chunk; one that was not scheduled this step loses them.
        scheduled = {id(r) for r, _ in out.scheduled}
        for r in self.sched.running:
            if id(r) not in scheduled:
                r.draft_token_ids = []
        predicted = None
        if out.scheduled:
            predicted = self.forward(out.scheduled, [*self.pending_blocks, *out.copies])
            self.pending_blocks, self.pending_states = [], []
        crossed = update.advance(out.scheduled, self.pools.block_size)
        runs, rejected, tokens = [], [], []
        for r in requests:
            run, rej = self._verify(r, None if predicted is None else predicted[id(r)])
            runs.append(len(run))
            rejected.append(rej)
            tokens += run
            self.rejected_total += rej
            self.accepted_total += len(run) - 1
        zeros = [0.0] * len(tokens)
        sampled = SampledTokens(tokens, zeros, zeros, zeros, runs=runs, rejected=rejected)
        result = update.apply_sampled(self.sched, requests, sampled, crossed, max_model_len=MAX_MODEL_LEN)
        self.copies += result.copies
        self.state_copies += result.state_copies
        self.pending_blocks += result.copies
        self.pending_states += result.state_copies
        assert all(r.is_finished for r in result.ended)
        self.sched.remove_finished()

    def check(self) -> None:
        live = [r for r in self.all if not r.is_finished and r.status is not RequestStatus.WAITING_FOR_FORK]
        self.pools.check_invariants(live)
        for r in live:
            assert r.num_computed_tokens <= r.num_tokens
            generated = r.num_output_tokens
            assert len(r.raw_logprobs) == len(r.token_logprobs) == len(r.kept_counts) == generated
        for c in self.copies:
            assert 0 <= c.group < len(self.pools.pools)
