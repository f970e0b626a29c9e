"""Structured output inside the batch: one mask fill per step for every constrained row.

Each constrained sequence owns a matcher (``Request.structured_state``), created from its
constraint's compiled grammar the first time the sequence samples.  The matcher is never told about
tokens as they are sampled.  Instead, right before a step's masks are filled, each matcher catches
up with the tokens its sequence holds (``Request.token_ids``, which never contains a token still on
the device).  The matcher is therefore in step with what the sampler of that step sees, synchronous
or overlapped, and the lifecycle needs no hooks:

* preemption keeps the tokens, so the matcher stays where it was;
* a restart from the prompt (weight change, ``Request.reset_outputs``) clears the state, and a
  sequence found holding fewer tokens than its matcher consumed, or a different last token, gets a
  fresh matcher that replays what it holds;
* an n>1 follower is its own sequence with its own matcher, created when its first token is
  sampled from the leader's prompt.

The masks of all constrained rows are filled in one backend call into one bitmask and added to
those rows' logits as ``0`` / ``-inf`` in one vectorised op: each byte of the bitmask selects one
row of a 256 x 8 table.  Rows without a constraint are not touched.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cbgen.request import Request
from cbgen.sample.structured.backend import BACKENDS, DEFAULT_BACKEND, GrammarBackend, GrammarMatcher
from cbgen.sampling_params import SamplingParams
from cbgen.structured_params import StructuredOutputParams


@dataclass
class MatcherState:
    """A sequence's matcher and how many of its output tokens the matcher consumed."""

    matcher: GrammarMatcher
    consumed: int = 0
    last_token: int = -1


class StructuredOutputs:
    """Compiles constraints (cached) and masks the constrained rows of each step.

    ``tokenizer`` must be a Hugging Face fast tokenizer; ``vocab_size`` is the logits width and
    ``eos_token_ids`` the tokens a finished grammar allows.  The backend is built on first use (for
    llguidance that reads the whole vocabulary, about a second), so engines that never see a
    constrained request pay nothing; a server builds it at start instead (:meth:`prepare`), so no
    request waits for it.  ``validate`` may run on another thread than the steps (the async engine
    validates on the caller's thread): the cache and the lazy start are locked.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        backend: str = DEFAULT_BACKEND,
        cache_size: int = 256,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown structured-output backend {backend!r}; known: {sorted(BACKENDS)}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.backend_name = backend
        self.cache_size = cache_size
        self._backend: GrammarBackend | None = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._bitmask: torch.Tensor | None = None
        self._tables: dict[torch.device, torch.Tensor] = {}

    # ------------------------------------------------------------------ compiling
    @property
    def backend(self) -> GrammarBackend:
        """The grammar backend, built on first use."""
        with self._lock:
            if self._backend is None:
                if self.tokenizer is None:
                    raise ValueError(
                        "SamplingParams.structured_output needs a tokenizer (pass one to LLM/Engine)"
                    )
                if not self.eos_token_ids:
                    raise ValueError("SamplingParams.structured_output needs the model's EOS token id")
                self._backend = BACKENDS[self.backend_name](
                    self.tokenizer, self.vocab_size, self.eos_token_ids
                )
            return self._backend

    @property
    def ready(self) -> bool:
        """Whether the backend is built (a constrained request then pays only its compile)."""
        return self._backend is not None

    def prepare(self) -> bool:
        """Builds the backend now rather than on the first constrained request; True once built.

        False, and nothing raised, when it cannot be built (the grammar library is not installed,
        no tokenizer, a tokenizer it cannot read): the first constrained request then reports why,
        as it would have without this call."""
        try:
            self.backend  # noqa: B018 - the property builds it
        except (ImportError, ValueError):
            return False
        return True

    def validate(self, params: SamplingParams) -> None:
        """Compiles ``params.structured_output`` (or finds it compiled); raises ``ValueError``."""
        spec = params.structured_output
        if spec is None:
            return
        if params.ignore_eos:
            raise ValueError(
                "SamplingParams.structured_output: ignore_eos=True is not supported (a finished grammar "
                "ends the output with EOS)"
            )
        self.compiled(spec)

    def compiled(self, spec: StructuredOutputParams) -> Any:
        """The compiled grammar of ``spec``, from the cache when an equal constraint was seen."""
        key = spec.key()
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
                return hit
        backend = self.backend
        grammar = backend.compile(spec)  # outside the lock: the other thread may keep going
        with self._lock:
            self._compiled[key] = grammar
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return grammar

    # ------------------------------------------------------------------ one step
    def apply(
        self, logits: torch.Tensor, rows: Sequence[int], requests: Sequence[Request], failed: dict[int, str]
    ) -> None:
        """Masks ``logits`` rows ``rows`` (in place) with their sequences' grammars.

        A row whose tokens its grammar rejects (possible only if something outside the mask chose
        them) gets a message in ``failed`` and no mask; so does a row whose constraint does not
        compile.  Rows of sequences that ended since the step was launched are left alone: their
        tokens are dropped."""
        backend = self.backend
        num_rows, width = len(rows), logits.shape[1]
        matchers: list[tuple[GrammarMatcher, int]] = []
        for j, row in enumerate(rows):
            request = requests[row]
            if request.is_finished:
                continue
            try:
                matcher = self._caught_up(request)
            except ValueError as exc:
                failed[row] = str(exc)
                continue
            if matcher is not None:
                matchers.append((matcher, j))
            else:
                failed[row] = f"structured output: {request.structured_state.matcher.error()}"
        bitmask = self._bitmask_buffer(num_rows, (self.vocab_size + 31) // 32, logits.device)
        backend.fill(matchers, bitmask)
        bias = self._expand(bitmask, logits.device, width)
        if num_rows == logits.shape[0]:
            logits.add_(bias)
        else:
            logits.index_add_(0, torch.tensor(list(rows), device=logits.device), bias)

    def _caught_up(self, request: Request) -> GrammarMatcher | None:
        """``request``'s matcher, advanced over the output tokens it has not consumed yet; None if
        the grammar rejects one of them."""
        state: MatcherState | None = request.structured_state
        start = request.num_prompt_tokens
        tokens = request.token_ids
        held = len(tokens) - start
        if state is not None and (
            held < state.consumed
            or (state.consumed and tokens[start + state.consumed - 1] != state.last_token)
        ):
            state = None  # restarted (or rewritten) since the matcher last saw it: replay from the start
        if state is None:
            spec = request.params.structured_output
            state = MatcherState(self.backend.new_matcher(self.compiled(spec)))
            request.structured_state = state
        if held > state.consumed:
            new = tokens[start + state.consumed :]
            ok = state.matcher.consume(new)
            state.consumed, state.last_token = held, new[-1]
            if not ok:
                return None
        elif state.matcher.error():
            return None
        return state.matcher

    def _bitmask_buffer(self, rows: int, words: int, device: torch.device) -> torch.Tensor:
        """A CPU int32 ``[rows, words]`` bitmask with every token allowed (rows that get no fill
        stay unconstrained).  On CUDA a new pinned tensor each step: the previous one may still be
        on its way to the device, and the caching host allocator recycles it once it arrived."""
        if device.type == "cuda":
            return torch.full((rows, words), -1, dtype=torch.int32, pin_memory=True)
        buf = self._bitmask
        if buf is None or buf.shape[0] < rows or buf.shape[1] != words:
            buf = self._bitmask = torch.empty((max(rows, 8), words), dtype=torch.int32)
        return buf[:rows].fill_(-1)

    def _expand(self, bitmask: torch.Tensor, device: torch.device, width: int) -> torch.Tensor:
        """The ``[rows, width]`` float32 bias, ``0`` where allowed and ``-inf`` where not.

        One table lookup per byte: little-endian byte ``b`` of word ``w`` holds tokens
        ``32w + 8b`` to ``32w + 8b + 7``."""
        table = self._tables.get(device)
        if table is None:
            bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
            table = torch.where(bits.bool(), 0.0, float("-inf")).to(device)
            self._tables[device] = table
        data = bitmask.to(device, non_blocking=True) if device.type != "cpu" else bitmask
        rows = data.shape[0]
        bias = table.index_select(0, data.view(torch.uint8).reshape(-1).to(torch.int32)).view(rows, -1)
        if bias.shape[1] < width:  # logits wider than the vocabulary: the padding is never allowed
            bias = torch.nn.functional.pad(bias, (0, width - bias.shape[1]), value=float("-inf"))
        return bias if bias.shape[1] == width else bias[:, :width]


__all__ = ["MatcherState", "StructuredOutputs"]
