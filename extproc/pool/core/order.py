"""The pool's named decisions: the order within a bucket, and the choice across buckets.

Who gets a freed slot is decided in two steps, each a small class:

1. **Within a bucket** (``QueueOrder``): the order keeps the bucket's queue (``push`` a ticket
   that joins, ``head`` the next one). ``fifo`` and ``cost`` key each ticket once, when it joins
   (``key``), and the queue is a heap on it (``HeapOrder``), so the head is the smallest key,
   in O(log n). The policy's ``order`` picks the order through one table, ``QUEUE_ORDERS``:

   - ``fifo`` (``FifoOrder``): the enqueue time.
   - ``cost`` (``CostOrder``, a heap on ``CostKey``): the enqueue time plus
     ``(timeout / 2) x c / (c + c0)``, where ``c`` is the request's cost (estimated prompt +
     max_tokens) and ``c0`` the bucket's running mean cost. A cheap request goes ahead of an
     expensive one that came a little earlier (shortest-job-first lowers the mean wait), but a
     large request is never put back by more than half its queue timeout: anything that
     arrived more than that after it goes behind it.
   - ``fair`` (``FairOrder``, ``extproc.pool.core.fair``, which has its theory): between the
     bucket's tenants, start-time fair queueing on weighted tokens; within each, ``CostKey``.
     It hears from its bucket each admission and departure unserved (``BucketState.fair``),
     and its head competes across buckets by its arrival (``band_key``): its keys are tokens.

   What a newcomer waits for (``ahead``, for ``fail_fast``'s predicted wait): in ``fifo``
   every waiter that came before it; in ``cost`` only those whose key is smaller, counted
   over the heap while it holds at most ``AHEAD_SCAN`` entries (past that, every waiter, as
   ``fifo``: the count stays bounded in time). Counting every waiter of a cost-ordered queue
   refused the cheap requests the order would have served first, and kept the queue, which is
   what the order chooses from, short (docs/benchmarks.md, "`fail_fast` and the cost order").

2. **Across buckets** (``BucketChoice.rank``): among the buckets of a pool whose head may take
   the slot (it has waiters and is below its cap), the one with the smallest rank wins.
   ``GuaranteeBandHead`` (the pool's rule): a bucket below its guaranteed share first, then the
   most urgent band, then the earliest head by the buckets' queue keys. ``pick`` (which the
   core's ``_fill`` calls) finds that bucket; it calls ``rank``, which must be pure, only when
   two buckets or more compete.

A new order (EDF, say) is a new key and class here, and its test; the core's ``_fill`` does
not change. The choice reads a bucket through ``Contender``, what it needs of one
(``extproc.pool.core.state.BucketState`` is one): the state imports the orders, not back.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence, Sized
from typing import Final, Protocol, TypeVar

from extproc.config.policy import Order
from extproc.pool.core.fair import FairOrder
from extproc.pool.core.values import Ticket

__all__ = [
    "COST_EWMA_ALPHA",
    "QUEUE_ORDERS",
    "BucketChoice",
    "Contender",
    "CostKey",
    "CostOrder",
    "FifoOrder",
    "GuaranteeBandHead",
    "HeapOrder",
    "QueueOrder",
]

# Weight of the newest cost in a bucket's running mean cost (the ``cost`` order's c0).
COST_EWMA_ALPHA: Final = 0.05
# A cost order counts who goes before a newcomer over at most this many heap entries.
AHEAD_SCAN: Final = 256


class QueueOrder(Protocol):
    """What the core asks of a bucket's order (``HeapOrder`` says what each does)."""

    def push(self, ticket: Ticket, timeout_s: float) -> None: ...
    def ahead(self, ticket: Ticket, waiting: Mapping[int, Ticket]) -> int | None: ...
    def head(self, waiting: Mapping[int, Ticket]) -> tuple[float, Ticket] | None: ...
    def compact(self, waiting: Mapping[int, Ticket]) -> None: ...
    def band_key(self, key: float, ticket: Ticket) -> float: ...


class HeapOrder:
    """The order within one bucket's queue on a key each ticket gets once, when it joins
    (``key``): smaller first. A heap on it, with lazy deletion (a ticket that left is dropped
    when it reaches the top; ``compact`` rebuilds once they outnumber the live ones)."""

    __slots__ = ("heap",)

    def __init__(self) -> None:
        self.heap: list[tuple[float, int]] = []  # (key, ticket id)

    def key(self, ticket: Ticket, timeout_s: float) -> float:
        """The key of a ticket joining the queue (``timeout_s``: its queue timeout)."""
        raise NotImplementedError

    def push(self, ticket: Ticket, timeout_s: float) -> None:
        """A ticket joins the queue."""
        heapq.heappush(self.heap, (self.key(ticket, timeout_s), ticket.id))

    def ahead(self, ticket: Ticket, waiting: Mapping[int, Ticket]) -> int | None:
        """How many of the ``waiting`` tickets (``ticket`` the last to join, among them) go
        before it; None: all that came before it, as in ``fifo``."""
        return None

    def head(self, waiting: Mapping[int, Ticket]) -> tuple[float, Ticket] | None:
        """The next of the ``waiting`` tickets and its key (None: nobody waits)."""
        heap = self.heap
        while heap:
            key, tid = heap[0]
            ticket = waiting.get(tid)
            if ticket is not None:
                return key, ticket
            heapq.heappop(heap)
        return None

    def compact(self, waiting: Mapping[int, Ticket]) -> None:
        """Drop the entries of tickets gone once they outnumber the live ones."""
        if len(self.heap) > 64 and len(self.heap) > 2 * len(waiting):
            self.heap = [(k, tid) for k, tid in self.heap if tid in waiting]
            heapq.heapify(self.heap)

    def band_key(self, key: float, ticket: Ticket) -> float:
        """The time the bucket's head competes with across buckets (``BucketChoice``): its
        key, for orders whose keys are times."""
        return key


class FifoOrder(HeapOrder):
    """First come, first served."""

    __slots__ = ()

    def key(self, ticket: Ticket, timeout_s: float) -> float:
        return ticket.enqueued_at


class CostKey:
    """The cost order's key (the module docstring), and the bucket's running mean cost it
    moves (``mean_cost``, c0): ``CostOrder``'s, and the fair order's within each tenant. No
    ``__slots__``: ``CostOrder`` joins it to ``HeapOrder``, which has them."""

    def __init__(self) -> None:
        self.mean_cost: float | None = None

    def key(self, ticket: Ticket, timeout_s: float) -> float:
        c = float(max(0, ticket.cost))
        c0 = self.mean_cost if self.mean_cost is not None else c
        self.mean_cost = c0 + COST_EWMA_ALPHA * (c - c0)
        delay = 0.5 * timeout_s * (c / (c + c0) if c + c0 > 0 else 0.0)
        return ticket.enqueued_at + delay


class CostOrder(CostKey, HeapOrder):
    """Cheaper first, delayed by at most half the queue timeout: a heap on ``CostKey``."""

    def __init__(self) -> None:
        CostKey.__init__(self)
        HeapOrder.__init__(self)

    def ahead(self, ticket: Ticket, waiting: Mapping[int, Ticket]) -> int | None:
        heap = self.heap
        if len(heap) > AHEAD_SCAN:
            return None
        # Its own entry (a ticket is in a heap once): the heap's order is the key, then the
        # older ticket.
        mine = next((entry for entry in heap if entry[1] == ticket.id), None)
        if mine is None:
            return None
        return sum(1 for entry in heap if entry < mine and entry[1] in waiting)


# The policy's ``order`` -> a new queue order for a bucket (``BucketState.configure``).
QUEUE_ORDERS: Final[dict[Order, Callable[[], QueueOrder]]] = {
    Order.FIFO: FifoOrder,
    Order.COST: CostOrder,
    Order.FAIR: lambda: FairOrder(CostKey()),
}


class Contender(Protocol):
    """What the choice across buckets reads of a bucket."""

    @property
    def priority(self) -> int: ...
    @property
    def shared(self) -> bool: ...  # in a pool with other buckets (else its own slots)
    @property
    def running(self) -> Sized: ...  # its tickets holding a slot
    @property
    def order(self) -> QueueOrder: ...
    def head(self) -> tuple[float, Ticket] | None: ...
    def min_slots(self, limit: int) -> int: ...
    def max_slots(self, limit: int, cut_band: int | None) -> int: ...


_B = TypeVar("_B", bound=Contender)


class BucketChoice:
    """Which of the competing buckets a free slot goes to: the smallest rank."""

    __slots__ = ()

    def rank(self, bucket: Contender, head_key: float, limit: int) -> tuple[float, ...]:
        """The bucket's rank, given its head's queue key and the pool's limit."""
        raise NotImplementedError

    def pick(
        self, buckets: Sequence[_B], limit: int, band: int | None
    ) -> tuple[_B, float, Ticket] | None:
        """The bucket whose head takes the next free slot of a pool of ``limit`` (``band``: the
        band the pool's cut applies to, ``demand.cut_band``), the head's key and the head; None
        when no bucket with waiters is below its cap."""
        rank = self.rank
        best: _B | None = None
        best_key = 0.0
        ticket: Ticket | None = None
        best_rank: tuple[float, ...] | None = None
        for b in buckets:
            head = b.head()
            if head is None:
                continue
            if b.shared and len(b.running) >= b.max_slots(limit, band):
                continue
            if best is None:
                best, (best_key, ticket) = b, head  # alone so far: no rank needed
                continue
            if best_rank is None:
                assert ticket is not None
                best_rank = rank(best, best.order.band_key(best_key, ticket), limit)
            r = rank(b, b.order.band_key(*head), limit)
            if r < best_rank:
                best, best_rank = b, r
                best_key, ticket = head
        if best is None or ticket is None:
            return None
        return best, best_key, ticket


class GuaranteeBandHead(BucketChoice):
    """1. a bucket below its guaranteed share (``floor(min_share x limit)``): nothing starves;
    2. the most urgent band (lowest ``priority``); 3. the earliest head of queue across the
    band's buckets (by their queue keys)."""

    __slots__ = ()

    def rank(self, bucket: Contender, head_key: float, limit: int) -> tuple[float, ...]:
        below_min = 0 if len(bucket.running) < bucket.min_slots(limit) else 1
        return (below_min, bucket.priority, head_key)
