"""Stage 3, the pure core: buckets drawing slots from pools, with deadlines.

The value types are in ``extproc.pool.core.values``, the mutable state in
``extproc.pool.core.state``, the named decisions (the order within a bucket, the choice across
buckets) in ``extproc.pool.core.order``, and the band the overload cut applies to in
``extproc.pool.core.demand``.

Theory of operation
-------------------
Every bucket draws its slots from one *pool*, which has a ``limit`` (requests at the backend
at once) and, optionally, ``max_tokens`` (the estimated cost, prompt + max_tokens, of the
requests in flight). Two ways to build them:

- ``set_limits(bucket, capacity, max_queue)`` gives the bucket a pool of its own with
  ``capacity`` slots: buckets never lend each other a slot. A policy without ``pool`` is built
  this way, and so are the route shares.
- ``set_pool(name, limit, ...)`` and ``set_bucket(name, rule, now)`` put several buckets in
  one pool, each by its ``state.BucketRule``: its policy's ``priority`` (lower = more urgent),
  guaranteed ``min_share``, queue ``order`` and tenants, and a largest ``max_share`` of the
  pool's limit with an optional absolute ``cap``.

A request asks with ``enqueue(entry, now)`` (an ``Entry``: what it brings); the answer is one of

- ADMITTED: it holds a slot now;
- QUEUED: it waits; it has a deadline (enqueue time + its queue timeout);
- QUEUE_FULL: its bucket's queue was full, or the bytes of request bodies held by queued
  tickets (all buckets together) would pass ``max_queued_bytes``; nothing is held;
- WAIT_TOO_LONG: (pools with ``fail_fast``) the predicted wait is longer than its deadline
  (and its relegation's, ``relegate.longest_wait``), so waiting cannot succeed; nothing is held.

Who gets a freed slot (``_fill``, run after every change)
--------------------------------------------------------
While the pool has a free slot, the candidates are the buckets with waiters that are below
their cap (``min(max_share x limit, cap)``, lowered for the least urgent band by ``set_cut``
during overload or by the band cut, never below its guaranteed share, and only while a more
urgent band has requests running or waiting: ``demand.cut_band``). The pool's
``BucketChoice`` picks one (``order.GuaranteeBandHead``: below its guaranteed share first,
then the most urgent band, then the earliest head); each bucket's ``QueueOrder`` keeps its
queue (``fifo``, ``cost``, ``fair``).
The winner's head is admitted if its cost fits the token bound (a request is always admitted
into an empty pool, so one larger than the bound still runs alone); if it does not fit, filling
stops: nobody passes it, so it cannot starve behind smaller ones. Idle capacity goes to whoever
waits (work-conserving): a band with no waiters takes nothing away from the others.

Predicted wait (``fail_fast``, ``BucketState.predicted_wait_s``): the requests ahead of this
one over the rate at which the full pool frees slots; past the deadline, refused at once.

Rules (the invariants tests check):
1. A slot is taken only by ``enqueue`` or by a hand-over from ``_fill``; it is given back only
   by ``release`` or ``cancel``; both ignore a ticket that holds no slot, so a slot is given back
   at most once.
2. Nobody jumps the queue: after every call, no waiter that the rules above would admit is left
   waiting while its pool has room.
3. A waiter leaves the queue in exactly one way: admitted (hand-over), evicted (``expire`` once
   its deadline has passed, whatever its place in the queue), or cancelled. One at a deadline of
   its client's own (``client_deadline``) is counted apart: ``client_expired_total``. A waiter
   of a bucket that relegates moves at its deadline, at most once, into its target's queue
   (``extproc.pool.core.relegate``: ``relegated_total``), and leaves from there in one of the ways.
4. ``running <= limit`` for every pool, except after the limit is lowered, when running
   requests finish and no one new is admitted until ``running`` drops below it. A pool's limit
   may be 0 (``set_pool_limit``: a replica of a shared pool that holds no lease,
   ``extproc.pool.shared.adapter``): then it admits nobody.
5. ``queued_bytes`` is the sum of ``held_bytes`` over waiting tickets, never more than
   ``max_queued_bytes``.
6. A bucket with tenant bounds (``extproc.pool.core.tenants``) refuses a tenant's request before
   it joins when the tenant has ``max_queue`` waiting, or ``max_share`` of the bucket's
   largest number of slots waiting and running (TENANT_QUEUE_FULL, TENANT_OVER_SHARE);
   nothing is held, and the bucket's ``refused_total`` does not count it. The requests
   without a tenant key are one tenant under the same bounds. The share is of the bucket's
   slots at the pool's capacity (``PoolState.capacity``): the whole pool's limit
   (``set_whole_limit``: a shared pool's, not the leases this replica holds), and while the
   limit is 0 its last positive value.
7. A full bucket whose order keeps room (``FairOrder.displace``: the fair order) takes a
   newcomer whose tenant, once it joined, has fewer waiters than the heaviest tenant: that
   tenant's newest waiter is refused QUEUE_FULL in its stead (``Decision.displaced``,
   counted in ``refused_total``). Otherwise the newcomer is refused.

Every call takes ``now`` from the caller and returns what changed; nothing here sleeps, reads a
clock or knows about asyncio (the asyncio shell is ``extproc.pool.gate``). Tests drive it
with plain numbers. Costs: enqueue, hand-over and cancel are O(log n + buckets in the pool);
eviction is O(log n) through one heap of deadlines across buckets, with lazy deletion and
compaction (``extproc.pool.core.deadlines``) after every way out of a queue, refusals and
evictions included (at limit 0 nobody is admitted); a tenant's bounds and the room a full
fair bucket keeps are O(1).
"""

from __future__ import annotations

import itertools

from extproc.pool.core.deadlines import Deadlines
from extproc.pool.core.demand import cut_band
from extproc.pool.core.order import BucketChoice
from extproc.pool.core.relegate import longest_wait, relegate
from extproc.pool.core.state import BucketRule, BucketState, PoolState, ewma
from extproc.pool.core.tenants import TenantSeen
from extproc.pool.core.values import (
    BucketStats,
    Decision,
    Entry,
    PoolStats,
    Ticket,
    Verdict,
)

__all__ = ["Admission"]


class Admission:
    def __init__(
        self, limits: dict[str, tuple[int, int]], max_queued_bytes: int | None = None
    ) -> None:
        """``limits``: bucket name -> (capacity, max_queue), each bucket its own slots;
        ``max_queued_bytes``: the bound on the bytes held by queued tickets across buckets
        (None: unbounded). Pools are added with ``set_pool`` and ``set_bucket``."""
        self._buckets: dict[str, BucketState] = {}
        self._pools: dict[str, PoolState] = {}
        self.max_queued_bytes = max_queued_bytes
        self.queued_bytes = 0
        self._where: dict[int, BucketState] = {}  # every live ticket (waiting or running)
        self._deadlines = Deadlines(self._waits)
        self._ids = itertools.count(1)
        self._admitted_by_expiry: list[Ticket] = []
        for name, (capacity, max_queue) in limits.items():
            self.set_limits(name, capacity, max_queue, now=0.0)

    # --- requests ----------------------------------------------------------------------------

    def enqueue(self, entry: Entry, now: float) -> Decision:
        """Admit, queue or refuse ``entry`` at ``now`` (the rules above)."""
        b = self._buckets[entry.bucket]
        pool = b.pool
        ticket = Ticket(
            id=next(self._ids),
            bucket=entry.bucket,
            enqueued_at=now,
            deadline=now + entry.timeout_s,
            held_bytes=entry.held_bytes,
            cost=entry.cost,
            client_deadline=entry.client_deadline,
            tenant=entry.tenant,
            weight=entry.weight,
            output=entry.output,
            own_deadline=entry.own_deadline,
            own_stated=entry.own_stated,
        )
        counts = b.tenants
        if counts is not None:
            refusal = b.tenant_refusal(ticket.tenant)
            if refusal is not None:
                return Decision(verdict=refusal, ticket=ticket)
            counts.joined(ticket.tenant)
        # Join the queue, then let the rules decide: admitted at once when they pick it now.
        self._where[ticket.id] = b
        b.waiting[ticket.id] = ticket
        b.order.push(ticket, entry.timeout_s)
        self.queued_bytes += ticket.held_bytes
        b.queued_bytes += ticket.held_bytes
        if pool.running < pool.limit:
            self._fill(pool, now)
            if ticket.id in b.running:
                return Decision(verdict=Verdict.ADMITTED, ticket=ticket)
        displaced: Ticket | None = None
        over_bytes = self.max_queued_bytes is not None and self.queued_bytes > self.max_queued_bytes
        if over_bytes or len(b.waiting) > b.max_queue:
            if not over_bytes and len(b.waiting) == b.max_queue + 1:
                displaced = b.displaced(ticket)  # rule 7: the room a lighter tenant finds
            if displaced is None:
                self._refuse(b, ticket)
                return Decision(verdict=Verdict.QUEUE_FULL, ticket=ticket)
        if pool.fail_fast:
            wait = b.predicted_wait_s(exclude=ticket)
            if wait is not None and wait > longest_wait(b, ticket, now):
                self._refuse(b, ticket)  # and the one it would have displaced stays
                return Decision(verdict=Verdict.WAIT_TOO_LONG, ticket=ticket, predicted_wait_s=wait)
        if displaced is not None:
            self._refuse(b, displaced)
        self._deadlines.push(ticket.deadline, ticket.id)
        return Decision(verdict=Verdict.QUEUED, ticket=ticket, displaced=displaced)

    def release(self, ticket_id: int, now: float) -> list[Ticket]:
        """Give back the slot of a running ticket; returns the tickets admitted in its place.
        A ticket that holds no slot (never admitted, already released) is ignored."""
        b = self._where.get(ticket_id)
        if b is None or ticket_id not in b.running:
            return []
        del self._where[ticket_id]
        pool = b.pool
        ticket, hold = b.released(ticket_id, now)
        pool.running -= 1
        pool.tokens -= ticket.cost
        pool.mean_hold_s = ewma(pool.mean_hold_s, hold)
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
        self._compact(b)
        # A waiter that left may have been the one the token bound held everyone behind.
        return self._fill(b.pool, now) if b.pool.max_tokens is not None else []

    def expire(self, now: float) -> list[Ticket]:
        """Evict every waiter whose deadline is at or before ``now``, earliest first, or
        relegate it (``extproc.pool.core.relegate``)."""
        evicted: list[Ticket] = []
        pools: set[PoolState] = set()
        left: set[BucketState] = set()
        for tid in self._deadlines.due(now):
            b = self._where[tid]
            left.add(b)
            ticket = b.waiting[tid]
            moved = relegate(ticket, b, self._buckets, now) if b.relegate else None
            if moved is not None:
                self._where[tid] = moved[0]
                self._deadlines.push(moved[1].deadline, tid)  # later than now: not due here
                pools.add(b.pool)  # its target may have room its bucket had not (rule 2)
                continue
            self._drop(b, ticket)
            if ticket.client_deadline:
                b.client_expired_total += 1
            else:
                b.evicted_total += 1
            evicted.append(ticket)
            if b.pool.max_tokens is not None:
                pools.add(b.pool)
        for pool in pools:  # see cancel: a blocked head may have left; and relegations
            self._admitted_by_expiry.extend(self._fill(pool, now))
        self._compact(*left)  # nothing may be admitted (limit 0) to compact for them
        return evicted

    def take_admitted(self) -> list[Ticket]:
        """Tickets admitted as a side effect of ``expire`` (a head the token bound held left,
        a relegated waiter)."""
        out, self._admitted_by_expiry = self._admitted_by_expiry, []
        return out

    def next_deadline(self) -> float | None:
        return self._deadlines.next()

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
        rule = BucketRule.own(bucket, capacity, max_queue)
        if b is None:
            b = self._buckets[bucket] = BucketState(bucket, PoolState(bucket, capacity), rule)
            b.pool.buckets.append(b)
            return []
        admitted = self._move(b, None, now) if b.shared else []
        b.pool.set_limit(capacity, None)
        b.configure(rule)
        return admitted + self._fill(b.pool, now)

    def set_pool(
        self,
        name: str,
        limit: int,
        now: float,
        *,
        max_tokens: int | None = None,
        fail_fast: bool = True,
        choice: BucketChoice | None = None,
        whole: int | None = None,
    ) -> list[Ticket]:
        """Create a shared pool or change it; returns waiters admitted by a raised limit
        (``limit`` 0: nobody is admitted, see ``set_pool_limit``). ``choice``: the rule
        across its buckets (``extproc.pool.core.order``; None: as it is, at first the default);
        ``whole``: the whole pool's limit when ``limit`` is a replica's part of it
        (``set_whole_limit``)."""
        if limit < 0 or (max_tokens is not None and max_tokens < 1):
            raise ValueError(f"pool {name!r}: limit must be >= 0 and max_tokens >= 1")
        pool = self._pools.get(name)
        if pool is None:
            pool = self._pools[name] = PoolState(name, limit)
        pool.set_limit(limit, whole)
        pool.max_tokens, pool.fail_fast = max_tokens, fail_fast
        pool.choice = choice or pool.choice
        return self._fill(pool, now)

    def set_pool_limit(self, name: str, limit: int, now: float) -> list[Ticket]:
        """The pool's limit only (the adaptive controller's knob, and the leases a replica of
        a shared pool holds, which may be none: 0 admits nobody)."""
        pool = self._pools[name]
        pool.set_limit(max(0, limit), pool.whole)
        return self._fill(pool, now)

    def set_whole_limit(self, name: str, whole: int | None) -> None:
        """The whole pool's limit, when the pool's own is a replica's part of a pool shared
        by several (None: its own limit is the whole): what the tenants' ``max_share`` is of
        (rule 6). Admits nobody: the bounds apply at entry."""
        pool = self._pools[name]
        pool.set_limit(pool.limit, whole)

    def set_cut(self, name: str, factor: float, now: float, *, band: bool = False) -> list[Ticket]:
        """The pool's least urgent band (when it has more than one) may hold at most ``factor``
        of its usual cap (never less than its guaranteed share); 1.0 lifts it. Two cuts, the
        lower binds: the overload monitor's, and with ``band`` the adaptive limit's band cut."""
        pool = self._pools[name]
        setattr(pool, "band_cut" if band else "cut", min(1.0, max(0.0, factor)))
        return self._fill(pool, now)

    def set_bucket(self, pool: str, rule: BucketRule, now: float) -> list[Ticket]:
        """Create the bucket ``rule.policy.name`` in the shared pool ``pool`` (``set_pool``
        first), or change it; a bucket that had slots of its own, or another pool, moves with
        its running and waiting requests."""
        bucket, p = rule.policy.name, rule.policy
        if p.max_queue < 0 or not 0 <= p.min_share <= rule.max_share <= 1 or rule.max_share <= 0:
            raise ValueError(f"bucket {bucket!r}: bad max_queue or shares")
        target = self._pools[pool]
        b = self._buckets.get(bucket)
        admitted: list[Ticket] = []
        if b is None:
            b = self._buckets[bucket] = BucketState(bucket, target, rule)
            b.shared = True
            target.buckets.append(b)
        elif b.pool is not target:
            admitted = self._move(b, target, now)
        b.configure(rule)
        target.buckets.sort(key=lambda x: x.priority)
        return admitted + self._fill(target, now)

    def remove(self, bucket: str) -> bool:
        """Forget a bucket that holds nothing; returns whether it did (a busy one drains)."""
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
        bands = {p.name: cut_band(p.buckets) for p in self._pools.values() if p.factor < 1.0}
        return {
            name: b.stats(bands.get(b.pool.name) if b.shared else None)
            for name, b in self._buckets.items()
        }

    def pool_statistics(self, now: float) -> dict[str, PoolStats]:
        return {name: p.stats() for name, p in self._pools.items()}

    def heaviest(self, bucket: str, k: int) -> list[tuple[str | None, float]]:
        """The bucket's ``k`` heaviest tenants (``FairOrder.heaviest``), for /debug/queues."""
        return [] if (fair := self._buckets[bucket].fair) is None else fair.heaviest(k)

    def tenants_seen(self) -> dict[str, TenantSeen]:
        """Of each bucket with a tenant policy, the requests that joined it and those of them
        with a key (``TenantCounts.seen``, for ``tenants.watch_header``)."""
        return {n: b.tenants.seen() for n, b in self._buckets.items() if b.tenants is not None}

    def recent_waits(self, bucket: str) -> list[float]:
        """Queue waits of the bucket's latest admissions (0 for the fast path), oldest first."""
        return list(self._buckets[bucket].waits)

    def ticket(self, ticket_id: int) -> Ticket | None:
        """A live ticket (waiting or running), or None."""
        b = self._where.get(ticket_id)
        if b is None:
            return None
        return b.waiting.get(ticket_id) or b.running[ticket_id][0]

    def queued(self, bucket: str) -> int:
        return len(self._buckets[bucket].waiting)

    def drain_estimate_s(self, bucket: str, default_hold_s: float, now: float = 0.0) -> float:
        """How long a request joining ``bucket`` now would wait (``BucketState``'s estimate)."""
        return self._buckets[bucket].drain_estimate_s(default_hold_s)

    def __repr__(self) -> str:
        return "<Admission " + ", ".join(repr(s) for s in self.statistics().values()) + ">"

    # --- internals ---------------------------------------------------------------------------

    def _fill(self, pool: PoolState, now: float) -> list[Ticket]:
        """Hand free slots to the waiters the rules pick, while there is room (rule 2)."""
        admitted: list[Ticket] = []
        band = cut_band(pool.buckets) if pool.factor < 1.0 else None
        pick = pool.choice.pick
        while pool.running < pool.limit:
            picked = pick(pool.buckets, pool.limit, band)
            if picked is None:
                break
            best, best_key, ticket = picked
            if (
                pool.max_tokens is not None
                and pool.running > 0
                and pool.tokens + ticket.cost > pool.max_tokens
            ):
                break  # the token bound holds it; nobody passes it
            self._admit(best, ticket, best_key, now)
            admitted.append(ticket)
        if admitted:
            self._compact(*pool.buckets)
        return admitted

    def _admit(self, b: BucketState, ticket: Ticket, key: float, now: float) -> None:
        del b.waiting[ticket.id]
        self._unqueue(b, ticket)  # its body goes upstream with the admission
        b.admitted(ticket, key, now)
        b.pool.running += 1
        b.pool.tokens += ticket.cost

    def _drop(self, b: BucketState, ticket: Ticket) -> None:
        """A waiter leaves the queue without a slot."""
        del b.waiting[ticket.id]
        self._unqueue(b, ticket)
        del self._where[ticket.id]
        b.left(ticket)

    def _unqueue(self, b: BucketState, ticket: Ticket) -> None:
        self.queued_bytes -= ticket.held_bytes
        b.queued_bytes -= ticket.held_bytes

    def _move(self, b: BucketState, target: PoolState | None, now: float) -> list[Ticket]:
        """Move a bucket to another pool (None: one of its own); fill the pool it left."""
        old = b.move(target)
        return self._fill(old, now) if old.buckets else []

    def _waits(self, ticket_id: int) -> bool:
        b = self._where.get(ticket_id)
        return b is not None and ticket_id in b.waiting

    def _refuse(self, b: BucketState, ticket: Ticket) -> None:
        """A waiter, the newcomer or the one it displaced, is refused at once: it leaves,
        counted in ``refused_total``, and its heap entries go with a compaction here, whether
        anyone is admitted or not."""
        self._drop(b, ticket)
        b.refused_total += 1
        self._compact(b)

    def _compact(self, *buckets: BucketState) -> None:
        """Drop the entries of tickets gone from the heaps, once they outnumber the live ones
        (each check O(1), each rebuild paid for by as many departures: O(1) amortised). After
        every way out of a queue (admitted, refused, evicted, cancelled): at limit 0 nobody is
        admitted, and the refusals alone would otherwise fill the heaps."""
        self._deadlines.compact(len(self._where))
        for b in buckets:
            b.compact()
