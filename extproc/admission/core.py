"""Stage 3, the pure core: buckets drawing slots from pools, with deadlines.

Theory of operation
-------------------
Every bucket draws its slots from one *pool*, which has a ``limit`` (requests at the backend
at once) and, optionally, ``max_tokens`` (the estimated cost, prompt + max_tokens, of the
requests in flight). Two ways to build them:

- ``set_limits(bucket, capacity, max_queue)`` gives the bucket a pool of its own with
  ``capacity`` slots: the first design, where buckets never lend each other a slot. A policy
  without ``pool`` is built this way, and so are the route shares.
- ``set_pool(name, limit, ...)`` and ``set_bucket(name, pool=name, ...)`` put several buckets
  in one pool, each with a ``priority`` (lower = more urgent), a guaranteed ``min_share`` and a
  largest ``max_share`` of the pool's limit, an optional absolute ``cap``, and a queue
  ``order``.

A request asks with ``enqueue``; the answer is one of

- ADMITTED: it holds a slot now;
- QUEUED: it waits; it has a deadline (enqueue time + its queue timeout);
- QUEUE_FULL: its bucket's queue was full, or the bytes of request bodies held by queued
  tickets (all buckets together) would pass ``max_queued_bytes``; nothing is held;
- WAIT_TOO_LONG: (pools with ``fail_fast``) the predicted wait is longer than its deadline, so
  waiting cannot succeed; nothing is held.

Who gets a freed slot (``_fill``, run after every change)
--------------------------------------------------------
While the pool has a free slot, the candidates are the buckets with waiters that are below
their cap (``min(max_share x limit, cap)``, lowered for the least urgent band by ``set_cut``
during overload, never below its guaranteed share, and only while a more urgent band has
requests running or waiting). The winner is, in this order:

1. a bucket below its guaranteed share (``floor(min_share x limit)``): nothing starves;
2. the most urgent band (lowest ``priority``);
3. the earliest head of queue: FIFO within a band, across its buckets.

The winner's head is admitted if its cost fits the token bound (a request is always admitted
into an empty pool, so one larger than the bound still runs alone); if it does not fit, filling
stops: nobody passes it, so it cannot starve behind smaller ones. Idle capacity goes to whoever
waits (work-conserving): a band with no waiters takes nothing away from the others.

Queue order within a bucket: ``fifo`` (enqueue time), or ``cost``: the key is the enqueue time
plus ``(timeout / 2) x c / (c + c0)``, where ``c`` is the request's cost and ``c0`` the
bucket's running mean cost. A cheap request goes ahead of an expensive one that came a little
earlier (shortest-job-first lowers the mean wait), but a large request is never put back by more
than half its queue timeout: anything that arrived more than that after it goes behind it. One
heap per bucket, so admission stays O(log n).

Predicted wait (``fail_fast``): the requests ahead of this one in its band and above, plus
itself, over the rate at which the full pool frees slots, ``limit / mean hold`` (Little's law,
with the running mean of hold times over releases, so it does not drift down while the pool
sits idle, as a rate of recent releases would). Beyond the deadline, the request is refused at
once instead of after waiting the whole deadline.

Rules (the invariants tests check):
1. A slot is taken only by ``enqueue`` or by a hand-over from ``_fill``; it is given back only
   by ``release`` or ``cancel``; both ignore a ticket that holds no slot, so a slot is given back
   at most once.
2. Nobody jumps the queue: after every call, no waiter that the rules above would admit is left
   waiting while its pool has room.
3. A waiter leaves the queue in exactly one way: admitted (hand-over), evicted (``expire`` once
   its deadline has passed, whatever its place in the queue), or cancelled.
4. ``running <= limit`` for every pool, except after the limit is lowered, when running
   requests finish and no one new is admitted until ``running`` drops below it. A pool's limit
   may be 0 (``set_pool_limit``: a replica of a shared pool that holds no lease,
   ``extproc.shared``): then it admits nobody.
5. ``queued_bytes`` is the sum of ``held_bytes`` over waiting tickets, never more than
   ``max_queued_bytes``.

Every call takes ``now`` from the caller and returns what changed; nothing here sleeps, reads a
clock or knows about asyncio (the asyncio shell is ``extproc.admission.gate``). Tests drive it
with plain numbers. Costs: enqueue, hand-over and cancel are O(log n + buckets in the pool);
eviction is O(log n) through one heap of deadlines across buckets, with lazy deletion and
compaction.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Admission", "BucketStats", "Decision", "PoolStats", "Ticket", "Verdict"]

# Weight of the newest hold time in the running mean used for Retry-After.
_HOLD_EWMA_ALPHA = 0.2
# Weight of the newest cost in a bucket's running mean cost (the ``cost`` order's c0).
_COST_EWMA_ALPHA = 0.05
# Predicted waits use the pool's running mean hold time (same weight as above), trusted once it
# has seen this many releases (fewer: no prediction, nobody is refused for it).
_RATE_MIN_RELEASES = 8
# Recent admissions' waits kept per bucket, for the p95 the overload monitor reads.
_WAIT_SAMPLES = 512


def _ewma(mean: float | None, value: float) -> float:
    return value if mean is None else (1 - _HOLD_EWMA_ALPHA) * mean + _HOLD_EWMA_ALPHA * value


class Verdict(StrEnum):
    ADMITTED = "admitted"
    QUEUED = "queued"
    QUEUE_FULL = "queue_full"
    WAIT_TOO_LONG = "wait_too_long"


@dataclass(frozen=True, slots=True, kw_only=True)
class Ticket:
    id: int
    bucket: str
    enqueued_at: float
    deadline: float
    # Bytes the request holds while it waits (its body, to be forwarded once admitted).
    held_bytes: int = 0
    # Estimated prompt tokens + effective max_tokens: what it costs the backend.
    cost: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    verdict: Verdict
    ticket: Ticket
    # WAIT_TOO_LONG: the predicted wait, seconds.
    predicted_wait_s: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketStats:
    name: str
    # The most slots the bucket may hold now (its own capacity, or its cap in its pool).
    capacity: int
    in_flight: int
    queued: int
    max_queue: int
    # Running mean of how long a slot is held, seconds; None until a slot was released.
    mean_hold_s: float | None
    # Bytes of request bodies held by the bucket's waiting tickets.
    queued_bytes: int = 0
    pool: str | None = None  # None: the bucket's own slots
    priority: int = 0
    tokens_in_flight: int = 0
    # Cumulative counts: admitted, evicted at the deadline, refused at once (full, too long).
    admitted_total: int = 0
    evicted_total: int = 0
    refused_total: int = 0

    def __repr__(self) -> str:
        return f"{self.name} {self.in_flight}/{self.capacity} +{self.queued} queued"


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolStats:
    name: str
    limit: int
    in_flight: int
    max_tokens: int | None
    tokens_in_flight: int
    queued: int
    cut: float
    release_rate: float | None  # slots freed per second, recently; None until measured


class _Pool:
    __slots__ = (
        "buckets",
        "cut",
        "fail_fast",
        "limit",
        "max_tokens",
        "mean_hold_s",
        "name",
        "releases",
        "running",
        "tokens",
    )

    def __init__(self, name: str, limit: int) -> None:
        self.name = name
        self.limit = limit
        self.max_tokens: int | None = None
        self.fail_fast = False
        self.cut = 1.0  # the overload factor for every band but the most urgent
        self.running = 0
        self.tokens = 0
        self.buckets: list[_Bucket] = []
        self.mean_hold_s: float | None = None
        self.releases = 0

    def release_rate(self) -> float | None:
        """Slots freed per second while the pool is full: limit / mean hold (Little's law;
        the mean is over releases, so short requests weigh as often as they free a slot)."""
        if self.releases < _RATE_MIN_RELEASES or not self.mean_hold_s or self.limit < 1:
            return None
        return self.limit / self.mean_hold_s


class _Bucket:
    __slots__ = (
        "admitted_total",
        "cap",
        "cost_order",
        "evicted_total",
        "heap",
        "max_queue",
        "max_share",
        "mean_cost",
        "mean_hold_s",
        "min_share",
        "name",
        "pool",
        "priority",
        "queued_bytes",
        "refused_total",
        "running",
        "shared",
        "tokens",
        "waiting",
        "waits",
    )

    def __init__(self, name: str, pool: _Pool, max_queue: int) -> None:
        self.name = name
        self.pool = pool
        self.shared = False  # in a named pool (else the pool is the bucket's own)
        self.max_queue = max_queue
        self.priority = 0
        self.min_share = 0.0
        self.max_share = 1.0
        self.cap: int | None = None
        self.cost_order = False
        self.mean_cost: float | None = None
        self.waiting: dict[int, Ticket] = {}
        self.heap: list[tuple[float, int]] = []  # (order key, ticket id), lazy deletion
        # ticket id -> (ticket, admitted_at)
        self.running: dict[int, tuple[Ticket, float]] = {}
        self.tokens = 0
        self.mean_hold_s: float | None = None
        self.queued_bytes = 0
        self.admitted_total = 0
        self.evicted_total = 0
        self.refused_total = 0
        self.waits: deque[float] = deque(maxlen=_WAIT_SAMPLES)

    def head(self) -> tuple[float, Ticket] | None:
        heap = self.heap
        while heap:
            key, tid = heap[0]
            ticket = self.waiting.get(tid)
            if ticket is not None:
                return key, ticket
            heapq.heappop(heap)
        return None

    def min_slots(self, limit: int) -> int:
        return math.floor(self.min_share * limit + 1e-9)

    def max_slots(self, limit: int, cut_band: int | None) -> int:
        top = max(1, math.floor(self.max_share * limit + 1e-9))
        if self.cap is not None:
            top = min(top, self.cap)
        cut = self.pool.cut
        if cut < 1.0 and self.priority == cut_band:
            top = min(top, max(self.min_slots(limit), math.floor(cut * top)))
        return top


class Admission:
    def __init__(
        self, limits: dict[str, tuple[int, int]], max_queued_bytes: int | None = None
    ) -> None:
        """``limits``: bucket name -> (capacity, max_queue), each bucket its own slots;
        ``max_queued_bytes``: the bound on the bytes held by queued tickets across buckets
        (None: unbounded). Pools are added with ``set_pool`` and ``set_bucket``."""
        self._buckets: dict[str, _Bucket] = {}
        self._pools: dict[str, _Pool] = {}
        self.max_queued_bytes = max_queued_bytes
        self.queued_bytes = 0
        self._where: dict[int, _Bucket] = {}  # every live ticket (waiting or running)
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline, ticket id)
        self._ids = itertools.count(1)
        self._admitted_by_expiry: list[Ticket] = []
        for name, (capacity, max_queue) in limits.items():
            self.set_limits(name, capacity, max_queue, now=0.0)

    # --- requests ----------------------------------------------------------------------------

    def enqueue(
        self, bucket: str, now: float, timeout_s: float, held_bytes: int = 0, cost: int = 0
    ) -> Decision:
        b = self._buckets[bucket]
        pool = b.pool
        ticket = Ticket(
            id=next(self._ids),
            bucket=bucket,
            enqueued_at=now,
            deadline=now + timeout_s,
            held_bytes=held_bytes,
            cost=cost,
        )
        # Join the queue, then let the rules decide: admitted at once when they pick it now.
        self._where[ticket.id] = b
        b.waiting[ticket.id] = ticket
        heapq.heappush(b.heap, (self._order_key(b, ticket, timeout_s), ticket.id))
        self.queued_bytes += held_bytes
        b.queued_bytes += held_bytes
        if pool.running < pool.limit:
            self._fill(pool, now)
            if ticket.id in b.running:
                return Decision(verdict=Verdict.ADMITTED, ticket=ticket)
        if len(b.waiting) > b.max_queue or (
            self.max_queued_bytes is not None and self.queued_bytes > self.max_queued_bytes
        ):
            self._drop(b, ticket)
            b.refused_total += 1
            return Decision(verdict=Verdict.QUEUE_FULL, ticket=ticket)
        if pool.fail_fast:
            wait = self._predicted_wait_s(b, now, exclude=ticket.id)
            if wait is not None and wait > timeout_s:
                self._drop(b, ticket)
                b.refused_total += 1
                return Decision(verdict=Verdict.WAIT_TOO_LONG, ticket=ticket, predicted_wait_s=wait)
        heapq.heappush(self._deadlines, (ticket.deadline, ticket.id))
        return Decision(verdict=Verdict.QUEUED, ticket=ticket)

    def release(self, ticket_id: int, now: float) -> list[Ticket]:
        """Give back the slot of a running ticket; returns the tickets admitted in its place.

        A ticket that holds no slot (never admitted, already released) is ignored.
        """
        b = self._where.get(ticket_id)
        if b is None or ticket_id not in b.running:
            return []
        ticket, admitted_at = b.running.pop(ticket_id)
        del self._where[ticket_id]
        pool = b.pool
        pool.running -= 1
        pool.tokens -= ticket.cost
        b.tokens -= ticket.cost
        hold = max(0.0, now - admitted_at)
        b.mean_hold_s = _ewma(b.mean_hold_s, hold)
        pool.mean_hold_s = _ewma(pool.mean_hold_s, hold)
        pool.releases += 1
        return self._fill(pool, now)

    def cancel(self, ticket_id: int, now: float) -> list[Ticket]:
        """The request went away: drop it from the queue, or release its slot if it had one."""
        b = self._where.get(ticket_id)
        if b is None:
            return []
        if ticket_id in b.running:
            return self.release(ticket_id, now)
        self._drop(b, b.waiting[ticket_id])
        self._maybe_compact()
        # A waiter that left may have been the one the token bound held everyone behind.
        return self._fill(b.pool, now) if b.pool.max_tokens is not None else []

    def expire(self, now: float) -> list[Ticket]:
        """Evict every waiter whose deadline is at or before ``now``, earliest first."""
        evicted: list[Ticket] = []
        heap = self._deadlines
        pools: set[_Pool] = set()
        while heap and heap[0][0] <= now:
            _, tid = heapq.heappop(heap)
            b = self._where.get(tid)
            if b is None or tid not in b.waiting:
                continue  # admitted or cancelled since: a stale heap entry
            ticket = b.waiting[tid]
            self._drop(b, ticket)
            b.evicted_total += 1
            evicted.append(ticket)
            if b.pool.max_tokens is not None:
                pools.add(b.pool)
        for pool in pools:  # see cancel: a blocked head may have left
            self._admitted_by_expiry.extend(self._fill(pool, now))
        return evicted

    def take_admitted(self) -> list[Ticket]:
        """Tickets admitted as a side effect of ``expire`` (a head the token bound held left)."""
        out, self._admitted_by_expiry = self._admitted_by_expiry, []
        return out

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
        """Create a bucket with slots of its own, or change them; returns waiters admitted by
        a raised capacity.

        A lowered capacity takes no slot away: running requests finish. A lowered max_queue
        evicts nobody already waiting; it only refuses newcomers.
        """
        if capacity < 1 or max_queue < 0:
            raise ValueError(f"bucket {bucket!r}: capacity must be >= 1 and max_queue >= 0")
        b = self._buckets.get(bucket)
        if b is None:
            b = self._buckets[bucket] = _Bucket(bucket, _Pool(bucket, capacity), max_queue)
            b.pool.buckets.append(b)
            return []
        admitted = self._move(b, None, now) if b.shared else []
        b.pool.limit, b.max_queue = capacity, max_queue
        b.priority, b.min_share, b.max_share, b.cap, b.cost_order = 0, 0.0, 1.0, None, False
        return admitted + self._fill(b.pool, now)

    def set_pool(
        self,
        name: str,
        limit: int,
        now: float,
        *,
        max_tokens: int | None = None,
        fail_fast: bool = True,
    ) -> list[Ticket]:
        """Create a shared pool or change it; returns waiters admitted by a raised limit
        (``limit`` 0: nobody is admitted, see ``set_pool_limit``)."""
        if limit < 0 or (max_tokens is not None and max_tokens < 1):
            raise ValueError(f"pool {name!r}: limit must be >= 0 and max_tokens >= 1")
        pool = self._pools.get(name)
        if pool is None:
            pool = self._pools[name] = _Pool(name, limit)
        pool.limit, pool.max_tokens, pool.fail_fast = limit, max_tokens, fail_fast
        return self._fill(pool, now)

    def set_pool_limit(self, name: str, limit: int, now: float) -> list[Ticket]:
        """The pool's limit only (the adaptive controller's knob, and the leases a replica of
        a shared pool holds, which may be none: 0 admits nobody)."""
        pool = self._pools[name]
        pool.limit = max(0, limit)
        return self._fill(pool, now)

    def set_cut(self, name: str, factor: float, now: float) -> list[Ticket]:
        """Overload: the pool's least urgent band (when it has more than one) may hold at most
        ``factor`` of its usual cap (never less than its guaranteed share); 1.0 lifts it."""
        pool = self._pools[name]
        pool.cut = min(1.0, max(0.0, factor))
        return self._fill(pool, now)

    def set_bucket(
        self,
        bucket: str,
        now: float,
        *,
        pool: str,
        max_queue: int,
        priority: int = 0,
        min_share: float = 0.0,
        max_share: float = 1.0,
        cap: int | None = None,
        cost_order: bool = False,
    ) -> list[Ticket]:
        """Create a bucket in a shared pool (``set_pool`` first), or change it; a bucket that
        had slots of its own, or another pool, moves with its running and waiting requests."""
        if max_queue < 0 or not 0 <= min_share <= max_share <= 1 or max_share <= 0:
            raise ValueError(f"bucket {bucket!r}: bad max_queue or shares")
        target = self._pools[pool]
        b = self._buckets.get(bucket)
        admitted: list[Ticket] = []
        if b is None:
            b = self._buckets[bucket] = _Bucket(bucket, target, max_queue)
            b.shared = True
            target.buckets.append(b)
        elif b.pool is not target:
            admitted = self._move(b, target, now)
        b.max_queue, b.priority, b.min_share, b.max_share = (
            max_queue,
            priority,
            min_share,
            max_share,
        )
        b.cap = cap if cap else None
        b.cost_order = cost_order
        target.buckets.sort(key=lambda x: x.priority)
        return admitted + self._fill(target, now)

    def remove(self, bucket: str) -> bool:
        """Forget a bucket that holds nothing (no ticket running or waiting); returns whether
        it was removed. A busy bucket stays until it drains."""
        b = self._buckets.get(bucket)
        if b is None or b.running or b.waiting:
            return False
        del self._buckets[bucket]
        b.pool.buckets.remove(b)
        return True

    def remove_pool(self, name: str) -> bool:
        """Forget a shared pool that no bucket uses any more."""
        pool = self._pools.get(name)
        if pool is None or pool.buckets:
            return False
        del self._pools[name]
        return True

    # --- views -------------------------------------------------------------------------------

    def statistics(self) -> dict[str, BucketStats]:
        out: dict[str, BucketStats] = {}
        for name, b in self._buckets.items():
            pool = b.pool
            out[name] = BucketStats(
                name=name,
                capacity=b.max_slots(pool.limit, self._cut_band(pool)) if b.shared else pool.limit,
                in_flight=len(b.running),
                queued=len(b.waiting),
                max_queue=b.max_queue,
                mean_hold_s=b.mean_hold_s,
                queued_bytes=b.queued_bytes,
                pool=pool.name if b.shared else None,
                priority=b.priority,
                tokens_in_flight=b.tokens,
                admitted_total=b.admitted_total,
                evicted_total=b.evicted_total,
                refused_total=b.refused_total,
            )
        return out

    def pool_statistics(self, now: float) -> dict[str, PoolStats]:
        return {
            name: PoolStats(
                name=name,
                limit=p.limit,
                in_flight=p.running,
                max_tokens=p.max_tokens,
                tokens_in_flight=p.tokens,
                queued=sum(len(b.waiting) for b in p.buckets),
                cut=p.cut,
                release_rate=p.release_rate(),
            )
            for name, p in self._pools.items()
        }

    def recent_waits(self, bucket: str) -> list[float]:
        """Queue waits of the bucket's latest admissions (0 for the fast path), oldest first."""
        return list(self._buckets[bucket].waits)

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

    def drain_estimate_s(self, bucket: str, default_hold_s: float, now: float = 0.0) -> float:
        """How long a request joining ``bucket`` now would wait.

        Own slots: the queue ahead of it plus itself, times the mean hold, spread over the
        bucket's slots. Shared pool: the requests ahead of it in its band and above, plus
        itself, over the measured rate at which the pool frees slots (the same estimate
        before that rate is known, with the pool's limit as the slots)."""
        b = self._buckets[bucket]
        if b.shared:
            wait = self._predicted_wait_s(b, now)
            if wait is not None:
                return wait
            ahead = sum(len(x.waiting) for x in b.pool.buckets if x.priority <= b.priority)
        else:
            ahead = len(b.waiting)
        hold = b.mean_hold_s if b.mean_hold_s is not None else default_hold_s
        return (ahead + 1) * hold / max(1, b.pool.limit)

    def __repr__(self) -> str:
        return "<Admission " + ", ".join(repr(s) for s in self.statistics().values()) + ">"

    # --- internals ---------------------------------------------------------------------------

    def _order_key(self, b: _Bucket, ticket: Ticket, timeout_s: float) -> float:
        if not b.cost_order:
            return ticket.enqueued_at
        c = float(max(0, ticket.cost))
        c0 = b.mean_cost if b.mean_cost is not None else c
        b.mean_cost = c0 + _COST_EWMA_ALPHA * (c - c0)
        delay = 0.5 * timeout_s * (c / (c + c0) if c + c0 > 0 else 0.0)
        return ticket.enqueued_at + delay

    def _predicted_wait_s(self, b: _Bucket, now: float, exclude: int = 0) -> float | None:
        rate = b.pool.release_rate()
        if rate is None:
            return None
        if len(b.running) < b.min_slots(b.pool.limit):
            ahead = len(b.waiting)  # below its guaranteed share: served before other bands
        else:
            ahead = sum(len(x.waiting) for x in b.pool.buckets if x.priority <= b.priority)
        if exclude in b.waiting:
            ahead -= 1
        return (ahead + 1) / rate

    @staticmethod
    def _cut_band(pool: _Pool) -> int | None:
        """The band ``set_cut`` applies to now: the least urgent, when there are several and
        a more urgent one has requests running or waiting. Without them the cut would only
        leave the pool idle, so the least urgent band may use it all (work-conserving)."""
        priorities = {b.priority for b in pool.buckets}
        if len(priorities) < 2:
            return None
        least = max(priorities)
        busy = any(b.running or b.waiting for b in pool.buckets if b.priority < least)
        return least if busy else None

    def _fill(self, pool: _Pool, now: float) -> list[Ticket]:
        admitted: list[Ticket] = []
        cut_band = self._cut_band(pool) if pool.cut < 1.0 else None
        while pool.running < pool.limit:
            best: _Bucket | None = None
            best_key: tuple[int, int, float] | None = None
            best_ticket: Ticket | None = None
            for b in pool.buckets:
                head = b.head()
                if head is None:
                    continue
                if b.shared and len(b.running) >= b.max_slots(pool.limit, cut_band):
                    continue
                below_min = 0 if len(b.running) < b.min_slots(pool.limit) else 1
                key = (below_min, b.priority, head[0])
                if best_key is None or key < best_key:
                    best, best_key, best_ticket = b, key, head[1]
            if best is None or best_ticket is None:
                break
            if (
                pool.max_tokens is not None
                and pool.running > 0
                and pool.tokens + best_ticket.cost > pool.max_tokens
            ):
                break  # the token bound holds it; nobody passes it
            self._admit(best, best_ticket, now)
            admitted.append(best_ticket)
        if admitted:
            self._maybe_compact()
        return admitted

    def _admit(self, b: _Bucket, ticket: Ticket, now: float) -> None:
        del b.waiting[ticket.id]
        self._unqueue(b, ticket)  # its body goes upstream with the admission
        b.running[ticket.id] = (ticket, now)
        b.pool.running += 1
        b.pool.tokens += ticket.cost
        b.tokens += ticket.cost
        b.admitted_total += 1
        b.waits.append(now - ticket.enqueued_at)

    def _drop(self, b: _Bucket, ticket: Ticket) -> None:
        """A waiter leaves the queue without a slot."""
        del b.waiting[ticket.id]
        self._unqueue(b, ticket)
        del self._where[ticket.id]

    def _unqueue(self, b: _Bucket, ticket: Ticket) -> None:
        self.queued_bytes -= ticket.held_bytes
        b.queued_bytes -= ticket.held_bytes

    def _move(self, b: _Bucket, target: _Pool | None, now: float) -> list[Ticket]:
        """Move a bucket, with its running requests' slots and tokens, to another pool (None:
        a pool of its own, sized by the caller)."""
        old = b.pool
        old.buckets.remove(b)
        old.running -= len(b.running)
        old.tokens -= b.tokens
        if target is None:
            target = _Pool(b.name, max(1, old.limit))
            b.shared = False
        else:
            b.shared = True
        target.buckets.append(b)
        target.running += len(b.running)
        target.tokens += b.tokens
        b.pool = target
        return self._fill(old, now) if old.buckets else []

    def _maybe_compact(self) -> None:
        # Heap entries of tickets that left the queue early stay until their deadline. Rebuild
        # when they outnumber live tickets, so memory stays O(tickets) at O(1) amortised cost.
        live = len(self._where)
        if len(self._deadlines) > 64 and len(self._deadlines) > 2 * live:
            self._deadlines = [
                (d, tid)
                for d, tid in self._deadlines
                if (b := self._where.get(tid)) is not None and tid in b.waiting
            ]
            heapq.heapify(self._deadlines)
        for b in self._buckets.values():
            if len(b.heap) > 64 and len(b.heap) > 2 * len(b.waiting):
                b.heap = [(k, tid) for k, tid in b.heap if tid in b.waiting]
                heapq.heapify(b.heap)
