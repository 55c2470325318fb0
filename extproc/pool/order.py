"""The pool's named decisions: the order within a bucket, and the choice across buckets.

Who gets a freed slot is decided in two steps, each a small class with one method:

1. **Within a bucket** (``QueueOrder.key``): a waiting ticket's key, given once, when it joins;
   the bucket's queue is a heap on it, so the head is the smallest key, in O(log n). The
   policy's ``order`` picks the class through one table, ``QUEUE_ORDERS``:

   - ``fifo`` (``FifoOrder``): the enqueue time.
   - ``cost`` (``CostOrder``): the enqueue time plus ``(timeout / 2) x c / (c + c0)``, where
     ``c`` is the request's cost (estimated prompt + max_tokens) and ``c0`` the bucket's
     running mean cost. A cheap request goes ahead of an expensive one that came a little
     earlier (shortest-job-first lowers the mean wait), but a large request is never put back
     by more than half its queue timeout: anything that arrived more than that after it goes
     behind it.

   - ``fair`` (``FairOrder``): fair between the bucket's tenants, start-time fair queueing
     (Goyal, Vin and Cheng, SIGCOMM 1996) on weighted tokens. Each tenant has a finish tag;
     a ticket's key is its start tag ``S = max(V, F)``, and the tenant's ``F`` becomes
     ``S + (prompt + 2 x max_tokens) / weight``; ``V`` is the start tag of the latest
     admission. A tenant's backlog spreads its tags out, so another tenant's request, tagged
     near ``V``, goes ahead of all but the first of them: a light tenant never waits behind a
     heavy tenant's queue, and two busy tenants share the slots in proportion to their weights,
     in tokens, not in requests. Work-conserving: a tenant alone is served first come first
     served, at full speed. No credit is banked: a tenant idle for a while starts again at
     ``V``, not before it (that is the "decay", immediate). Output tokens weigh twice: they
     hold the slot for the decode, one step each (llm-d weighs them 2x for the same reason).

   An order may keep state of its own (``CostOrder``'s running mean, ``FairOrder``'s tags).
   One that sets ``observes`` also hears each admission (with its key) and release of its
   bucket's tickets (``admitted``, ``released``); the core calls nothing for the others. Keys
   do not change while a ticket waits: an order whose ranks move with service received gives
   the key when the ticket joins (a virtual start time, as start-time fair queueing does).
   An order whose keys are not times says which time competes across buckets (``band_key``:
   ``FairOrder``'s is the ticket's arrival).

2. **Across buckets** (``BucketChoice.rank``): among the buckets of a pool whose head may take
   the slot (it has waiters and is below its cap), the one with the smallest rank wins.
   ``GuaranteeBandHead`` (the pool's rule): a bucket below its guaranteed share first, then the
   most urgent band, then the earliest head by the buckets' queue keys. ``rank`` must be pure:
   the core calls it only when two buckets or more compete.

A new order (EDF, say) is a new class here and its test; the core's ``_fill`` does not
change.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import TYPE_CHECKING, ClassVar, Final

from extproc.config.policy import Order, TenantPolicy
from extproc.pool.values import Ticket

if TYPE_CHECKING:
    from extproc.pool.state import BucketState

__all__ = [
    "COST_EWMA_ALPHA",
    "OUTPUT_WEIGHT",
    "QUEUE_ORDERS",
    "BucketChoice",
    "CostOrder",
    "FairOrder",
    "FifoOrder",
    "GuaranteeBandHead",
    "QueueOrder",
]

# Weight of the newest cost in a bucket's running mean cost (the ``cost`` order's c0).
COST_EWMA_ALPHA: Final = 0.05
# How much more an output token weighs than a prompt token in the fair order.
OUTPUT_WEIGHT: Final = 2.0


class QueueOrder:
    """The order within one bucket's queue: smaller keys go first."""

    __slots__ = ()
    # True: the core calls ``admitted`` and ``released`` for each of the bucket's tickets.
    observes: ClassVar[bool] = False
    # True: the order serves tenants in turn (a prediction counts only who it puts ahead).
    by_tenant: ClassVar[bool] = False

    def key(self, ticket: Ticket, timeout_s: float) -> float:
        """The key of a ticket joining the queue (``timeout_s``: its queue timeout)."""
        raise NotImplementedError

    def band_key(self, key: float, ticket: Ticket) -> float:
        """The time the bucket's head competes with across buckets (``BucketChoice``): its
        key, for orders whose keys are times."""
        return key

    def tune(self, tenant: TenantPolicy | None) -> None:
        """The bucket's tenant policy, at configuration (orders that keep tenants read it)."""

    def tenants(self) -> int:
        """Tenants the order remembers (0: it keeps none)."""
        return 0

    def heaviest(self, k: int) -> list[tuple[str | None, float]]:
        """The ``k`` tenants with the most queued ahead of the others, and how much."""
        return []

    def admitted(self, ticket: Ticket, key: float, now: float) -> None:
        """One of the bucket's tickets, queued with ``key``, took a slot (only when
        ``observes``)."""

    def released(self, ticket: Ticket, now: float) -> None:
        """One of the bucket's tickets gave its slot back (only when ``observes``)."""


class FifoOrder(QueueOrder):
    """First come, first served."""

    __slots__ = ()

    def key(self, ticket: Ticket, timeout_s: float) -> float:
        return ticket.enqueued_at


class CostOrder(QueueOrder):
    """Cheaper first, delayed by at most half the queue timeout (see the module docstring)."""

    __slots__ = ("mean_cost",)

    def __init__(self) -> None:
        self.mean_cost: float | None = None

    def key(self, ticket: Ticket, timeout_s: float) -> float:
        c = float(max(0, ticket.cost))
        c0 = self.mean_cost if self.mean_cost is not None else c
        self.mean_cost = c0 + COST_EWMA_ALPHA * (c - c0)
        delay = 0.5 * timeout_s * (c / (c + c0) if c + c0 > 0 else 0.0)
        return ticket.enqueued_at + delay


class FairOrder(QueueOrder):
    """Start-time fair queueing between tenants on weighted tokens (see the module docstring).

    ``tags`` holds each tenant's finish tag and when it was last seen, least recently seen
    first: at most ``max_tracked`` tenants, and none idle past ``idle_s`` (each ``key``
    forgets from the old end, O(1) amortised). A forgotten tenant starts again at ``V``."""

    __slots__ = ("idle_s", "max_tracked", "tags", "virtual")
    observes: ClassVar[bool] = True
    by_tenant: ClassVar[bool] = True

    def __init__(self) -> None:
        self.virtual = 0.0
        self.tags: OrderedDict[str | None, tuple[float, float]] = OrderedDict()
        self.max_tracked, self.idle_s = _TENANT.max_tracked, _TENANT.idle_ttl_s

    def tune(self, tenant: TenantPolicy | None) -> None:
        if tenant is not None:
            self.max_tracked, self.idle_s = tenant.max_tracked, tenant.idle_ttl_s

    def key(self, ticket: Ticket, timeout_s: float) -> float:
        tags, now = self.tags, ticket.enqueued_at
        last = tags.pop(ticket.tenant, None)
        start = self.virtual if last is None or last[0] < self.virtual else last[0]
        cost = max(0, ticket.cost) + (OUTPUT_WEIGHT - 1.0) * max(0, ticket.output)
        tags[ticket.tenant] = (start + cost / ticket.weight, now)
        while len(tags) > self.max_tracked or next(iter(tags.values()))[1] < now - self.idle_s:
            tags.popitem(last=False)
        return start

    def band_key(self, key: float, ticket: Ticket) -> float:
        return ticket.enqueued_at

    def admitted(self, ticket: Ticket, key: float, now: float) -> None:
        if key > self.virtual:
            self.virtual = key

    def tenants(self) -> int:
        return len(self.tags)

    def heaviest(self, k: int) -> list[tuple[str | None, float]]:
        """The ``k`` tenants furthest ahead of ``V`` (their backlog, in weighted tokens):
        for /debug/queues, O(tenants)."""
        ahead = ((t, f - self.virtual) for t, (f, _) in self.tags.items() if f > self.virtual)
        return heapq.nlargest(k, ahead, key=lambda x: x[1])


_TENANT: Final = TenantPolicy()  # the defaults, until ``tune``

# The policy's ``order`` -> the class of each bucket's queue order.
QUEUE_ORDERS: Final[dict[Order, type[QueueOrder]]] = {
    Order.FIFO: FifoOrder,
    Order.COST: CostOrder,
    Order.FAIR: FairOrder,
}


class BucketChoice:
    """Which of the competing buckets a free slot goes to: the smallest rank."""

    __slots__ = ()

    def rank(self, bucket: BucketState, head_key: float, limit: int) -> tuple[float, ...]:
        """The bucket's rank, given its head's queue key and the pool's limit."""
        raise NotImplementedError


class GuaranteeBandHead(BucketChoice):
    """1. a bucket below its guaranteed share (``floor(min_share x limit)``): nothing starves;
    2. the most urgent band (lowest ``priority``); 3. the earliest head of queue across the
    band's buckets (by their queue keys)."""

    __slots__ = ()

    def rank(self, bucket: BucketState, head_key: float, limit: int) -> tuple[float, ...]:
        below_min = 0 if len(bucket.running) < bucket.min_slots(limit) else 1
        return (below_min, bucket.priority, head_key)
