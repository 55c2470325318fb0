"""The admission core's value types: what goes in and what comes out
(``extproc.pool.core.admission``).

All frozen, slotted and keyword-only, so tests compare whole objects. ``PoolStats`` is also the
pool's snapshot for the gauges and /debug/queues (``extproc.pool.view``): its fields name them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from extproc.pool.view import HIDDEN, gauge

__all__ = ["BucketStats", "Carried", "Decision", "Entry", "PoolStats", "Ticket", "Verdict", "slots"]


class Verdict(StrEnum):
    ADMITTED = "admitted"
    QUEUED = "queued"
    QUEUE_FULL = "queue_full"
    WAIT_TOO_LONG = "wait_too_long"
    TENANT_QUEUE_FULL = "tenant_queue_full"
    TENANT_OVER_SHARE = "tenant_over_share"


@dataclass(frozen=True, slots=True, kw_only=True)
class Carried:
    """What a request carries into admission and its ticket keeps: written once here, for
    ``Entry`` and ``Ticket``."""

    bucket: str
    held_bytes: int = 0  # held while it waits (its body, to be forwarded once admitted)
    cost: int = 0  # estimated prompt tokens + effective max_tokens: what it costs the backend
    # Its deadline is its client's own, sooner than its queue timeout: when it passes, the
    # ticket expires (``client_expired_total``) rather than being evicted.
    client_deadline: bool = False
    # Who it is for (None: the bucket's one tenant), its weight in the fair order, and its
    # effective max_tokens (the fair order weighs output tokens more than prompt tokens).
    tenant: str | None = None
    weight: float = 1.0
    output: int = 0
    # The request's own deadline (its client's or its route's; None: none) and whether it is
    # the client's (stated): a relegation never waits past it (``extproc.pool.core.relegate``).
    own_deadline: float | None = None
    own_stated: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry(Carried):
    """What a request brings to admission (``Admission.enqueue``): its ``Ticket`` is made of it."""

    timeout_s: float  # how long it may wait: its deadline is its enqueue time + this


@dataclass(frozen=True, slots=True, kw_only=True)
class Ticket(Carried):
    """A request in admission: its ``Entry``'s facts, an id, when it joined and its deadline
    (``bucket``: where it waits or runs now)."""

    id: int
    enqueued_at: float
    deadline: float  # ``enqueued_at`` + its timeout
    # The bucket it was relegated from (None: it waits or runs in the bucket it joined).
    relegated_from: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    verdict: Verdict
    ticket: Ticket
    # WAIT_TOO_LONG: the predicted wait, seconds.
    predicted_wait_s: float = 0.0
    # QUEUED into a full bucket: the waiter refused (QUEUE_FULL) in its place (core rule 7).
    displaced: Ticket | None = None


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
    # Cumulative counts: admitted, evicted at the deadline, refused at once (full, too long),
    # and expired at a deadline of the client's own, sooner than the queue timeout (apart from
    # the evictions: the overload monitor does not count them).
    admitted_total: int = 0
    evicted_total: int = 0
    refused_total: int = 0
    client_expired_total: int = 0
    # Waiters moved at their deadline into the bucket this one relegates to (neither admitted
    # nor evicted here: they leave from there).
    relegated_total: int = 0
    # Tenants the bucket's order remembers (the fair order; 0 for the others).
    tenants: int = 0

    def __repr__(self) -> str:
        return f"{self.name} {self.in_flight}/{self.capacity} +{self.queued} queued"


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolStats:
    name: str = field(metadata=HIDDEN)
    limit: int = field(
        metadata=gauge("pool_limit", "The shared pool's limit: requests at the backend at once.")
    )
    in_flight: int = field(
        metadata=gauge("pool_in_flight", "Requests holding a slot of the shared pool.")
    )
    queued: int = field(
        metadata=gauge("pool_queued", "Requests waiting for a slot of the shared pool.")
    )
    max_tokens: int | None = field(
        metadata=gauge(
            "pool_tokens_limit",
            "The pool's bound on estimated tokens in flight (0: none).",
            if_none=0,
            key="max_tokens_in_flight",
        )
    )
    tokens_in_flight: int = field(
        metadata=gauge(
            "pool_tokens_in_flight", "Estimated prompt + max_tokens of the requests in flight."
        )
    )
    # Slots freed per second, recently; None until measured.
    release_rate: float | None = field(
        metadata=gauge(
            "pool_release_rate", "Slots the full pool frees per second: limit / mean hold."
        )
    )
    cut: float = field(metadata=HIDDEN)  # the overload factor (the monitor's snapshot shows it)
    band_cut: float = field(
        default=1.0,
        metadata=gauge(
            "pool_band_cut",
            "Share of its cap the least urgent band may hold by the adaptive limit's band cut "
            "(1: none).",
        ),
    )


def slots(share: float, limit: float) -> int:
    """The slots ``share`` of ``limit`` gives, rounded down past float error (0.29 x 100: 29)."""
    return math.floor(share * limit + 1e-9)
