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

A tenant header that vanishes
-----------------------------
A bucket whose tenant is a trusted header's value (``tenant.header``) turns silently into
one anonymous tenant when nothing sets the header by the time the sidecar reads it (an auth
filter placed before the strip of ``trusted_headers`` in Envoy, whose header the strip
removes too): fairness is off, and nothing fails. ``TenantCounts`` counts, O(1) as each
request joins (``joined``: every request its tenant's bounds let in, whatever becomes of it
then, and those relegated into the bucket), the requests that joined and those of them that
had a key (``seen``). ``watch_header`` decides
from those totals and ``now`` (the pool's controller looks once a tick and logs and exports
what it finds: ``llm_extproc_tenant_header_missing{bucket}``):

1. The first look, or totals that went down (the counts began again): a window opens, nothing
   is missing.
2. A keyed request since the window opened: the header is there (missing or not before), and
   a new window opens.
3. Otherwise, until the window has lasted ``HEADER_WINDOW_S``, nothing changes.
4. A window over, with not one keyed request in it: the header is missing if at least
   ``HEADER_MIN_REQUESTS`` requests joined in it (or it was missing already: only a keyed
   request clears it, rule 2); a new window opens.

So the header is found missing one to two windows after a load of all anonymous requests
begins, and no longer missing at the first look after one keyed request; a bucket that sees
fewer than ``HEADER_MIN_REQUESTS`` a window is never found missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from extproc.pool.core.values import Verdict, slots

__all__ = [
    "HEADER_MIN_REQUESTS",
    "HEADER_WINDOW_S",
    "HeaderWatch",
    "TenantBounds",
    "TenantCounts",
    "TenantSeen",
    "watch_header",
]

# A tenant header is missing from a bucket when a window this long saw at least this many
# requests join and none of them had a key (``watch_header``).
HEADER_WINDOW_S: Final = 60.0
HEADER_MIN_REQUESTS: Final = 20


@dataclass(frozen=True, slots=True)
class TenantBounds:
    max_queue: int | None = None
    max_share: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantSeen:
    """Requests that joined a bucket since its tenant counts began, and of those how many had
    a tenant key."""

    joined: int = 0
    keyed: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class HeaderWatch:
    """A bucket's tenant header, watched over a window opened at ``since``, when the bucket's
    totals were ``seen``; ``missing``: found missing (until a keyed request comes)."""

    since: float
    seen: TenantSeen
    missing: bool = False


def watch_header(watch: HeaderWatch | None, seen: TenantSeen, now: float) -> HeaderWatch:
    """The watch after one look at the bucket's totals ``seen`` at ``now`` (None: the first
    look); the rules are the module docstring's."""
    if watch is None or seen.joined < watch.seen.joined or seen.keyed < watch.seen.keyed:
        return HeaderWatch(since=now, seen=seen)  # rule 1
    if seen.keyed > watch.seen.keyed:
        return HeaderWatch(since=now, seen=seen)  # rule 2
    if now - watch.since < HEADER_WINDOW_S:
        return watch  # rule 3
    anonymous = seen.joined - watch.seen.joined
    missing = watch.missing or anonymous >= HEADER_MIN_REQUESTS
    return HeaderWatch(since=now, seen=seen, missing=missing)  # rule 4


class TenantCounts:
    __slots__ = ("bounds", "joined_total", "keyed_total", "running", "waiting")

    def __init__(self, bounds: TenantBounds) -> None:
        self.bounds = bounds
        self.waiting: dict[str | None, int] = {}
        self.running: dict[str | None, int] = {}
        # Requests that joined, and of those the ones with a key (``seen``).
        self.joined_total = 0
        self.keyed_total = 0

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
            share = max(1, slots(bounds.max_share, max_slots))
            if waiting + self.running.get(tenant, 0) >= share:
                return Verdict.TENANT_OVER_SHARE
        return None

    def joined(self, tenant: str | None) -> None:
        self.waiting[tenant] = self.waiting.get(tenant, 0) + 1
        self.joined_total += 1
        if tenant is not None:
            self.keyed_total += 1

    def seen(self) -> TenantSeen:
        """The totals of requests that joined and of those with a key (``watch_header``)."""
        return TenantSeen(joined=self.joined_total, keyed=self.keyed_total)

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
