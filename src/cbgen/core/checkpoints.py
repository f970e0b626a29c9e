"""State checkpoints: what lets a model with state layers serve a prefix from the cache.

A state summarises a sequence's whole prefix and cannot be cut back, so a prefix hit needs the
state at the hit's end, not only the K/V blocks before it.  After the forward of a prompt chunk
that ends on the checkpoint grid, the row's state is copied into a checkpoint slot (a state slot
no sequence holds), filed under the prefix hash of the block that ends there.  A later request
whose cached prefix reaches such a block starts from a copy of that checkpoint.

Exactness decides the policy (``docs/design.md``, "State layers"):

* only states computed in the prefill form count, at multiples of ``grid`` = lcm(block size, the
  mixers' chunk size): such a state is bit for bit what ``generate()``'s one-piece prefill computes
  at that point.  States reached by decoding (the recurrent form) are never filed;
* the scheduler ends a prompt chunk at the prompt's last grid point before its end
  (:meth:`cbgen.core.scheduler.Scheduler.span`), so every prompt longer than ``grid`` leaves one
  checkpoint a resubmission of it hits; other chunk ends on the grid leave one too;
* ``capacity`` checkpoints, reused least recently used first; a hit is the longest prefix whose
  blocks are cached in every group *and* whose end has a checkpoint;
* a checkpoint filed in a step is not served in that same step (its copy happens after the step's
  forward, the hit's before it).

Pure Python, like the rest of ``core/``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class Checkpoints:
    """``capacity`` checkpoint slots, ids ``first .. first + capacity - 1``, on a grid of ``grid``
    tokens (see the module docstring)."""

    def __init__(self, first: int, capacity: int, grid: int) -> None:
        if capacity < 1 or grid < 1:
            raise ValueError(f"checkpoints need a capacity and a grid, got {capacity}, {grid}")
        self.grid = grid
        self.capacity = capacity
        self._free = list(range(first + capacity - 1, first - 1, -1))
        # Prefix hash of the block a checkpoint ends with -> its slot, least recently used first.
        self._filed: OrderedDict[int, int] = OrderedDict()
        self._this_step: set[int] = set()
        self.taken = 0  # checkpoints filed, for stats
        self.served = 0  # hits served from a checkpoint

    def __len__(self) -> int:
        return len(self._filed)

    def new_step(self) -> None:
        """Checkpoints filed before now may be served from here on."""
        self._this_step.clear()

    def file(self, block_hash: int) -> int | None:
        """A slot to file the state at the block ``block_hash`` ends in (None: already filed)."""
        if block_hash in self._filed:
            self._filed.move_to_end(block_hash)
            return None
        if self._free:
            slot = self._free.pop()
        else:
            _, slot = self._filed.popitem(last=False)
        self._filed[block_hash] = slot
        self._this_step.add(block_hash)
        self.taken += 1
        return slot

    def find(self, hashes: Sequence[int], block_size: int, max_tokens: int) -> tuple[int, int | None]:
        """The longest prefix of at most ``max_tokens`` tokens, whose blocks have ``hashes``, that
        ends on the grid with a checkpoint servable now: ``(tokens, slot)``, or ``(0, None)``."""
        tokens = max_tokens - max_tokens % self.grid
        while tokens > 0:
            h = hashes[tokens // block_size - 1]
            slot = self._filed.get(h)
            if slot is not None and h not in self._this_step:
                self._filed.move_to_end(h)
                self.served += 1
                return tokens, slot
            tokens -= self.grid
        return 0, None

    def forget(self) -> None:
        """Drops every checkpoint (a prefix-cache reset)."""
        for slot in self._filed.values():
            self._free.append(slot)
        self._filed.clear()
        self._this_step.clear()
