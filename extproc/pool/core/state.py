"""The admission core's mutable state: one ``PoolState`` per pool, one ``BucketState`` per bucket.

Only ``extproc.pool.core.admission.Admission`` changes them (a bucket's own side of an admission, a
release or a waiter leaving unserved through ``BucketState.admitted`` / ``released`` /
``left``, which it calls); each bucket's queue is kept by its order (``extproc.pool.core.order``),
and the choice across buckets and the band questions (``extproc.pool.core.demand``) read them.
Counts are kept, not recomputed: ``PoolState.running`` and ``tokens`` are the sums over its
buckets' running tickets.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Final

from extproc.config.policy import BucketPolicy
from extproc.pool.core.fair import FairOrder
from extproc.pool.core.order import (
    QUEUE_ORDERS,
    BucketChoice,
    FifoOrder,
    GuaranteeBandHead,
    QueueOrder,
)
from extproc.pool.core.relegate import Relegation
from extproc.pool.core.tenants import TenantBounds, TenantCounts
from extproc.pool.core.values import BucketStats, PoolStats, Ticket, Verdict, slots

__all__ = [
    "HOLD_EWMA_ALPHA",
    "RATE_MIN_RELEASES",
    "WAIT_SAMPLES",
    "BucketRule",
    "BucketState",
    "PoolState",
    "ewma",
]

# Weight of the newest hold time in the running means of hold times (Retry-After, predicted
# waits).
HOLD_EWMA_ALPHA: Final = 0.2
# Predicted waits use the pool's running mean hold time, trusted once it has seen this many
# releases (fewer: no prediction, nobody is refused for it).
RATE_MIN_RELEASES: Final = 8
# Recent admissions' waits kept per bucket, for the p95 the overload monitor reads.
WAIT_SAMPLES: Final = 512

_CHOICE: Final = GuaranteeBandHead()


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketRule:
    """A bucket as the core applies it: its policy (band, guaranteed share, queue bound and
    order, tenants), with what the shell decides on top of it: its largest share and cap (a
    shared pool's owner turns the share of the whole pool into a cap on this replica's
    slots) and where its waiters go at their deadline. A new per-bucket setting is a
    ``BucketPolicy`` field, read through ``policy`` where it is used: nothing between the
    policy and that use names it."""

    policy: BucketPolicy
    max_share: float
    cap: int | None = None
    relegate: Relegation | None = None

    @classmethod
    def own(cls, name: str, capacity: int, max_queue: int) -> BucketRule:
        """A bucket with ``capacity`` slots of its own (no pool): one band, no shares, FIFO."""
        policy = BucketPolicy(
            name=name, max_concurrency=capacity, queue_timeout_s=0.0, max_queue=max_queue
        )
        return cls(policy=policy, max_share=policy.max_share)


def ewma(mean: float | None, value: float) -> float:
    return value if mean is None else (1 - HOLD_EWMA_ALPHA) * mean + HOLD_EWMA_ALPHA * value


class PoolState:
    __slots__ = (
        "band_cut",
        "buckets",
        "capacity",
        "choice",
        "cut",
        "fail_fast",
        "limit",
        "max_tokens",
        "mean_hold_s",
        "name",
        "releases",
        "running",
        "tokens",
        "whole",
    )

    def __init__(self, name: str, limit: int) -> None:
        self.name = name
        self.limit = limit
        # The whole pool's limit when it is not ``limit`` (a shared pool's, all replicas
        # together: ``limit`` is the leases this replica holds); None: ``limit``.
        self.whole: int | None = None
        # What the tenants' ``max_share`` is of: the whole limit, its last positive value.
        self.capacity = limit
        self.max_tokens: int | None = None
        self.fail_fast = False
        self.cut = 1.0  # the overload factor for the least urgent band
        self.band_cut = 1.0  # the adaptive limit's band cut for it (extproc.pool.control.bandcut)
        self.running = 0
        self.tokens = 0
        self.buckets: list[BucketState] = []  # sorted by priority
        self.choice: BucketChoice = _CHOICE
        self.mean_hold_s: float | None = None
        self.releases = 0

    def set_limit(self, limit: int, whole: int | None) -> None:
        """The limit (``whole``: the whole pool's, when another); a limit of 0 leaves the
        ``capacity`` the tenants' shares are of where it was."""
        self.limit, self.whole = limit, whole
        base = limit if whole is None else whole
        if base > 0:
            self.capacity = base

    @property
    def factor(self) -> float:
        """The cut that binds the least urgent band: the lower of the two."""
        return min(self.cut, self.band_cut)

    def release_rate(self) -> float | None:
        """Slots freed per second while the pool is full: limit / mean hold (Little's law;
        the mean is over releases, so short requests weigh as often as they free a slot)."""
        if self.releases < RATE_MIN_RELEASES or not self.mean_hold_s or self.limit < 1:
            return None
        return self.limit / self.mean_hold_s

    def stats(self) -> PoolStats:
        return PoolStats(
            name=self.name,
            limit=self.limit,
            in_flight=self.running,
            queued=sum(len(b.waiting) for b in self.buckets),
            max_tokens=self.max_tokens,
            tokens_in_flight=self.tokens,
            release_rate=self.release_rate(),
            cut=self.cut,
            band_cut=self.band_cut,
        )


class BucketState:
    __slots__ = (
        "admitted_total",
        "client_expired_total",
        "evicted_total",
        "fair",
        "mean_hold_s",
        "name",
        "order",
        "pool",
        "queued_bytes",
        "refused_total",
        "relegated_total",
        "rule",
        "running",
        "shared",
        "tenants",
        "tokens",
        "waiting",
        "waits",
    )

    def __init__(self, name: str, pool: PoolState, rule: BucketRule) -> None:
        self.name = name
        self.pool = pool
        self.shared = False  # in a named pool (else the pool is the bucket's own)
        self.order: QueueOrder = FifoOrder()
        self.fair: FairOrder | None = None  # the order, when it is fair between tenants
        self.tenants: TenantCounts | None = None  # with a tenant policy only
        self.waiting: dict[int, Ticket] = {}  # queued in ``order``
        # ticket id -> (ticket, admitted_at)
        self.running: dict[int, tuple[Ticket, float]] = {}
        self.tokens = 0
        self.mean_hold_s: float | None = None
        self.queued_bytes = 0
        self.admitted_total = 0
        self.evicted_total = 0
        self.refused_total = 0
        self.client_expired_total = 0
        self.relegated_total = 0
        self.waits: deque[float] = deque(maxlen=WAIT_SAMPLES)
        self.rule = rule
        self.configure(rule)

    # What the order, the choice and relegation read (``Contender``, ``Relegating``).
    @property
    def priority(self) -> int:
        return self.rule.policy.priority

    @property
    def max_queue(self) -> int:
        return self.rule.policy.max_queue

    @property
    def relegate(self) -> Relegation | None:
        """Where its waiters go at their deadline (None: evicted there)."""
        return self.rule.relegate

    @property
    def in_flight(self) -> int:
        return len(self.running)

    @property
    def queued(self) -> int:
        return len(self.waiting)

    def configure(self, rule: BucketRule) -> None:
        """Apply ``rule``. An order of the same class keeps its state (the cost order's running
        mean, the fair order's tags), and the tenants' counts stay while the bucket has a
        tenant policy."""
        self.rule = rule
        tenant = rule.policy.tenant
        fresh = QUEUE_ORDERS[rule.policy.order]()
        if new_order := type(fresh) is not type(self.order):
            self.order = fresh
        self.fair = self.order if isinstance(self.order, FairOrder) else None
        if self.fair is not None:
            self.fair.tune(tenant)
        if new_order:
            self._rekey()
        if tenant is None:
            self.tenants = None
        else:
            bounds = TenantBounds(tenant.max_queue, tenant.max_share)
            if self.tenants is None:
                self.tenants = TenantCounts(bounds)
            else:
                self.tenants.bounds = bounds

    def move(self, target: PoolState | None) -> PoolState:
        """Move to another pool with its running requests' slots and tokens (None: a pool of
        its own, at the old pool's limit); returns the pool it left."""
        old = self.pool
        old.buckets.remove(self)
        old.running -= len(self.running)
        old.tokens -= self.tokens
        self.shared = target is not None
        if target is None:
            target = PoolState(self.name, max(1, old.limit))
        target.buckets.append(self)
        target.running += len(self.running)
        target.tokens += self.tokens
        self.pool = target
        return old

    def _rekey(self) -> None:
        """A new order: the waiters join it again, in the order they came (a fair order's
        keys are tokens, another's are times: the two never share a queue)."""
        for t in sorted(self.waiting.values(), key=lambda t: t.id):
            self.order.push(t, t.deadline - t.enqueued_at)

    def admitted(self, ticket: Ticket, key: float, now: float) -> None:
        """The bucket's side of an admission (the core takes it off the queue first)."""
        self.running[ticket.id] = (ticket, now)
        self.tokens += ticket.cost
        self.admitted_total += 1
        self.waits.append(now - ticket.enqueued_at)
        if self.tenants is not None:
            self.tenants.admitted(ticket.tenant)
        if self.fair is not None:
            self.fair.admitted(ticket, key, now)

    def released(self, ticket_id: int, now: float) -> tuple[Ticket, float]:
        """The bucket's side of a release: the ticket and how long it held its slot."""
        ticket, admitted_at = self.running.pop(ticket_id)
        self.tokens -= ticket.cost
        if self.tenants is not None:
            self.tenants.released(ticket.tenant)
        hold = max(0.0, now - admitted_at)
        self.mean_hold_s = ewma(self.mean_hold_s, hold)
        return ticket, hold

    def head(self) -> tuple[float, Ticket] | None:
        return self.order.head(self.waiting)

    def displaced(self, ticket: Ticket) -> Ticket | None:
        """The bucket is full and ``ticket`` just joined: the waiter refused in its stead
        (``FairOrder.displace``), or None."""
        tid = None if self.fair is None else self.fair.displace(ticket)
        return None if tid is None else self.waiting.get(tid)

    def tenant_refusal(self, tenant: str | None) -> Verdict | None:
        """Why the bucket's tenant bounds refuse a new request of ``tenant`` (None: the
        anonymous tenant, bounded as any other), or None; the share is of the bucket's largest
        number of slots at the pool's capacity (``extproc.pool.core.tenants``)."""
        if self.tenants is None:
            return None
        return self.tenants.refusal(tenant, self.max_slots(self.pool.capacity, None))

    def left(self, ticket: Ticket) -> None:
        """The bucket's side of a waiter leaving without a slot (the core takes it off the
        queue first)."""
        if self.tenants is not None:
            self.tenants.left(ticket.tenant)
        if self.fair is not None:
            self.fair.left(ticket)

    def ahead(self) -> int:
        """Waiters of its band and of the more urgent ones (all served before a newcomer)."""
        return sum(len(x.waiting) for x in self.pool.buckets if x.priority <= self.priority)

    def predicted_wait_s(self, exclude: Ticket | None = None) -> float | None:
        """The wait of a newcomer (``exclude``: the ticket that is that newcomer, already in
        the queue): the requests ahead of it plus itself over the pool's release rate, limit /
        mean hold (Little's law over releases: it does not drift down while the pool sits
        idle, as a rate of recent releases would); None until the rate is known. In a fair
        bucket, of its own waiters only those the fair order can put ahead of it
        (``TenantCounts.ahead``): a light tenant's request is not predicted to wait for a
        heavy tenant's whole queue. In a cost-ordered bucket, those with a smaller key
        (``QueueOrder.ahead``)."""
        rate = self.pool.release_rate()
        if rate is None:
            return None
        own = len(self.waiting)
        if exclude is not None and exclude.id in self.waiting:
            own -= 1
            if self.tenants is not None and self.fair is not None:
                own = self.tenants.ahead(exclude.tenant, own)
            else:
                before = self.order.ahead(exclude, self.waiting)
                own = own if before is None else before
        if len(self.running) < self.min_slots(self.pool.limit):
            ahead = own  # below its guaranteed share: served before other bands
        else:
            ahead = self.ahead() - len(self.waiting) + own
        return (ahead + 1) / rate

    def drain_estimate_s(self, default_hold_s: float) -> float:
        """How long a request joining the bucket now would wait.

        Own slots: the queue ahead of it plus itself, times the mean hold, spread over the
        bucket's slots. Shared pool: the requests ahead of it in its band and above, plus
        itself, over the measured rate at which the pool frees slots (the same estimate
        before that rate is known, with the pool's limit as the slots)."""
        if self.shared:
            wait = self.predicted_wait_s()
            if wait is not None:
                return wait
            ahead = self.ahead()
        else:
            ahead = len(self.waiting)
        hold = self.mean_hold_s if self.mean_hold_s is not None else default_hold_s
        return (ahead + 1) * hold / max(1, self.pool.limit)

    def stats(self, cut_band: int | None) -> BucketStats:
        """``cut_band``: the band the pool's cut applies to now (``demand.cut_band``)."""
        pool = self.pool
        return BucketStats(
            name=self.name,
            capacity=self.max_slots(pool.limit, cut_band) if self.shared else pool.limit,
            in_flight=len(self.running),
            queued=len(self.waiting),
            max_queue=self.max_queue,
            mean_hold_s=self.mean_hold_s,
            queued_bytes=self.queued_bytes,
            pool=pool.name if self.shared else None,
            priority=self.priority,
            tokens_in_flight=self.tokens,
            admitted_total=self.admitted_total,
            evicted_total=self.evicted_total,
            refused_total=self.refused_total,
            client_expired_total=self.client_expired_total,
            relegated_total=self.relegated_total,
            tenants=0 if self.fair is None else self.fair.tenants(),
        )

    def compact(self) -> None:
        """Let the order drop its entries of tickets gone (``QueueOrder.compact``)."""
        self.order.compact(self.waiting)

    def min_slots(self, limit: int) -> int:
        return slots(self.rule.policy.min_share, limit)

    def max_slots(self, limit: int, cut_band: int | None) -> int:
        rule = self.rule
        top = max(1, slots(rule.max_share, limit))
        if rule.cap is not None:
            top = min(top, rule.cap)
        cut = self.pool.factor
        if cut < 1.0 and self.priority == cut_band:
            top = min(top, max(self.min_slots(limit), slots(cut, top)))
        return top
