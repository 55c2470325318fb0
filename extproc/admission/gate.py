"""The asyncio shell around the admission core: futures for waiters and one eviction timer.

Who owns a slot
---------------
``Gate.enter`` returns a ``Slot`` (admitted now), a ``Waiter`` (queued), or raises ``Refused``
(queue full). ``await waiter.admitted()`` returns the ``Slot`` or raises ``Refused`` (evicted at
its deadline); ``await waiter.admitted_unless(gone)`` does the same, but leaves the queue and
returns None as soon as the future ``gone`` completes (the servicer passes its pending read of
the stream: a client who leaves is dropped at once). The caller owns a ``Slot`` and must
``release()`` it in a ``finally``; ``release`` is idempotent, so the slot goes back exactly once
whatever ends the stream.

Cancellation: if the task awaiting ``admitted()`` is cancelled (the client left), the ticket
leaves the queue at once. If the slot was handed over in the same instant, before the task could
resume, the slot is given straight back and the next waiter is woken (the
``fut.done() and not fut.cancelled()`` case of asyncio.locks).

Eviction is active: one ``loop.call_at`` timer is armed for the earliest deadline across all
buckets; when it fires, every waiter whose deadline has passed gets ``Refused`` at once, not
when it would have reached the head of its queue.

A pool shared by several replicas (``pool.shared``, ``extproc.shared``): ``attach_leases``
hands the pool to a lease manager, which sets its limit to the leases this replica holds
(``set_leases``, possibly 0). The gate then tells it when a slot is about to be freed
(``on_release``, before the slot is handed on, so that it may lower the limit and give the lease
to a more urgent replica instead) and when waiters or slots changed (``on_change``); it reads
``shared_view``. Shares stay local, with ``max_share`` (and ``max_concurrency``) taken of the
whole pool's limit: the core gets them as absolute caps, since its own limit is only the leases
held; ``min_share`` is of the leases held. ``fail_fast`` is off: a local release rate says
nothing about the pool's.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from extproc.admission.core import Admission, BucketStats, PoolStats, Ticket, Verdict
from extproc.config.policy import BucketPolicy, Order, Policy
from extproc.outcome import OUTCOMES, Outcome

__all__ = ["POOL", "Gate", "PoolLeases", "Refused", "Slot", "Waiter", "retry_after_s"]

# The name of the policy's shared pool (one per sidecar: the backend behind it).
POOL = "pool"


def retry_after_s(estimate_s: float, min_s: float, max_s: float, jitter: float, u: float) -> float:
    """Retry-After in seconds: the drain estimate times a random factor in [1, 1 + jitter]
    (``u`` uniform in [0, 1)), clamped to [min_s, max_s]."""
    return min(max_s, max(min_s, estimate_s * (1.0 + jitter * u)))


class PoolLeases(Protocol):
    """What a shared pool's lease manager hears from the gate (``extproc.shared``). Both are
    called synchronously and must not block."""

    def on_release(self) -> None:
        """A slot of the pool is about to be freed (it may call ``set_leases`` first)."""
        ...

    def on_change(self) -> None:
        """Waiters or slots of the pool changed."""
        ...


class Refused(Exception):
    """Queue full or evicted; carries what the 429 needs."""

    def __init__(
        self, outcome: Outcome, bucket: str, retry_after_s: float, queued: int, waited_s: float
    ) -> None:
        super().__init__(f"{outcome} in {bucket}")
        self.outcome = outcome
        self.code = OUTCOMES[outcome].code
        self.bucket = bucket
        self.retry_after_s = retry_after_s
        self.queued = queued
        self.waited_s = waited_s


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
        self._leases: PoolLeases | None = None
        self._held = 0  # shared: leases held, the local pool's limit
        self._share_limit = 0  # shared: the whole pool's limit, what max_share is of
        self._caps: dict[str, int] = {}  # shared: each bucket's cap from the pool's limit
        self._policy = policy
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
        shared = self._leases is not None and pool is not None
        if pool is not None:
            limit = pool.max_concurrency
            current = self._core.pool_statistics(now).get(POOL)
            if shared:
                limit = self._held
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
                    fail_fast=pool.fail_fast and not shared,
                )
            )
        for b in policy.buckets:
            self._queue_timeout[b.name] = b.queue_timeout_s
            if pool is None:
                self.set_limits(b.name, b.max_concurrency, b.max_queue)
                continue
            self._set_bucket(b, now, shared)
        if pool is None:
            self._core.remove_pool(POOL)
        self._changed()

    def _set_bucket(self, b: BucketPolicy, now: float, shared: bool) -> None:
        max_share, cap = b.max_share, b.max_concurrency or None
        if shared:
            # The core's limit is the leases held: give it the share of the whole pool as an
            # absolute cap instead.
            top = max(1, math.floor(b.max_share * self._share_limit + 1e-9))
            cap = min(top, cap) if cap else top
            max_share = 1.0
            self._caps[b.name] = cap
        self._hand_over(
            self._core.set_bucket(
                b.name,
                now,
                pool=POOL,
                max_queue=b.max_queue,
                priority=b.priority,
                min_share=b.min_share,
                max_share=max_share,
                cap=cap,
                cost_order=b.order is Order.COST,
            )
        )

    # --- a pool shared by several replicas (extproc.shared) ----------------------------------

    def attach_leases(self, leases: PoolLeases, pool_limit: int) -> None:
        """Shared mode: the pool admits only on leases, none held yet (running requests carry
        on; the manager claims leases for them)."""
        self._leases = leases
        self._held = 0
        self._share_limit = pool_limit
        self.reconfigure(self._policy)

    def detach_leases(self) -> None:
        """Back to a pool of this replica alone, at the policy's limit."""
        if self._leases is None:
            return
        self._leases = None
        self._caps.clear()
        pool = self._policy.pool
        if pool is not None:
            limit = pool.adaptive.initial if pool.adaptive is not None else pool.max_concurrency
            self._hand_over(self._core.set_pool_limit(POOL, limit, self._loop.time()))
        self.reconfigure(self._policy)

    def set_leases(self, held: int, pool_limit: int) -> None:
        """The lease manager's knob: admit at most ``held`` at once (a raised one admits at
        once); caps are of ``pool_limit``."""
        if self._leases is None or self._policy.pool is None:
            return
        now = self._loop.time()
        if pool_limit != self._share_limit:
            self._share_limit = pool_limit
            for b in self._policy.buckets:
                self._set_bucket(b, now, True)
        self._held = held
        self._hand_over(self._core.set_pool_limit(POOL, held, now))

    def shared_view(self) -> tuple[int, dict[int, int]]:
        """(requests holding a slot of the pool, {band: waiters that one more lease each
        would let in}): a waiter held back by its bucket's cap or the overload cut is no
        demand for a lease."""
        pool = self._core.pool_statistics(self._loop.time()).get(POOL)
        if pool is None:
            return 0, {}
        demand: dict[int, int] = {}
        if pool.queued:
            for s in self._core.statistics().values():
                if s.pool != POOL or not s.queued:
                    continue
                top = self._caps.get(s.name, s.capacity)
                if s.capacity < min(top, max(1, pool.limit)):
                    top = s.capacity  # the overload cut holds it lower
                room = min(s.queued, max(0, top - s.in_flight))
                if room:
                    demand[s.priority] = demand.get(s.priority, 0) + room
        return pool.in_flight, demand

    def _changed(self) -> None:
        if self._leases is not None:
            self._leases.on_change()

    def set_pool_limit(self, limit: int) -> None:
        """The shared pool's limit (the adaptive controller); a raised one admits at once."""
        self._hand_over(self._core.set_pool_limit(POOL, limit, self._loop.time()))

    def set_cut(self, factor: float) -> None:
        """Overload: bands below the most urgent hold at most ``factor`` of their cap."""
        self._hand_over(self._core.set_cut(POOL, factor, self._loop.time()))

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
            waiter_ticket = self._core.ticket(ticket_id)
            self._core.cancel(ticket_id, now)
            if not fut.done() and waiter_ticket is not None:
                fut.set_exception(self._shutting_down(waiter_ticket.bucket))

    async def drained(self) -> None:
        """Return once no request holds a slot."""
        while any(s.in_flight for s in self.statistics().values()):
            self._drained = asyncio.Event()
            await self._drained.wait()

    def _shutting_down(self, bucket: str) -> Refused:
        return Refused(Outcome.REJECTED_SHUTTING_DOWN, bucket, self._retry.min_s, 0, 0.0)

    def enter(
        self, bucket: str, timeout_s: float, held_bytes: int = 0, cost: int = 0
    ) -> Slot | Waiter:
        """A slot now, a place in the queue, or ``Refused`` (queue full, or the request's
        ``held_bytes`` would take the bytes held by queued requests past the policy's bound,
        or its predicted wait is longer than ``timeout_s``). ``cost``: estimated prompt +
        max_tokens, for the pool's token bound and ``cost`` order."""
        if self._closed:
            raise self._shutting_down(bucket)
        now = self._loop.time()
        decision = self._core.enqueue(bucket, now, timeout_s, held_bytes, cost)
        if decision.verdict is Verdict.ADMITTED:
            self._changed()
            return Slot(self, decision.ticket)
        if decision.verdict is Verdict.WAIT_TOO_LONG:
            raise Refused(
                Outcome.REJECTED_WAIT_TOO_LONG,
                bucket,
                self._retry_after(bucket),
                self._core.queued(bucket),
                decision.predicted_wait_s,
            )
        if decision.verdict is Verdict.QUEUE_FULL:
            raise Refused(
                Outcome.REJECTED_QUEUE_FULL,
                bucket,
                self._retry_after(bucket),
                self._core.queued(bucket),
                0.0,
            )
        fut: asyncio.Future[Slot] = self._loop.create_future()
        self._waiters[decision.ticket.id] = fut
        self._arm()
        self._changed()
        return Waiter(self, decision.ticket, fut)

    # --- views -------------------------------------------------------------------------------

    def statistics(self) -> dict[str, BucketStats]:
        return self._core.statistics()

    def pool_statistics(self) -> dict[str, PoolStats]:
        """The shared pool, when the policy has one (else empty)."""
        return self._core.pool_statistics(self._loop.time())

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
        # estimate at the queue timeout: every request now queued leaves within that time
        # (admitted or evicted), so the queue a client would join has turned over by then.
        # Without the cap, the estimate counts waiters that will be evicted rather than served,
        # and under sustained overload sends clients away past their own deadlines
        # (measured in docs/benchmarks.md).
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
        if self._leases is not None:
            self._leases.on_release()
        self._hand_over(self._core.release(ticket.id, self._loop.time()))
        if self._drained is not None:
            self._drained.set()  # drained() checks again
        self._changed()

    def _cancel(self, ticket: Ticket) -> None:
        self._hand_over(self._core.cancel(ticket.id, self._loop.time()))
        self._changed()

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
            fut = self._waiters.pop(ticket.id, None)
            if fut is not None and not fut.done():
                fut.set_exception(
                    Refused(
                        Outcome.EVICTED_TIMEOUT,
                        ticket.bucket,
                        self._retry_after(ticket.bucket),
                        self._core.queued(ticket.bucket),
                        now - ticket.enqueued_at,
                    )
                )
        self._hand_over(self._core.take_admitted())
        self._arm()
        self._changed()
