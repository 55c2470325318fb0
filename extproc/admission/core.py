"""Stage 3, the pure core: per-bucket slots and FIFO queues with deadlines.

Theory of operation
-------------------
A bucket has ``capacity`` slots and a FIFO queue of at most ``max_queue`` waiting tickets. A
request asks with ``enqueue``; the answer is one of

- ADMITTED: a slot was free and nobody was waiting; the ticket holds a slot now;
- QUEUED: the ticket waits; it has a deadline (enqueue time + the bucket's queue timeout);
- QUEUE_FULL: the queue was full, or the bytes of request bodies held by queued tickets (all
  buckets together) would pass ``max_queued_bytes``; nothing is held.

Every call takes ``now`` from the caller and returns what changed; nothing here sleeps, reads a
clock or knows about asyncio (the asyncio shell is ``extproc.admission.gate``). Tests drive
it with plain numbers.

Rules (the invariants tests check):
1. A slot is taken only by ``enqueue`` (fast path) or by a hand-over from ``release``, ``cancel``
   of an admitted ticket, or ``set_limits`` raising capacity. It is given back only by ``release``
   or ``cancel``; both ignore a ticket that holds no slot, so a slot is given back at most once.
2. Nobody jumps the queue: the fast path is refused while anyone waits, and a freed slot goes to
   the head of the queue at once (trio's CapacityLimiter and asyncio.Semaphore do the same).
3. A waiter leaves the queue in exactly one way: admitted (hand-over), evicted (``expire`` once
   its deadline has passed, whatever its place in the queue), or cancelled.
4. ``in_flight <= capacity`` except after capacity is lowered, when running requests finish and
   no one new is admitted until ``in_flight`` drops below the new capacity.
5. ``queued_bytes`` is the sum of ``held_bytes`` over waiting tickets, never more than
   ``max_queued_bytes``: a ticket's bytes are counted when it joins a queue and discounted when
   it leaves it, whichever way (the fast path counts nothing: its body goes upstream at once).

Costs: enqueue, hand-over and cancel are O(1) (an OrderedDict per bucket); eviction is
O(log n) through one heap of deadlines across buckets, with lazy deletion and compaction.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Admission", "BucketStats", "Decision", "Ticket", "Verdict"]

# Weight of the newest hold time in the running mean used for Retry-After.
_HOLD_EWMA_ALPHA = 0.2


class Verdict(StrEnum):
    ADMITTED = "admitted"
    QUEUED = "queued"
    QUEUE_FULL = "queue_full"


@dataclass(frozen=True, slots=True, kw_only=True)
class Ticket:
    id: int
    bucket: str
    enqueued_at: float
    deadline: float
    # Bytes the request holds while it waits (its body, to be forwarded once admitted).
    held_bytes: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    verdict: Verdict
    ticket: Ticket


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketStats:
    name: str
    capacity: int
    in_flight: int
    queued: int
    max_queue: int
    # Running mean of how long a slot is held, seconds; None until a slot was released.
    mean_hold_s: float | None
    # Bytes of request bodies held by the bucket's waiting tickets.
    queued_bytes: int = 0

    def __repr__(self) -> str:
        return f"{self.name} {self.in_flight}/{self.capacity} +{self.queued} queued"


class _Bucket:
    __slots__ = (
        "capacity",
        "max_queue",
        "mean_hold_s",
        "name",
        "queued_bytes",
        "running",
        "waiting",
    )

    def __init__(self, name: str, capacity: int, max_queue: int) -> None:
        self.name = name
        self.capacity = capacity
        self.max_queue = max_queue
        self.waiting: OrderedDict[int, Ticket] = OrderedDict()
        # ticket id -> (ticket, admitted_at)
        self.running: dict[int, tuple[Ticket, float]] = {}
        self.mean_hold_s: float | None = None
        self.queued_bytes = 0


class Admission:
    def __init__(
        self, limits: dict[str, tuple[int, int]], max_queued_bytes: int | None = None
    ) -> None:
        """``limits``: bucket name -> (capacity, max_queue); ``max_queued_bytes``: the bound on
        the bytes held by queued tickets across buckets (None: unbounded)."""
        self._buckets: dict[str, _Bucket] = {}
        self.max_queued_bytes = max_queued_bytes
        self.queued_bytes = 0
        self._where: dict[int, _Bucket] = {}  # every live ticket (waiting or running)
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline, ticket id)
        self._ids = itertools.count(1)
        for name, (capacity, max_queue) in limits.items():
            self.set_limits(name, capacity, max_queue, now=0.0)

    # --- requests ----------------------------------------------------------------------------

    def enqueue(self, bucket: str, now: float, timeout_s: float, held_bytes: int = 0) -> Decision:
        b = self._buckets[bucket]
        ticket = Ticket(
            id=next(self._ids),
            bucket=bucket,
            enqueued_at=now,
            deadline=now + timeout_s,
            held_bytes=held_bytes,
        )
        if not b.waiting and len(b.running) < b.capacity:
            b.running[ticket.id] = (ticket, now)
            self._where[ticket.id] = b
            return Decision(verdict=Verdict.ADMITTED, ticket=ticket)
        if len(b.waiting) >= b.max_queue or (
            self.max_queued_bytes is not None
            and self.queued_bytes + held_bytes > self.max_queued_bytes
        ):
            return Decision(verdict=Verdict.QUEUE_FULL, ticket=ticket)
        self.queued_bytes += held_bytes
        b.queued_bytes += held_bytes
        b.waiting[ticket.id] = ticket
        self._where[ticket.id] = b
        heapq.heappush(self._deadlines, (ticket.deadline, ticket.id))
        return Decision(verdict=Verdict.QUEUED, ticket=ticket)

    def release(self, ticket_id: int, now: float) -> list[Ticket]:
        """Give back the slot of a running ticket; returns the tickets admitted in its place.

        A ticket that holds no slot (never admitted, already released) is ignored.
        """
        b = self._where.get(ticket_id)
        if b is None or ticket_id not in b.running:
            return []
        _, admitted_at = b.running.pop(ticket_id)
        del self._where[ticket_id]
        hold = max(0.0, now - admitted_at)
        b.mean_hold_s = (
            hold
            if b.mean_hold_s is None
            else (1 - _HOLD_EWMA_ALPHA) * b.mean_hold_s + _HOLD_EWMA_ALPHA * hold
        )
        return self._fill(b, now)

    def cancel(self, ticket_id: int, now: float) -> list[Ticket]:
        """The request went away: drop it from the queue, or release its slot if it had one."""
        b = self._where.get(ticket_id)
        if b is None:
            return []
        if ticket_id in b.running:
            return self.release(ticket_id, now)
        self._unqueue(b, b.waiting.pop(ticket_id))
        del self._where[ticket_id]
        self._maybe_compact()
        return []

    def expire(self, now: float) -> list[Ticket]:
        """Evict every waiter whose deadline is at or before ``now``, earliest first."""
        evicted: list[Ticket] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, tid = heapq.heappop(heap)
            b = self._where.get(tid)
            if b is None or tid not in b.waiting:
                continue  # admitted or cancelled since: a stale heap entry
            ticket = b.waiting.pop(tid)
            self._unqueue(b, ticket)
            evicted.append(ticket)
            del self._where[tid]
        return evicted

    def next_deadline(self) -> float | None:
        heap = self._deadlines
        while heap:
            deadline, tid = heap[0]
            b = self._where.get(tid)
            if b is not None and tid in b.waiting:
                return deadline
            heapq.heappop(heap)
        return None

    # --- configuration -----------------------------------------------------------------------

    def set_limits(self, bucket: str, capacity: int, max_queue: int, now: float) -> list[Ticket]:
        """Create a bucket or change its limits; returns waiters admitted by a raised capacity.

        A lowered capacity takes no slot away: running requests finish. A lowered max_queue
        evicts nobody already waiting; it only refuses newcomers.
        """
        if capacity < 1 or max_queue < 0:
            raise ValueError(f"bucket {bucket!r}: capacity must be >= 1 and max_queue >= 0")
        b = self._buckets.get(bucket)
        if b is None:
            self._buckets[bucket] = _Bucket(bucket, capacity, max_queue)
            return []
        b.capacity, b.max_queue = capacity, max_queue
        return self._fill(b, now)

    def remove(self, bucket: str) -> bool:
        """Forget a bucket that holds nothing (no ticket running or waiting); returns whether
        it was removed. A busy bucket stays until it drains."""
        b = self._buckets.get(bucket)
        if b is None or b.running or b.waiting:
            return False
        del self._buckets[bucket]
        return True

    # --- views -------------------------------------------------------------------------------

    def statistics(self) -> dict[str, BucketStats]:
        return {
            name: BucketStats(
                name=name,
                capacity=b.capacity,
                in_flight=len(b.running),
                queued=len(b.waiting),
                max_queue=b.max_queue,
                mean_hold_s=b.mean_hold_s,
                queued_bytes=b.queued_bytes,
            )
            for name, b in self._buckets.items()
        }

    def ticket(self, ticket_id: int) -> Ticket | None:
        """A live ticket (waiting or running), or None."""
        b = self._where.get(ticket_id)
        if b is None:
            return None
        if ticket_id in b.waiting:
            return b.waiting[ticket_id]
        return b.running[ticket_id][0]

    def queued(self, bucket: str) -> int:
        return len(self._buckets[bucket].waiting)

    def drain_estimate_s(self, bucket: str, default_hold_s: float) -> float:
        """How long a request joining ``bucket`` now would wait: the queue ahead of it plus
        itself, times the mean hold, spread over the bucket's slots."""
        b = self._buckets[bucket]
        hold = b.mean_hold_s if b.mean_hold_s is not None else default_hold_s
        return (len(b.waiting) + 1) * hold / b.capacity

    def __repr__(self) -> str:
        return "<Admission " + ", ".join(repr(s) for s in self.statistics().values()) + ">"

    # --- internals ---------------------------------------------------------------------------

    def _fill(self, b: _Bucket, now: float) -> list[Ticket]:
        admitted: list[Ticket] = []
        while b.waiting and len(b.running) < b.capacity:
            _, ticket = b.waiting.popitem(last=False)
            self._unqueue(b, ticket)  # its body goes upstream with the admission
            b.running[ticket.id] = (ticket, now)
            admitted.append(ticket)
        if admitted:
            self._maybe_compact()
        return admitted

    def _unqueue(self, b: _Bucket, ticket: Ticket) -> None:
        self.queued_bytes -= ticket.held_bytes
        b.queued_bytes -= ticket.held_bytes

    def _maybe_compact(self) -> None:
        # Heap entries of tickets that left the queue early stay until their deadline. Rebuild
        # when they outnumber live waiters, so memory stays O(waiters) at O(1) amortised cost.
        waiting = len(self._where)
        if len(self._deadlines) > 64 and len(self._deadlines) > 2 * waiting:
            self._deadlines = [
                (d, tid)
                for d, tid in self._deadlines
                if (b := self._where.get(tid)) is not None and tid in b.waiting
            ]
            heapq.heapify(self._deadlines)
