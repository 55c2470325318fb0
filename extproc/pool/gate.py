"""The asyncio shell around the admission core: futures for waiters and one eviction timer.

Who owns a slot
---------------
``Gate.enter(entry)`` (an ``Entry``) returns a ``Slot`` (admitted now), a ``Waiter`` (queued), or
raises ``Refused`` (queue full). ``await waiter.admitted()`` returns the ``Slot`` or raises
``Refused`` (evicted at its deadline); ``await waiter.admitted_unless(gone)`` does the same, but
leaves the queue and returns None as soon as the future ``gone`` completes (the servicer passes its
pending read of the stream: a client who leaves is dropped at once). The caller owns a ``Slot`` and
must ``release()`` it in a ``finally``; ``release`` is idempotent, so the slot goes back exactly
once whatever ends the stream.

Cancellation: if the task awaiting ``admitted()`` is cancelled (the client left), the ticket
leaves the queue at once. If the slot was handed over in the same instant, before the task could
resume, the slot is given straight back and the next waiter is woken (the
``fut.done() and not fut.cancelled()`` case of asyncio.locks).

Eviction is active: one ``loop.call_at`` timer is armed for the earliest deadline across all
buckets; when it fires, every waiter whose deadline has passed gets ``Refused`` at once, not
when it would have reached the head of its queue.

The pool's limit: the policy's (``max_concurrency``, or where the adaptive limit starts and what
it found since: ``set_pool_limit``), unless a ``LimitOwner`` holds it (``own_limit``: the
leases of a pool shared by several replicas, ``extproc.pool.shared.adapter``). An owner sets the
limit itself (``set_pool_limit``), gives each bucket's ``max_share`` and cap (``refresh_caps``
when they change), hears of every release before the slot is handed on (``before_release``: it
may lower the limit first, so the slot is not reused here) and of every change of waiters or
slots (``changed``). With an owner, predicted waits are off (``fail_fast``): the local release
rate is of a limit the gate does not set. A tenant's ``max_share`` is of the whole pool's limit
(``whole_limit``), not of the part this replica holds.

A waiter may be refused after it queued, without waiting for its deadline: when a lighter
tenant's request takes its place in a full fair bucket (``Decision.displaced``), its
``admitted()`` raises ``Refused`` (``rejected_queue_full``) at once.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from extproc.config.policy import BucketPolicy, Policy
from extproc.outcome import Outcome
from extproc.pool.core.admission import Admission
from extproc.pool.core.relegate import relegation
from extproc.pool.core.state import BucketRule
from extproc.pool.core.tenants import TenantSeen
from extproc.pool.core.values import BucketStats, Entry, PoolStats, Ticket, Verdict
from extproc.pool.ends import Ends
from extproc.pool.refused import EXPIRED, REFUSED, Refused, retry_after_s

__all__ = ["POOL", "Gate", "LimitOwner", "Refused", "Slot", "Waiter", "retry_after_s"]

# The name of the policy's shared pool (one per sidecar: the backend behind it).
POOL = "pool"


class LimitOwner(Protocol):
    """Who holds the pool's limit instead of the policy (``Gate.own_limit``). Called
    synchronously; must not block."""

    def pool_limit(self) -> int:
        """The limit to configure the pool with (a reload, or when it takes the limit)."""
        ...

    def bucket_share(self, bucket: BucketPolicy) -> tuple[float, int | None]:
        """The bucket's (``max_share``, absolute cap or None) for the core."""
        ...

    def whole_limit(self) -> int:
        """The whole pool's limit, all replicas together: what a tenant's ``max_share`` is
        of (``Admission.set_whole_limit``)."""
        ...

    def before_release(self) -> None:
        """A slot of the pool is about to be freed (it may ``set_pool_limit`` first)."""
        ...

    def changed(self) -> None:
        """Waiters or slots of the pool changed."""
        ...


class Slot:
    """One held slot. ``release()`` gives it back once; later calls do nothing."""

    __slots__ = ("_gate", "_released", "ticket")

    def __init__(self, gate: Gate, ticket: Ticket) -> None:
        self._gate = gate
        self.ticket = ticket
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._gate._release(self.ticket)


@dataclass(slots=True)
class Waiter:
    gate: Gate
    ticket: Ticket
    future: asyncio.Future[Slot]

    async def admitted(self) -> Slot:
        try:
            return await self.future
        except asyncio.CancelledError:
            fut = self.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                fut.result().release()  # handed a slot just as we were cancelled
            else:
                self.gate._cancel(self.ticket)
            raise
        finally:
            self.gate._waiters.pop(self.ticket.id, None)

    async def admitted_unless(self, gone: asyncio.Future[Any]) -> Slot | None:
        """``admitted()``, but leave the queue at once if ``gone`` completes first (the
        stream ended while queued): then None. Raises ``Refused`` when evicted."""
        task = asyncio.current_task()
        assert task is not None
        left = False

        def on_gone(_: asyncio.Future[Any]) -> None:
            nonlocal left
            left = True
            task.cancel()  # admitted() takes the ticket out of the queue

        gone.add_done_callback(on_gone)
        try:
            return await self.admitted()
        except asyncio.CancelledError:
            if not left:
                raise
            task.uncancel()
            return None
        finally:
            gone.remove_done_callback(on_gone)

    def cancel(self) -> None:
        """Leave the queue without awaiting (the stream ended before we awaited)."""
        fut = self.future
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            fut.result().release()
        else:
            fut.cancel()
            self.gate._cancel(self.ticket)
        self.gate._waiters.pop(self.ticket.id, None)


class Gate:
    def __init__(
        self,
        policy: Policy,
        loop: asyncio.AbstractEventLoop | None = None,
        rand: Callable[[], float] = random.random,
        *,
        buckets: bool = True,
    ) -> None:
        """A gate for the policy's buckets; with ``buckets=False``, one that takes the policy's
        Retry-After and queued-bytes settings only and gets its buckets from ``set_limits``
        (the route shares)."""
        self._loop = loop or asyncio.get_running_loop()
        self._rand = rand
        self._core = Admission({})
        self._waiters: dict[int, asyncio.Future[Slot]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._queue_timeout: dict[str, float] = {}
        self._closed = False
        self._drained: asyncio.Event | None = None  # set up by drained(), while shutting down
        self._policy_buckets = buckets
        self._owner: LimitOwner | None = None
        self._policy = policy
        self.ends = Ends()  # how admitted requests ended lately (extproc.pool.ends)
        self.reconfigure(policy)

    # --- configuration -----------------------------------------------------------------------

    def reconfigure(self, policy: Policy) -> None:
        """Apply a (re)loaded policy. Raised capacity admits waiters at once; lowered capacity
        lets running requests finish. Buckets no longer in the policy keep draining."""
        self._retry = policy.retry_after
        self._core.max_queued_bytes = policy.limits.max_queued_bytes
        self._policy = policy
        if not self._policy_buckets:
            return
        now = self._loop.time()
        pool = policy.pool
        owner = self._owner
        if pool is not None:
            limit = pool.max_concurrency
            current = self._core.pool_statistics(now).get(POOL)
            if owner is not None:
                limit = owner.pool_limit()
            elif pool.adaptive is not None:
                # Start at the initial limit (max_concurrency is the stale-metrics fallback);
                # a reload keeps what the controller found, within the new bounds.
                found = pool.adaptive.initial if current is None else current.limit
                limit = min(pool.adaptive.max_limit, max(pool.adaptive.min_limit, found))
            self._hand_over(
                self._core.set_pool(
                    POOL,
                    limit,
                    now,
                    max_tokens=pool.max_tokens_in_flight,
                    fail_fast=pool.fail_fast and owner is None,
                    whole=owner.whole_limit() if owner is not None else None,
                )
            )
        for b in policy.buckets:
            self._queue_timeout[b.name] = b.queue_timeout_s
            if pool is None:
                self.set_limits(b.name, b.max_concurrency, b.max_queue)
                continue
            self._set_bucket(b, now)
        if pool is None:
            self._core.remove_pool(POOL)
        self._changed()

    def _set_bucket(self, b: BucketPolicy, now: float) -> None:
        if self._owner is not None:
            max_share, cap = self._owner.bucket_share(b)
        else:
            max_share, cap = b.max_share, b.max_concurrency or None
        rule = BucketRule(
            policy=b, max_share=max_share, cap=cap, relegate=relegation(self._policy, b)
        )
        self._hand_over(self._core.set_bucket(POOL, rule, now))

    # --- who holds the pool's limit -----------------------------------------------------------

    @property
    def policy(self) -> Policy:
        return self._policy

    def own_limit(self, owner: LimitOwner) -> None:
        """Hand the pool's limit and caps to ``owner`` (running requests carry on)."""
        self._owner = owner
        self.reconfigure(self._policy)

    def refresh_caps(self) -> None:
        """Ask the owner for every bucket's share and cap again (a limit they are of moved)."""
        if self._policy.pool is None:
            return
        now = self._loop.time()
        if self._owner is not None:
            self._core.set_whole_limit(POOL, self._owner.whole_limit())
        for b in self._policy.buckets:
            self._set_bucket(b, now)

    def _changed(self) -> None:
        if self._owner is not None:
            self._owner.changed()

    def set_pool_limit(self, limit: int) -> None:
        """The shared pool's limit (the adaptive controller); a raised one admits at once."""
        self._hand_over(self._core.set_pool_limit(POOL, limit, self._loop.time()))

    def set_cut(self, factor: float, *, band: bool = False) -> None:
        """The least urgent band holds at most ``factor`` of its cap: the overload cut, or
        with ``band`` the adaptive limit's band cut (the lower binds)."""
        self._hand_over(self._core.set_cut(POOL, factor, self._loop.time(), band=band))

    def set_limits(
        self, bucket: str, capacity: int, max_queue: int, queue_timeout_s: float = 1.0
    ) -> None:
        """Create a bucket or change its limits (raised capacity admits waiters at once)."""
        self._queue_timeout.setdefault(bucket, queue_timeout_s)
        self._hand_over(self._core.set_limits(bucket, capacity, max_queue, self._loop.time()))

    def remove(self, bucket: str) -> bool:
        """Forget a bucket that holds nothing; a busy one stays (returns False)."""
        if not self._core.remove(bucket):
            return False
        self._queue_timeout.pop(bucket, None)
        return True

    # --- entering ----------------------------------------------------------------------------

    def close(self) -> None:
        """Shutting down: refuse everyone waiting and every newcomer (503 + Retry-After);
        requests holding a slot run to the end."""
        self._closed = True
        now = self._loop.time()
        for ticket_id, fut in list(self._waiters.items()):
            ticket = self._core.ticket(ticket_id)
            if not fut.done() and ticket is not None:  # done: handed a slot, it runs on too
                self._core.cancel(ticket_id, now)
                fut.set_exception(self._shutting_down(ticket.bucket))

    async def drained(self) -> None:
        """Return once no request holds a slot."""
        while any(s.in_flight for s in self.statistics().values()):
            self._drained = asyncio.Event()
            await self._drained.wait()

    def _shutting_down(self, bucket: str) -> Refused:
        return Refused(Outcome.REJECTED_SHUTTING_DOWN, bucket, self._retry.min_s, 0, 0.0)

    def enter(self, entry: Entry) -> Slot | Waiter:
        """A slot now, a place in the queue, or ``Refused`` (queue full, the queued bytes past the
        policy's bound, a predicted wait over its timeout, or the tenant over its bounds)."""
        if self._closed:
            raise self._shutting_down(entry.bucket)
        now = self._loop.time()
        decision = self._core.enqueue(entry, now)
        if decision.verdict is Verdict.ADMITTED:
            self._changed()
            return Slot(self, decision.ticket)
        if decision.verdict is not Verdict.QUEUED:  # refused at once
            raise Refused(
                REFUSED[decision.verdict],
                entry.bucket,
                self._retry_after(entry.bucket),
                self._core.queued(entry.bucket),
                decision.predicted_wait_s,
            )
        fut: asyncio.Future[Slot] = self._loop.create_future()
        self._waiters[decision.ticket.id] = fut
        if decision.displaced is not None:  # it took that waiter's place: refused at once
            self._refuse_displaced(decision.displaced, now)
        self._arm()
        self._changed()
        return Waiter(self, decision.ticket, fut)

    # --- views -------------------------------------------------------------------------------

    def statistics(self) -> dict[str, BucketStats]:
        return self._core.statistics()

    def pool_statistics(self) -> dict[str, PoolStats]:
        """The shared pool, when the policy has one (else empty)."""
        return self._core.pool_statistics(self._loop.time())

    def heaviest(self, bucket: str, k: int = 5) -> list[tuple[str | None, float]]:
        return self._core.heaviest(bucket, k)

    def tenants_seen(self) -> dict[str, TenantSeen]:
        """Requests that joined each bucket with a tenant policy, and those with a key."""
        return self._core.tenants_seen()

    def recent_waits(self, bucket: str) -> list[float]:
        return self._core.recent_waits(bucket)

    @property
    def queued_bytes(self) -> int:
        """Bytes of request bodies held by queued requests, all buckets together."""
        return self._core.queued_bytes

    def __repr__(self) -> str:
        return repr(self._core)

    # --- internals ---------------------------------------------------------------------------

    def _retry_after(self, bucket: str) -> float:
        ra = self._retry
        timeout = self._queue_timeout[bucket]
        # Before any slot was released, assume a slot is held for the queue timeout. Cap the
        # estimate at the queue timeout: every request now queued leaves within that time (admitted
        # or evicted), so the queue a client would join has turned over by then. Without the cap,
        # the estimate counts waiters that will be evicted rather than served, and under sustained
        # overload sends clients away past their own deadlines (measured in docs/benchmarks.md).
        estimate = min(self._core.drain_estimate_s(bucket, timeout, self._loop.time()), timeout)
        return retry_after_s(estimate, ra.min_s, ra.max_s, ra.jitter, self._rand())

    def _hand_over(self, tickets: list[Ticket]) -> None:
        now = self._loop.time()
        for ticket in tickets:
            fut = self._waiters.get(ticket.id)
            if fut is None or fut.done():
                # Its task was cancelled in this same instant: pass the slot on.
                self._hand_over(self._core.release(ticket.id, now))
            else:
                fut.set_result(Slot(self, ticket))

    def _release(self, ticket: Ticket) -> None:
        if self._owner is not None:
            self._owner.before_release()
        self._hand_over(self._core.release(ticket.id, self._loop.time()))
        if self._drained is not None:
            self._drained.set()  # drained() checks again
        self._changed()

    def _cancel(self, ticket: Ticket) -> None:
        self._hand_over(self._core.cancel(ticket.id, self._loop.time()))
        self._changed()

    def _refuse_displaced(self, ticket: Ticket, now: float) -> None:
        self._fail(ticket, REFUSED[Verdict.QUEUE_FULL], now)

    def _fail(self, ticket: Ticket, outcome: Outcome, now: float) -> None:
        """The waiter of ``ticket``, if still waiting, gets ``Refused`` with ``outcome``."""
        fut = self._waiters.pop(ticket.id, None)
        if fut is not None and not fut.done():
            fut.set_exception(
                Refused(
                    outcome,
                    ticket.bucket,
                    self._retry_after(ticket.bucket),
                    self._core.queued(ticket.bucket),
                    now - ticket.enqueued_at,
                    ticket.relegated_from,
                )
            )

    def _arm(self) -> None:
        deadline = self._core.next_deadline()
        if deadline == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = deadline
        if deadline is not None:
            self._timer = self._loop.call_at(deadline, self._on_timer, deadline)

    def _on_timer(self, scheduled: float) -> None:
        self._timer = None
        self._timer_at = None
        # asyncio may run a timer up to one clock tick early; never evict before the deadline
        # and never spin on an early wake-up.
        now = max(self._loop.time(), scheduled)
        for ticket in self._core.expire(now):
            self._fail(ticket, EXPIRED[ticket.client_deadline], now)
        self._hand_over(self._core.take_admitted())
        self._arm()
        self._changed()
