"""Per-tenant counts within one bucket: requests waiting, and waiting and running together.

A bucket whose policy names a ``tenant`` keeps one ``TenantCounts``: for each tenant with a
request in the bucket (the anonymous one, key None, too), how many wait and how many run. They
bound a tenant (``max_queue``, ``max_share``; the anonymous one too: the requests without a
key are one tenant, bounded together, so a header that many clients leave out never lets
them fill the bucket) and tell the fair
order's predicted wait how many are ahead of a tenant's request (``ahead``). A tenant
appears with its first live request and is gone with its last, so the table never holds more
tenants than the bucket holds requests (a flood of new keys costs one entry per request in the
bucket, as the requests themselves do). The core asks ``refusal`` before a
request joins and reports each move (``joined``, ``admitted``, ``left``, ``released``).

``max_share`` bounds waiting and running together: a tenant at its share may not queue for a
slot it could not hold. The share is of the bucket's largest number of slots at the pool's
capacity (``PoolState.capacity``): the whole pool's limit (a shared pool's, all replicas
together, not the leases this replica holds), and while the limit is 0 (scale from zero, a
shared pool without a backend) the last positive one, so that each tenant may queue its part
of what is coming rather than one request. A tenant refused is answered at once (429
``tenant_queue_full`` / ``tenant_over_share``); the bucket's own counts (``refused_total``,
which the overload monitor reads) do not count it: one tenant over its bound says nothing
about the pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from extproc.pool.values import Verdict

__all__ = ["TenantBounds", "TenantCounts"]


@dataclass(frozen=True, slots=True)
class TenantBounds:
    max_queue: int | None = None
    max_share: float | None = None


class TenantCounts:
    __slots__ = ("bounds", "running", "waiting")

    def __init__(self, bounds: TenantBounds) -> None:
        self.bounds = bounds
        self.waiting: dict[str | None, int] = {}
        self.running: dict[str | None, int] = {}

    def ahead(self, tenant: str | None, queued: int) -> int:
        """At most how many of the other ``queued`` waiters of the bucket a request of
        ``tenant`` that just joined waits behind in the fair order: its tenant's own ``q``
        before it and, of each other tenant waiting, no more than ``q + 1`` (their tags pass
        its tag after that many): ``q + others x (q + 1)``, O(1), a bound for equal costs."""
        q = self.waiting.get(tenant, 1) - 1
        others = len(self.waiting) - 1
        return min(queued, q + others * (q + 1))

    def refusal(self, tenant: str | None, max_slots: int) -> Verdict | None:
        """Why a new request of ``tenant`` may not join (``max_slots``: the most the bucket
        may hold now), or None."""
        waiting = self.waiting.get(tenant, 0)
        bounds = self.bounds
        if bounds.max_queue is not None and waiting >= bounds.max_queue:
            return Verdict.TENANT_QUEUE_FULL
        if bounds.max_share is not None:
            share = max(1, math.floor(bounds.max_share * max_slots + 1e-9))
            if waiting + self.running.get(tenant, 0) >= share:
                return Verdict.TENANT_OVER_SHARE
        return None

    def joined(self, tenant: str | None) -> None:
        self.waiting[tenant] = self.waiting.get(tenant, 0) + 1

    def left(self, tenant: str | None) -> None:
        """A waiter left without a slot (evicted, cancelled, refused after joining)."""
        _down(self.waiting, tenant)

    def admitted(self, tenant: str | None) -> None:
        _down(self.waiting, tenant)
        self.running[tenant] = self.running.get(tenant, 0) + 1

    def released(self, tenant: str | None) -> None:
        _down(self.running, tenant)

    def __len__(self) -> int:
        return len(self.waiting.keys() | self.running.keys())


def _down(counts: dict[str | None, int], tenant: str | None) -> None:
    """One fewer (a ticket that joined before the bounds were set was never counted)."""
    n = counts.get(tenant, 0) - 1
    if n > 0:
        counts[tenant] = n
    else:
        counts.pop(tenant, None)
