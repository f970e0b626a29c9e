"""Per-sequence state slots: fixed-size cache entries a sequence holds whole, whatever its length.

A layer that carries a state instead of keys and values per token (a recurrent or convolution
state, a state-space model's SSM state) needs one fixed-size slot per running sequence.  The pool
hands them out in the same all-or-nothing allocation as the sequence's blocks
(:class:`cbgen.core.cache_pools.CachePools`), takes them back when the sequence ends or is
preempted, and forks copy them (the device copy is the runner's, like a block's).

Pure Python, like the rest of ``core/``.
"""

from __future__ import annotations

from collections import deque


class SlotPool:
    """``num_slots`` slots, ids ``0 .. num_slots - 1``; the most recently freed is reused last."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a slot pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._held: set[int] = set()

    @property
    def num_free(self) -> int:
        """Slots no sequence holds."""
        return len(self._free)

    def take(self) -> int | None:
        """A free slot, or None when every slot is held."""
        if not self._free:
            return None
        slot = self._free.popleft()
        self._held.add(slot)
        return slot

    def give(self, slot: int) -> None:
        """Returns ``slot`` to the pool (it must be held)."""
        if slot not in self._held:
            raise AssertionError(f"state slot {slot} freed twice or never taken")
        self._held.remove(slot)
        self._free.append(slot)

    def check_invariants(self, held: list[int]) -> None:
        """Asserts that ``held`` (every live sequence's slot) is exactly the held set (tests)."""
        assert len(held) == len(set(held)), f"a slot held twice: {sorted(held)}"
        assert set(held) == self._held, (sorted(held), sorted(self._held))
        assert len(self._free) + len(self._held) == self.num_slots
