"""The pool's questions about bands and demand, each answered once, side by side.

Bands: the buckets of a pool are ordered by ``priority`` (lower: more urgent). The least urgent
band is the one the overload cut holds back; every band more urgent than it is the protected
traffic, whose evictions the overload monitor watches and whose latency objectives bound the
adaptive limit. One band: nothing is protected, nothing is cut.

Demand: waiters that a higher limit would let in. The adaptive limit (a limit that scales the
shares with it) and the leases of a shared pool (which raise the local limit while the shares
stay of the whole pool) ask it differently, so each has its own function below, with why.

Who asks what:

- ``cut_band``: the admission core, at every hand-over while a cut is in force, and for the
  capacity it reports. It passes every bucket of the pool, those a reload dropped from the
  policy included: they still hold slots until they drain.
- ``protected``, ``objectives_apply``, ``limit_demand``: the pool's controller
  (``extproc.pool.control.recovery``), from the policy's buckets: the overload monitor reads their
  deadlines, which live in the policy. (The gate holds every policy bucket, so the two sets
  differ only by buckets still draining after a reload.)
- ``lease_demand``: the lease adapter (``extproc.pool.shared.adapter``), for the lease manager.
- ``shared_limit_demand``: the controller of a shared adaptive pool's leader.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, TypeVar

from extproc.pool.core.values import BucketStats, PoolStats

__all__ = [
    "Banded",
    "Loaded",
    "cut_band",
    "lease_demand",
    "least_urgent",
    "limit_demand",
    "objectives_apply",
    "protected",
    "shared_limit_demand",
]


class Banded(Protocol):
    @property
    def priority(self) -> int: ...


class Loaded(Banded, Protocol):
    @property
    def in_flight(self) -> int: ...

    @property
    def queued(self) -> int: ...


B = TypeVar("B", bound=Banded)


# --- bands -----------------------------------------------------------------------------------


def least_urgent(buckets: Iterable[Banded]) -> int:
    """The least urgent band: the largest ``priority`` among the buckets (there is one)."""
    return max(b.priority for b in buckets)


def protected(buckets: Sequence[B]) -> list[B]:
    """The protected traffic: the buckets of every band more urgent than the least urgent.
    Empty when all share one band."""
    least = least_urgent(buckets)
    return [b for b in buckets if b.priority < least]


def _protected_busy(buckets: Sequence[Loaded]) -> bool:
    least = least_urgent(buckets)
    return any(b.in_flight or b.queued for b in buckets if b.priority < least)


def cut_band(buckets: Sequence[Loaded]) -> int | None:
    """The band the overload cut applies to now: the least urgent, while a protected bucket has
    requests running or waiting; else None. With the protected traffic idle the cut would
    only leave the pool idle, so the least urgent band may use it all (work-conserving)."""
    if not buckets or not _protected_busy(buckets):
        return None
    return least_urgent(buckets)


def objectives_apply(buckets: Sequence[Loaded]) -> bool:
    """Whether the latency objectives bound the adaptive limit now: while a protected bucket
    has requests running or waiting, or when all share one band. vLLM's latency histograms
    carry no class, so the least urgent band alone (batch, long prompts) would read as a
    breach of an objective set for the urgent bands, and hold the limit far below what the
    backend can run."""
    return not buckets or not protected(buckets) or _protected_busy(buckets)


# --- demand ----------------------------------------------------------------------------------


def limit_demand(
    pool: PoolStats, stats: Mapping[str, BucketStats], buckets: Iterable[_PolicyBucket]
) -> tuple[int, int]:
    """(in flight, waiting) for the adaptive limit of a pool of this replica alone.

    While the pool is full every waiter counts. Otherwise a waiter counts while its bucket is
    held at its share of the limit (``max_share``), which grows with the limit. Waiters held
    back by their bucket's absolute cap (``max_concurrency``), by the overload cut or the band
    cut (any waiter of the least urgent band while a cut is set, down to a guaranteed share
    that may be 0: the staged recovery or the band cut's lending lets them in, not the limit)
    or by the token bound would not use a higher limit, so they do not raise it."""
    if pool.in_flight >= pool.limit:
        return (pool.in_flight, pool.queued)
    buckets = list(buckets)
    if not buckets:
        return (pool.in_flight, 0)
    least = least_urgent(buckets)
    held_by_share = 0
    for b in buckets:
        st = stats.get(b.name)
        if st is None or st.queued == 0 or st.in_flight < st.capacity:
            continue
        if b.max_concurrency and st.capacity >= b.max_concurrency:
            continue  # its absolute cap binds: a higher limit changes nothing
        if min(pool.cut, pool.band_cut) < 1.0 and b.priority == least:
            continue  # held by a cut: the staged recovery or the band cut lets them in
        held_by_share += st.queued
    return (pool.in_flight, held_by_share)


def shared_limit_demand(held: int, waiting: int, limit: int) -> tuple[int, int]:
    """(in flight, waiting) for the adaptive limit of a pool shared by several replicas, from
    the leases held and the waiters (that a lease would let in) of every replica: the waiters
    count while the whole pool is full. The leader sees only these totals, not the other
    replicas' shares, so it cannot tell a share-held waiter from a cut or capped one."""
    return (held, waiting if held >= limit else 0)


def lease_demand(
    pool: PoolStats | None, stats: Mapping[str, BucketStats], caps: Mapping[str, int]
) -> tuple[int, dict[int, int]]:
    """(requests holding a slot of the pool, {band: waiters that one more lease each would let
    in}) for the lease manager of a shared pool.

    The local limit is the leases held and each bucket's cap (``caps``: ``max_share`` and
    ``max_concurrency`` of the whole pool's limit) does not grow with it, so a waiter counts
    while its bucket is below that cap, up to the room left under it. A bucket the overload
    cut holds below its cap counts up to the cut instead. Unlike ``limit_demand``, a bucket
    below its cap counts while the local pool has room: the pool's room is the leases, which
    is what is asked for."""
    if pool is None:
        return 0, {}
    demand: dict[int, int] = {}
    if pool.queued:
        for s in stats.values():
            if s.pool != pool.name or not s.queued:
                continue
            top = caps.get(s.name, s.capacity)
            if s.capacity < min(top, max(1, pool.limit)):
                top = s.capacity  # the overload cut holds it lower
            room = min(s.queued, max(0, top - s.in_flight))
            if room:
                demand[s.priority] = demand.get(s.priority, 0) + room
    return pool.in_flight, demand


class _PolicyBucket(Banded, Protocol):
    """What ``limit_demand`` reads of a policy bucket (``BucketPolicy``)."""

    @property
    def name(self) -> str: ...

    @property
    def max_concurrency(self) -> int: ...
