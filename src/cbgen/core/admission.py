"""What may be in flight at once: requests and their token slots, overall and per client.

A request's *work* is ``n x (prompt + max_tokens)`` token slots: what its sequences may come to hold
in the KV cache, and the compute they may ask for.  Counting requests alone lets one request with a
batch of prompts and a large ``n`` (hundreds of sequences) pass as one; counting work does not.

Pure Python and not thread-safe: the caller serialises calls (:class:`~cbgen.async_engine.AsyncEngine`
holds its lock).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


class QueueFullError(RuntimeError):
    """Raised when a request does not fit what is in flight now (servers map it to HTTP 429)."""


@dataclass
class Admission:
    """Bounds on requests and token slots in flight (None: unbounded); one client may hold at most
    ``client_share`` of each (None: no per-client bound).  Requests without a client count only
    towards the overall bounds."""

    max_requests: int | None = None
    max_work: int | None = None
    client_share: float | None = None
    requests: int = 0
    work: int = 0
    _client_requests: dict[str, int] = field(default_factory=lambda: defaultdict(int), repr=False)
    _client_work: dict[str, int] = field(default_factory=lambda: defaultdict(int), repr=False)

    def __post_init__(self) -> None:
        for name in ("max_requests", "max_work"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value!r}")
        if self.client_share is not None and not 0.0 < self.client_share <= 1.0:
            raise ValueError(f"client_share must be in (0, 1] or None, got {self.client_share!r}")

    def client_bounds(self) -> tuple[int | None, int | None]:
        """(requests, token slots) one client may hold; None where unbounded."""
        if self.client_share is None:
            return None, None
        share = self.client_share
        return (
            None if self.max_requests is None else max(1, int(self.max_requests * share)),
            None if self.max_work is None else max(1, int(self.max_work * share)),
        )

    def check(self, work: int, client: str | None = None) -> None:
        """Raises ``ValueError`` if a request of ``work`` token slots could never be admitted, and
        :class:`QueueFullError` if it cannot be now; changes nothing."""
        bounds = [
            ("requests", self.requests, 1, self.max_requests, ""),
            ("token slots", self.work, work, self.max_work, ""),
        ]
        if client is not None:
            client_requests, client_work = self.client_bounds()
            who = f" for one client ({client})"
            bounds.append(("requests", self._client_requests.get(client, 0), 1, client_requests, who))
            bounds.append(("token slots", self._client_work.get(client, 0), work, client_work, who))
        for unit, held, need, limit, who in bounds:
            if limit is None:
                continue
            if need > limit:
                raise ValueError(
                    f"request needs {need:,} {unit} (n x (prompt + max_tokens) per prompt), over the "
                    f"in-flight limit of {limit:,}{who}; lower n, max_tokens or the prompt"
                )
            if held + need > limit:
                raise QueueFullError(
                    f"too many {unit} in flight{who}: {held:,} held + {need:,} requested > {limit:,}; "
                    "retry later"
                )

    def add(self, work: int, client: str | None = None) -> None:
        """Counts an admitted request (after :meth:`check`)."""
        self.requests += 1
        self.work += work
        if client is not None:
            self._client_requests[client] += 1
            self._client_work[client] += work

    def remove(self, work: int, client: str | None = None) -> None:
        """Forgets a request counted by :meth:`add`."""
        self.requests -= 1
        self.work -= work
        if client is not None:
            for tally, amount in ((self._client_requests, 1), (self._client_work, work)):
                tally[client] -= amount
                if not tally[client]:
                    del tally[client]

    def held_by(self, client: str) -> tuple[int, int]:
        """(requests, token slots) ``client`` holds now."""
        return self._client_requests.get(client, 0), self._client_work.get(client, 0)
