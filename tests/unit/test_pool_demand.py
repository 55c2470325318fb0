"""The pool's band and demand questions, each answered by one function, table-driven on plain
values. Pure: no gate, no event loop."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from extproc.pool.core import demand
from extproc.pool.core.values import BucketStats, PoolStats


@dataclass(frozen=True)
class B:
    """A bucket as the band questions read it (what BucketStats and BucketState have)."""

    priority: int
    in_flight: int = 0
    queued: int = 0


@pytest.mark.parametrize(
    ("buckets", "least", "protected", "cut_band", "objectives"),
    [
        # One band: nothing protected, nothing cut, the objectives always apply.
        ([B(0, 5, 5)], 0, [], None, True),
        ([B(3), B(3, 2)], 3, [], None, True),
        # Two bands, the protected one idle: no cut (work-conserving), no objectives.
        ([B(0), B(10, 4, 9)], 10, [B(0)], None, False),
        # The protected band runs or waits: the cut applies to the least urgent; objectives too.
        ([B(0, 1), B(10, 4, 9)], 10, [B(0, 1)], 10, True),
        ([B(0, 0, 1), B(10)], 10, [B(0, 0, 1)], 10, True),
        # Three bands: every band but the least urgent is protected.
        ([B(0), B(5, 1), B(10)], 10, [B(0), B(5, 1)], 10, True),
        # Busy in the least urgent band alone does not count.
        ([B(0), B(5), B(10, 3, 3)], 10, [B(0), B(5)], None, False),
    ],
)
def test_bands(
    buckets: list[B], least: int, protected: list[B], cut_band: int | None, objectives: bool
) -> None:
    assert demand.least_urgent(buckets) == least
    assert demand.protected(buckets) == protected
    assert demand.cut_band(buckets) == cut_band
    assert demand.objectives_apply(buckets) is objectives


def test_no_buckets_no_cut_and_the_objectives_apply() -> None:
    assert demand.cut_band([]) is None
    assert demand.objectives_apply([]) is True


@dataclass(frozen=True)
class P:
    """A policy bucket as ``limit_demand`` reads it."""

    name: str
    priority: int
    max_concurrency: int = 0


def pool(limit: int, in_flight: int, queued: int, cut: float = 1.0) -> PoolStats:
    return PoolStats(
        name="pool",
        limit=limit,
        in_flight=in_flight,
        queued=queued,
        max_tokens=None,
        tokens_in_flight=0,
        release_rate=None,
        cut=cut,
    )


def stats(name: str, capacity: int, in_flight: int, queued: int, priority: int) -> BucketStats:
    return BucketStats(
        name=name,
        capacity=capacity,
        in_flight=in_flight,
        queued=queued,
        max_queue=100,
        mean_hold_s=None,
        pool="pool",
        priority=priority,
    )


POLICY = [P("chat", 0), P("batch", 10)]


@pytest.mark.parametrize(
    ("p", "batch", "policy", "want"),
    [
        # Full pool: every waiter counts.
        (pool(4, 4, 7), stats("batch", 2, 2, 7, 10), POLICY, (4, 7)),
        # Room, batch held at its share: its waiters count.
        (pool(4, 2, 3), stats("batch", 2, 2, 3, 10), POLICY, (2, 3)),
        # Room, batch below its cap (held by something else, e.g. the token bound): none.
        (pool(4, 1, 3), stats("batch", 2, 1, 3, 10), POLICY, (1, 0)),
        # Its absolute cap binds: a higher limit changes nothing.
        (pool(4, 2, 3), stats("batch", 2, 2, 3, 10), [P("chat", 0), P("batch", 10, 2)], (2, 0)),
        # A cut is set: the least urgent band's waiters are the staged recovery's.
        (pool(4, 2, 3, cut=0.5), stats("batch", 2, 2, 3, 10), POLICY, (2, 0)),
        # No policy buckets: nothing is held by a share.
        (pool(4, 2, 3), stats("batch", 2, 2, 3, 10), [], (2, 0)),
    ],
)
def test_limit_demand(
    p: PoolStats, batch: BucketStats, policy: list[P], want: tuple[int, int]
) -> None:
    st = {"chat": stats("chat", 4, 0, 0, 0), "batch": batch}
    assert demand.limit_demand(p, st, policy) == want


@pytest.mark.parametrize(
    ("held", "waiting", "limit", "want"),
    [(10, 4, 10, (10, 4)), (9, 4, 10, (9, 0)), (12, 1, 10, (12, 1))],
)
def test_shared_limit_demand_counts_waiters_while_the_whole_pool_is_full(
    held: int, waiting: int, limit: int, want: tuple[int, int]
) -> None:
    assert demand.shared_limit_demand(held, waiting, limit) == want


@pytest.mark.parametrize(
    ("p", "buckets", "caps", "want"),
    [
        (None, [], {}, (0, {})),
        # Nobody waits: no demand.
        (pool(2, 2, 0), [stats("batch", 5, 2, 0, 10)], {"batch": 5}, (2, {})),
        # Up to the room under each cap, summed per band.
        (
            pool(2, 2, 9),
            [stats("chat", 10, 0, 2, 0), stats("batch", 5, 2, 7, 10), stats("bulk", 3, 0, 1, 10)],
            {"chat": 10, "batch": 5, "bulk": 3},
            (2, {0: 2, 10: 4}),
        ),
        # At its cap: a lease would not let it in.
        (pool(8, 5, 2), [stats("batch", 5, 5, 2, 10)], {"batch": 5}, (5, {})),
        # The cut holds it below its cap: up to the cut.
        (pool(8, 2, 6), [stats("batch", 3, 2, 6, 10)], {"batch": 5}, (2, {10: 1})),
        # Another pool's bucket (a route share, a bucket of its own) is no demand.
        (
            pool(2, 0, 1),
            [
                BucketStats(
                    name="x", capacity=1, in_flight=0, queued=1, max_queue=1, mean_hold_s=None
                )
            ],
            {},
            (0, {}),
        ),
    ],
)
def test_lease_demand(
    p: PoolStats | None,
    buckets: list[BucketStats],
    caps: dict[str, int],
    want: tuple[int, dict[int, int]],
) -> None:
    assert demand.lease_demand(p, {b.name: b for b in buckets}, caps) == want
