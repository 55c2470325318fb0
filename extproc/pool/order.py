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

   An order may keep state of its own (``CostOrder``'s running mean; per tenant, for a
   fairness order). One that sets ``observes`` also hears each admission and release of its
   bucket's tickets (``admitted``, ``released``); the core calls nothing for the others. Keys
   do not change while a ticket waits: an order whose ranks move with service received gives
   the key when the ticket joins (a virtual start time, as start-time fair queueing does).

2. **Across buckets** (``BucketChoice.rank``): among the buckets of a pool whose head may take
   the slot (it has waiters and is below its cap), the one with the smallest rank wins.
   ``GuaranteeBandHead`` (the pool's rule): a bucket below its guaranteed share first, then the
   most urgent band, then the earliest head by the buckets' queue keys. ``rank`` must be pure:
   the core calls it only when two buckets or more compete.

A new order (EDF, fairness between tenants) is a new class here and its test; the core's
``_fill`` does not change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Final

from extproc.config.policy import Order
from extproc.pool.values import Ticket

if TYPE_CHECKING:
    from extproc.pool.state import BucketState

__all__ = [
    "COST_EWMA_ALPHA",
    "QUEUE_ORDERS",
    "BucketChoice",
    "CostOrder",
    "FifoOrder",
    "GuaranteeBandHead",
    "QueueOrder",
]

# Weight of the newest cost in a bucket's running mean cost (the ``cost`` order's c0).
COST_EWMA_ALPHA: Final = 0.05


class QueueOrder:
    """The order within one bucket's queue: smaller keys go first."""

    __slots__ = ()
    # True: the core calls ``admitted`` and ``released`` for each of the bucket's tickets.
    observes: ClassVar[bool] = False

    def key(self, ticket: Ticket, timeout_s: float) -> float:
        """The key of a ticket joining the queue (``timeout_s``: its queue timeout)."""
        raise NotImplementedError

    def admitted(self, ticket: Ticket, now: float) -> None:
        """One of the bucket's tickets took a slot (only when ``observes``)."""

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


# The policy's ``order`` -> the class of each bucket's queue order.
QUEUE_ORDERS: Final[dict[Order, type[QueueOrder]]] = {
    Order.FIFO: FifoOrder,
    Order.COST: CostOrder,
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
