"""Per-sequence state that moves between the scheduler, the model runner and the output layer."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from cbgen.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Lifecycle of one sequence. Every sequence reaches exactly one FINISHED_* status."""

    WAITING = "waiting"
    RUNNING = "running"
    WAITING_FOR_FORK = "waiting_for_fork"  # an n>1 sample waiting for the shared prompt prefill
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        """True for the four terminal states."""
        return id(self) in _TERMINAL


# Member identities, not a test on ``.value`` (or a set of members, whose hash is Python code):
# this is asked several times per request per step, and the enum machinery was a measurable share
# of a step's Python time.
_TERMINAL = frozenset(
    id(s)
    for s in (
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    )
)


@dataclass(frozen=True)
class RopeSwitch:
    """When the sequence reaches ``at`` tokens its K/V is dropped and recomputed, every token with a
    rotary extent of at least ``at``, and its prefix-cache salt becomes ``salt`` (what its blocks
    hold from then on is what a prompt of ``at`` tokens or more holds)."""

    at: int
    salt: int


@dataclass(eq=False)
class Request:
    """One sequence: a prompt plus the tokens generated so far.

    There is no separate prefill phase: ``num_computed_tokens`` (tokens whose K/V sit in the
    cache) catches up with ``num_tokens``.  A prefill chunk, a decode step and a recompute after
    preemption all just advance it.  With ``n > 1`` one user request becomes ``n`` sequences that
    share ``group_id``; sample 0 prefills the prompt and the others fork from it.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    group_id: str = ""
    sample_index: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    prompt: str | None = None
    # The root of the request's prefix-cache hash chain: requests whose equal tokens may hold
    # different K/V (a rotary frequency set chosen by the prompt's length, cbgen.model.rotary)
    # differ here; None for everything else.
    cache_salt: int | None = None
    # A model that recomputes a sequence's whole cache once the sequence reaches a length (Phi-3's
    # rotary switch, cbgen.model.rotary): see RopeSwitch.  ``rope_switched`` once it happened.
    rope_switch: RopeSwitch | None = None
    rope_switched: bool = False

    token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # Per cache group (cbgen.core.cache_pools): the blocks holding its tokens, and the prefix hashes
    # of its full blocks.  Group 0 is also ``block_ids`` / ``block_hashes``.
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])
    hash_tables: list[list[int]] = field(default_factory=lambda: [[]])
    state_slot: int | None = None  # its slot in the state pool, where the model keeps per-sequence state
    # Tokens proposed for the next step after its last token (a drafter's); scheduled as extra query
    # positions, kept or rolled back when the step is applied (cbgen.core.update).
    draft_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    num_preemptions: int = 0
    # n>1: sample 0 (the leader) holds samples 1..n-1 until they fork from its prompt; each of those
    # points back at it.  Not in repr: the two would recurse.
    followers: list[Request] = field(default_factory=list, repr=False)
    leader: Request | None = field(default=None, repr=False)
    fork_seats: int = 0  # leader: followers that fork straight into running (seats reserved)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    weight_version: int = 0

    # Per generated token, always filled (RL needs them).
    token_logprobs: list[float] = field(default_factory=list)
    raw_logprobs: list[float] = field(default_factory=list)
    log_kept_mass: list[float] = field(default_factory=list)
    # The behaviour-policy record of each token's kept set (cbgen.processed_logprobs).
    kept_counts: list[int] = field(default_factory=list)
    kept_thresholds: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Output-layer state (detokeniser, stop strings), owned by the engine's output processor.
    output_state: Any = None
    first_token_time: float | None = None
    # Overlap scheduling: one more token was sampled on the device and is not read back yet.  It
    # counts in ``num_tokens`` (the scheduler gives it its decode step; the runner patches the
    # input in on the device) but is not in ``token_ids``, so nothing else ever sees a stand-in.
    pending: bool = False
    # Structured output: this sequence's grammar matcher (cbgen.sample.structured), made on first use.
    structured_state: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        if not self.group_id:
            self.group_id = self.request_id
        if self.params.logprobs is not None:
            self.top_logprobs = []

    @property
    def block_ids(self) -> list[int]:
        """Group 0's block table (the only one for most models)."""
        return self.block_tables[0]

    @block_ids.setter
    def block_ids(self, table: list[int]) -> None:
        self.block_tables[0] = table

    @property
    def block_hashes(self) -> list[int]:
        """Group 0's prefix hashes."""
        return self.hash_tables[0]

    def forget_hashes(self) -> None:
        """Drops the prefix hashes (its tokens or what their K/V hold changed); recomputed on demand."""
        for hashes in self.hash_tables:
            hashes.clear()

    @property
    def prefix_salt(self) -> int | None:
        """The root of the request's prefix-cache hash chain (see ``cache_salt``, ``rope_switch``)."""
        return self.rope_switch.salt if self.rope_switched else self.cache_salt

    @property
    def rope_floor(self) -> int:
        """The smallest rotary extent any of its tokens gets (cbgen.model.rotary)."""
        return self.rope_switch.at if self.rope_switched else 0

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens, counting one still on the device."""
        return len(self.token_ids) + self.pending

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens read back so far (a token still on the device is not counted)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens (a copy)."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        """True once the request reached a terminal status."""
        return id(self.status) in _TERMINAL

    @property
    def max_tokens(self) -> int:
        """Generation limit; ``None`` in the params is resolved by the engine before scheduling."""
        assert self.params.max_tokens is not None
        return self.params.max_tokens

    def append_token(self, token_id: int) -> None:
        """Adds one sampled token (its K/V is computed in the next step), resolving the pending one."""
        self.token_ids.append(token_id)
        self.pending = False

    def reset_outputs(self) -> None:
        """Forgets every generated token and its logprobs (a restart from the prompt)."""
        del self.token_ids[self.num_prompt_tokens :]
        self.forget_hashes()  # they covered the dropped tokens too
        self.rope_switched = False  # the prompt alone has not reached the switch
        self.pending = False
        self.num_computed_tokens = 0
        self.token_logprobs.clear()
        self.raw_logprobs.clear()
        self.log_kept_mass.clear()
        self.kept_counts.clear()
        self.kept_thresholds.clear()
        self.structured_state = None  # its matcher consumed the dropped tokens
        if self.top_logprobs is not None:
            self.top_logprobs.clear()
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = [None]


@dataclass(eq=False)
class RequestGroup:
    """One user request: its ``n`` sequences (sample 0 first) and how its outputs are reported."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[Request]
    stream: bool = False

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: frozenset[int],
        prompt: str | None = None,
        stream: bool = False,
        weight_version: int = 0,
        cache_salt: int | None = None,
        rope_switch: RopeSwitch | None = None,
    ) -> RequestGroup:
        """A new group of ``params.n`` sequences: sample 0 leads (and holds the prompt logprobs),
        the others wait to fork from its prompt."""
        samples = [
            Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=prompt_token_ids,
                params=params,
                eos_token_ids=eos_token_ids,
                group_id=request_id,
                sample_index=i,
                prompt=prompt,
                weight_version=weight_version,
                cache_salt=cache_salt,
                rope_switch=rope_switch,
            )
            for i in range(params.n)
        ]
        leader = samples[0]
        if params.prompt_logprobs is not None:
            leader.prompt_logprobs = [None]
        leader.followers = samples[1:]
        for follower in leader.followers:
            follower.leader = leader
            follower.status = RequestStatus.WAITING_FOR_FORK
        return cls(request_id, prompt, prompt_token_ids, params, samples, stream)

    def all_finished(self) -> bool:
        """True once every sample reached a terminal status."""
        return all(s.is_finished for s in self.samples)
