"""Route shares: a route's own limit inside a bucket, set by Envoy route metadata.

A route whose metadata names a bucket and ``max_concurrency`` (and/or ``max_queue``) gets a
share: at most ``max_concurrency`` of the route's requests are in the bucket at once (queued
there or holding one of its slots), and at most ``max_queue`` more wait for the share, in FIFO
order, under the same deadline. Other routes' requests in the bucket, and the bucket's own
limits, are not affected: route metadata changes nothing beyond the requests that carry it.

A request of such a route first takes a share slot (``enter``), then enters the bucket; it
gives both back when its stream ends. Shares are buckets of a second ``Gate`` (its own timer
and Retry-After estimates), created when their route is first seen, and forgotten when the
route is gone: the route cache drops its routes on a policy reload or when it fills up; a share
whose route is gone is removed as soon as it holds nothing (``sweep``).
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.config.policy import Policy
from extproc.pool.core.values import Entry
from extproc.pool.gate import Gate, Slot, Waiter

__all__ = ["Share", "Shares"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Share:
    """One route's share of a bucket."""

    key: str  # unique per route and policy, e.g. "batch/route-3"
    capacity: int
    max_queue: int


class Shares:
    def __init__(self, policy: Policy) -> None:
        self._gate = Gate(policy, buckets=False)
        self._live: set[str] = set()  # shares whose route is still in the route cache

    def reconfigure(self, policy: Policy) -> None:
        self._gate.reconfigure(policy)

    def enter(self, share: Share, entry: Entry) -> Slot | Waiter:
        """A share slot now, a place in its queue, or ``Refused`` (``entry``: the request's)."""
        key, t = share.key, entry.timeout_s
        if key not in self._live:
            self._live.add(key)
            self._gate.set_limits(key, share.capacity, share.max_queue, t)
        own, held = entry.client_deadline, entry.held_bytes
        return self._gate.enter(
            Entry(bucket=key, timeout_s=t, held_bytes=held, client_deadline=own)
        )

    def forget_routes(self) -> None:
        """The route cache was cleared: every share's route is gone."""
        self._live.clear()
        for key in list(self._gate.statistics()):
            self._gate.remove(key)

    def sweep(self, share: Share) -> None:
        """After one of the share's requests ended: remove the share if its route is gone and
        it holds nothing."""
        if share.key not in self._live:
            self._gate.remove(share.key)

    def close(self) -> None:
        self._gate.close()

    def statistics(self) -> dict[str, dict[str, int]]:
        return {
            key: {"capacity": s.capacity, "in_flight": s.in_flight, "queued": s.queued}
            for key, s in self._gate.statistics().items()
        }
