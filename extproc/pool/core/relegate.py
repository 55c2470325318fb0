"""Selective relegation: a waiter that missed its bucket's deadline may still be served late.

A bucket of a shared pool may name another bucket of the same pool to relegate to
(``relegate_to`` in the policy: ``Relegation``). At its queue deadline a waiter of that bucket
is not evicted: it moves into the target's queue, once, and waits there until its new
deadline, the sooner of

- now + the target's queue timeout, and
- the request's own deadline (``Ticket.own_deadline``: its client's, or its route's), so that
  a relegated request never waits longer than its client will.

At that second deadline it is evicted as any waiter is (or expires, when the client's own
deadline was the sooner: ``client_deadline``). A relegated ticket is never relegated again.
The policy rejects a target that is more urgent than the bucket or relegates itself
(``extproc.config.policy.resolve``), so there are no chains or cycles.

The move keeps the waiter's place in time: its ``enqueued_at`` stays its arrival, and the
target's order keys it from there (``fifo``: the arrival; ``cost``: the arrival plus its
cost's delay, scaled by the target's queue timeout). A relegated request arrived before the
target's waiters that joined after it, so it goes ahead of them; it has waited longest.
Putting it at the back would make it wait the target's whole queue again, and in the pool's
retry band, whose waiters are retries of requests evicted earlier, it would wait behind
requests that arrived after it.

It is evicted at the first deadline as before, and counted as evicted there, when it cannot
move: it waited until its client's own deadline (``client_deadline``: the client is out of
time), it was relegated already, the target is gone or in another pool, the new deadline is
not later than now (the request's own deadline has passed), the target's queue is full
(``max_queue``), or the target's tenant bounds refuse its tenant. The bytes of its body stay
queued: the pool's ``queued_bytes`` does not change, only the buckets' shares of it.

A pool with ``fail_fast`` refuses a newcomer whose predicted wait is longer than the longest
it may wait, relegation included (``longest_wait``).

``relegate`` changes both buckets' side (their queues, orders, tenants, bytes and counts),
through ``Relegating``, what it reads and changes of a bucket
(``extproc.pool.core.state.BucketState`` is one: the state imports this module, not back); the core
(``extproc.pool.core.admission.Admission.expire``) moves the ticket's entry and its deadline,
and fills the pool afterwards, since the target may have room the source had not (rule 2).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

from extproc.config.policy import BucketPolicy, Policy
from extproc.pool.core.order import QueueOrder
from extproc.pool.core.tenants import TenantCounts
from extproc.pool.core.values import Ticket, Verdict

__all__ = ["Relegating", "Relegation", "longest_wait", "relegate", "relegation"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Relegation:
    """Where a bucket's waiters go at their deadline: the target and its queue timeout."""

    target: str
    timeout_s: float


def relegation(policy: Policy, bucket: BucketPolicy) -> Relegation | None:
    """The bucket's relegation in ``policy`` (None: it evicts at the deadline)."""
    if bucket.relegate_to is None:
        return None
    return Relegation(target=bucket.relegate_to, timeout_s=policy.relegation_s(bucket))


class Relegating(Protocol):
    """What relegation reads and changes of a bucket."""

    queued_bytes: int
    relegated_total: int

    @property
    def name(self) -> str: ...
    @property
    def pool(self) -> object: ...  # only compared: the same pool or not
    @property
    def relegate(self) -> Relegation | None: ...
    @property
    def max_queue(self) -> int: ...
    @property
    def waiting(self) -> MutableMapping[int, Ticket]: ...
    @property
    def order(self) -> QueueOrder: ...
    @property
    def tenants(self) -> TenantCounts | None: ...
    def tenant_refusal(self, tenant: str | None) -> Verdict | None: ...
    def left(self, ticket: Ticket) -> None: ...


_B = TypeVar("_B", bound=Relegating)


def longest_wait(source: Relegating, ticket: Ticket, now: float) -> float:
    """The longest ``ticket``, joining ``source`` now, may wait: to its deadline, and for a
    bucket that relegates to its relegation's (what ``fail_fast`` compares a predicted wait
    with: a wait past the first deadline can still succeed)."""
    end = ticket.deadline
    rule = source.relegate
    if rule is not None and not ticket.client_deadline:
        end += rule.timeout_s
        if ticket.own_deadline is not None:
            end = max(ticket.deadline, min(end, ticket.own_deadline))
    return end - now


def relegate(
    ticket: Ticket, source: _B, buckets: Mapping[str, _B], now: float
) -> tuple[_B, Ticket] | None:
    """Move ``ticket``, a waiter of ``source`` at its deadline, into the queue of the bucket
    ``source`` relegates to; returns that bucket and the ticket as it waits there, or None:
    it cannot move (the module docstring says when) and is evicted as before."""
    rule = source.relegate
    if rule is None or ticket.relegated_from is not None or ticket.client_deadline:
        return None
    target = buckets.get(rule.target)
    if target is None or target is source or target.pool is not source.pool:
        return None
    deadline, stated = now + rule.timeout_s, False
    own = ticket.own_deadline
    if own is not None and own < deadline:
        deadline, stated = own, ticket.own_stated
    if deadline <= now or len(target.waiting) >= target.max_queue:
        return None
    if target.tenant_refusal(ticket.tenant) is not None:
        return None
    counts = target.tenants
    moved = replace(
        ticket,
        bucket=target.name,
        deadline=deadline,
        client_deadline=stated,
        relegated_from=source.name,
    )
    del source.waiting[ticket.id]
    source.queued_bytes -= ticket.held_bytes
    source.left(ticket)
    source.relegated_total += 1
    if counts is not None:
        counts.joined(ticket.tenant)
    target.waiting[ticket.id] = moved
    target.order.push(moved, rule.timeout_s)
    target.queued_bytes += ticket.held_bytes
    return target, moved
