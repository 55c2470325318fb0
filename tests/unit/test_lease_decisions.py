"""Tier 1: the shared pool's lease decisions (``extproc.pool.shared.decide``), from plain snapshots.
No Redis, no event loop, no sleeps: each table row is one replica at one moment and what it
does next."""

from __future__ import annotations

import math
from typing import Any

import pytest

from extproc.pool.shared import decide
from extproc.pool.shared.decide import (
    POLL_S,
    Acquire,
    GiveBack,
    Grace,
    Mode,
    Phase,
    PublishDemand,
    Renewal,
    View,
)


def view(**kw: Any) -> View:
    base: dict[str, Any] = {
        "me": "b",
        "mode": Mode.SHARED,
        "limit": 10,
        "count": 0,
        "replicas": ("a", "b", "c"),
        "connected": True,
        "expected_replicas": 1,
        "valid_until": 103.0,
        "others": {},
        "published": {},
        "last_acquire": 99.9,
    }
    return View(**{**base, **kw})


_MOMENT = ("now", "held", "running", "demand")


def moment(kw: dict[str, Any]) -> tuple[View, dict[str, Any]]:
    """A table row: the view's fields and the moment's numbers, mixed."""
    at: dict[str, Any] = {"now": 100.0, "held": 0, "running": 0, "demand": {}}
    at.update({k: v for k, v in kw.items() if k in _MOMENT})
    return view(**{k: v for k, v in kw.items() if k not in _MOMENT}), at


# --- demand tables ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("demand", "n", "left"),
    [
        ({0: 2, 10: 3}, 0, {0: 2, 10: 3}),
        ({0: 2, 10: 3}, 1, {0: 1, 10: 3}),  # the most urgent band first
        ({10: 3, 0: 2}, 3, {10: 2}),
        ({0: 2, 10: 3}, 9, {}),
        ({}, 2, {}),
    ],
)
def test_spares_serve_the_most_urgent_waiters_first(
    demand: dict[int, int], n: int, left: dict[int, int]
) -> None:
    assert decide.minus(demand, n) == left


def test_the_others_demand_merges_per_band() -> None:
    assert decide.merge({"a": {0: 1, 5: 2}, "c": {5: 3}}) == {0: 1, 5: 5}
    assert decide.merge({}) == {}


# --- who gets a lease --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mine", "theirs", "u", "back"),
    [
        ({0: 3}, {}, 0.0, False),  # nobody elsewhere: keep
        ({}, {5: 1}, 0.9, True),  # nobody here: back
        ({10: 3}, {0: 1}, 0.9, True),  # more urgent elsewhere: back
        ({0: 1}, {10: 5}, 0.0, False),  # more urgent here: keep
        ({5: 1}, {5: 3}, 0.74, True),  # same band, theirs 3 of 4 waiters: back for u < 0.75
        ({5: 1}, {5: 3}, 0.75, False),
        ({5: 1}, {5: 3}, 0.7, True),
        ({5: 1}, {5: 3}, 0.8, False),
        ({5: 0, 7: 2}, {5: 0, 7: 2}, 0.49, True),  # empty bands count for nothing
        ({5: 0, 7: 2}, {5: 0, 7: 2}, 0.5, False),
    ],
)
def test_who_gets_a_freed_lease(
    mine: dict[int, int], theirs: dict[int, int], u: float, back: bool
) -> None:
    assert decide.return_decision(mine, theirs, u) is back


@pytest.mark.parametrize(
    ("others", "u", "to"),
    [
        ({}, 0.5, None),
        ({"a": {5: 0}}, 0.5, None),
        ({"a": {5: 1}}, 0.99, "a"),
        ({"a": {10: 9}, "c": {0: 1}}, 0.1, "c"),  # the most urgent band, not the most waiters
        # In proportion to the waiters of that band, replicas in id order: a 1, c 3.
        ({"c": {0: 3}, "a": {0: 1, 10: 50}}, 0.0, "a"),
        ({"c": {0: 3}, "a": {0: 1, 10: 50}}, 0.24, "a"),
        ({"c": {0: 3}, "a": {0: 1, 10: 50}}, 0.25, "c"),
        ({"c": {0: 3}, "a": {0: 1, 10: 50}}, 0.999, "c"),
    ],
)
def test_recipient_is_drawn_from_the_most_urgent_band(
    others: dict[str, dict[int, int]], u: float, to: str | None
) -> None:
    assert decide.recipient(others, u) == to


_WAITING_ELSEWHERE = {"a": {0: 2}}


@pytest.mark.parametrize(
    ("kw", "u_back", "action"),
    [
        # Not shared, nothing held, or a spare held: nothing to decide.
        ({"mode": Mode.DEGRADED, "held": 2, "running": 2}, 0.0, None),
        ({"held": 0, "running": 1}, 0.0, None),
        ({"held": 3, "running": 2, "others": _WAITING_ELSEWHERE}, 0.0, None),
        # More run here than the leases held (a rejoin): the request that ends held none;
        # handing a lease on, even to a more urgent replica or with the pool above its limit,
        # would keep the over-admission from draining.
        ({"held": 3, "running": 5, "demand": {5: 1}, "others": _WAITING_ELSEWHERE}, 0.0, None),
        ({"held": 3, "running": 4, "count": 11}, 0.0, None),
        # The pool above its limit: back for anyone, whoever waits.
        ({"held": 2, "running": 2, "count": 11, "demand": {0: 5}}, 0.9, GiveBack(n=1, to=None)),
        # Someone more urgent elsewhere: back for them.
        (
            {"held": 2, "running": 2, "demand": {5: 1}, "others": _WAITING_ELSEWHERE},
            0.9,
            GiveBack(n=1, to="a"),
        ),
        # Nobody elsewhere: kept for a local waiter, or as a spare.
        ({"held": 2, "running": 2, "demand": {5: 1}}, 0.0, None),
        ({"held": 2, "running": 2}, 0.0, None),
        # The same band: back with the probability of their part of it (2 of 3).
        ({"held": 1, "running": 1, "demand": {0: 1}, "others": _WAITING_ELSEWHERE}, 0.67, None),
        (
            {"held": 1, "running": 1, "demand": {0: 1}, "others": _WAITING_ELSEWHERE},
            0.66,
            GiveBack(n=1, to="a"),
        ),
    ],
)
def test_on_release(kw: dict[str, Any], u_back: float, action: GiveBack | None) -> None:
    v, at = moment(kw)
    del at["now"]
    assert decide.on_release(v, **at, u_back=u_back, u_whom=0.5) == action


# --- the step for the demand -------------------------------------------------------------------

_POLLED = {"last_acquire": 100.0}  # acquired just now: no poll due
_HEARD = {"published": {0: 3}}  # the pool knows of our 3 waiters


@pytest.mark.parametrize(
    ("kw", "force", "action"),
    [
        # Not shared: nothing.
        ({"mode": Mode.DEGRADED, "demand": {0: 3}}, True, None),
        # Waiters the pool has not heard of: ask at once.
        ({"demand": {0: 3}, **_POLLED}, False, Acquire(ask={0: 3})),
        ({"demand": {0: 3}, "published": {0: 2}, **_POLLED}, False, Acquire(ask={0: 3})),
        # Heard of: wait for a freed message or the poll.
        ({"demand": {0: 3}, **_HEARD, **_POLLED}, False, None),
        ({"demand": {0: 3}, **_HEARD, **_POLLED}, True, Acquire(ask={0: 3})),
        ({"demand": {0: 3}, **_HEARD, "last_acquire": 100.0 - POLL_S}, False, Acquire(ask={0: 3})),
        # Spares serve the most urgent waiters; the ask is the rest.
        (
            {"held": 3, "running": 1, "demand": {0: 1, 10: 4}, **_POLLED},
            False,
            Acquire(ask={10: 3}),
        ),
        ({"held": 3, "running": 1, "demand": {0: 2}, **_POLLED}, True, None),
        # One acquire at a time.
        ({"demand": {0: 3}, "acquiring": True}, True, None),
        # After a rejoin, up to the grace cap.
        (
            {"held": 2, "running": 2, "demand": {0: 1, 10: 5}, "grace": Grace(until=101, cap=4)},
            True,
            Acquire(ask={0: 1, 10: 1}),
        ),
        ({"held": 4, "running": 4, "demand": {0: 3}, "grace": Grace(until=101, cap=4)}, True, None),
        # ... counting the running requests that hold no lease yet (the next RENEW claims
        # them): a rejoin that lost every lease, with 5 running and a cap of 5, acquires
        # nothing more.
        (
            {"held": 0, "running": 5, "demand": {0: 24}, "grace": Grace(until=101, cap=5)},
            True,
            None,
        ),
        (
            {"held": 1, "running": 3, "demand": {0: 9}, "grace": Grace(until=101, cap=5)},
            True,
            Acquire(ask={0: 2}),
        ),
        (
            {"held": 4, "running": 4, "demand": {0: 3}, "grace": Grace(until=100, cap=4)},
            True,
            Acquire(ask={0: 3}),
        ),
        # Spares and nobody waiting here: back for whoever waits elsewhere (even mid-acquire).
        (
            {"held": 3, "running": 1, "others": {"a": {5: 1}, "c": {0: 1}}, "acquiring": True},
            False,
            GiveBack(n=2, to="c"),
        ),
        ({"held": 3, "running": 1, "others": {"c": {0: 1}}}, False, GiveBack(n=1, to="c")),
        # ... or for anyone while the pool is above its limit.
        ({"held": 3, "running": 1, "count": 11}, False, GiveBack(n=1, to=None)),
        ({"held": 3, "running": 1, "count": 14}, False, GiveBack(n=2, to=None)),
        # ... and kept when nobody wants them.
        ({"held": 3, "running": 1}, False, None),
        # Published demand overstated: write it again (once at a time).
        ({"published": {0: 2}}, False, PublishDemand()),
        ({"demand": {0: 2}, "published": {0: 4}, **_POLLED}, False, PublishDemand()),
        ({"demand": {0: 3}, "published": {0: 4}, **_POLLED}, False, None),
        ({"demand": {0: 3}, "published": {0: 3, 5: 1}, **_POLLED}, False, PublishDemand()),
        ({"published": {0: 2}, "updating": True}, False, None),
        ({"published": {0: 2}, "acquiring": True}, False, None),
    ],
)
def test_step(kw: dict[str, Any], force: bool, action: object) -> None:
    v, at = moment(kw)
    assert decide.step(v, **at, force=force) == action


def test_unmet_is_the_demand_less_the_spares() -> None:
    assert decide.unmet(held=2, running=1, demand={0: 1, 5: 2}) == {5: 2}
    assert decide.unmet(held=1, running=3, demand={0: 1}) == {0: 1}


@pytest.mark.parametrize(
    ("kw", "plan"),
    [
        ({}, Renewal(back=0, claim=0, unmet={})),
        # Claims in batches: the rest with the next renewals.
        ({"running": 1000}, Renewal(back=0, claim=decide.RENEW_BATCH, unmet={})),
        # Spares nobody here waits for go back with the renewal.
        ({"held": 4, "running": 1}, Renewal(back=3, claim=0, unmet={})),
        # Spares are kept while someone here waits (a lease would not let them in).
        ({"held": 4, "running": 1, "demand": {0: 5}}, Renewal(back=0, claim=0, unmet={0: 2})),
        # Degraded: every lease beyond the running requests goes back ...
        (
            {"mode": Mode.DEGRADED, "held": 4, "running": 1, "demand": {0: 5}},
            Renewal(back=3, claim=0, unmet={0: 5}),
        ),
        # ... and running requests holding none claim one each.
        (
            {"mode": Mode.DEGRADED, "held": 1, "running": 3, "demand": {0: 2}},
            Renewal(back=0, claim=2, unmet={0: 2}),
        ),
        ({"held": 0, "running": 2}, Renewal(back=0, claim=2, unmet={})),
    ],
)
def test_renewal(kw: dict[str, Any], plan: Renewal) -> None:
    v, at = moment(kw)
    del at["now"]
    assert decide.renewal(v, **at) == plan


@pytest.mark.parametrize(("to", "wakes"), [("", True), ("b", True), ("a", False)])
def test_a_lease_freed_for_another_replica_is_not_ours_to_race_for(to: str, wakes: bool) -> None:
    assert decide.wakes(to, "b") is wakes


# --- the local limit ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("limit", "replicas", "shares"),
    [(12, 3, [4, 4, 4]), (7, 3, [3, 2, 2]), (2, 3, [1, 1, 0]), (5, 1, [5]), (0, 2, [0, 0])],
)
def test_local_shares_add_up_to_the_limit(limit: int, replicas: int, shares: list[int]) -> None:
    ids = [f"r{i}" for i in range(replicas)]
    assert [decide.local_share(limit, ids, me) for me in ids] == shares
    assert decide.local_share(limit, ids[1:], ids[0]) == shares[0]  # I count myself in


@pytest.mark.parametrize(
    ("kw", "phase", "limit"),
    [
        ({"held": 3}, None, 3),  # shared: the leases held
        ({"mode": Mode.DEGRADED, "held": 3, "now": 102.9}, Phase.HOLDING, 3),
        # The leases expired: nobody new, whatever the share (never grow past what it held).
        ({"mode": Mode.DEGRADED, "held": 6, "now": 103.0, "me": "a"}, Phase.EXPIRED, 0),
        ({"mode": Mode.DEGRADED, "held": 0, "now": 103.0}, Phase.EXPIRED, 0),
        ({"held": 3, "now": 103.0}, Phase.EXPIRED, 0),  # shared, but not renewed in time
        # Never reached Redis: the limit over the replicas the policy names, at least 1.
        (
            {"mode": Mode.DEGRADED, "connected": False, "expected_replicas": 4, "now": 200.0},
            Phase.LOCAL_SHARE,
            2,
        ),
        (
            {"mode": Mode.DEGRADED, "connected": False, "expected_replicas": 20, "now": 200.0},
            Phase.LOCAL_SHARE,
            1,
        ),
        # ``replicas`` unset: 1, within its share however many run (the whole limit, 10, as
        # the default of 1 gave).
        (
            {"mode": Mode.DEGRADED, "connected": False, "expected_replicas": None, "now": 200.0},
            Phase.LOCAL_SHARE,
            1,
        ),
    ],
)
def test_local_limit(kw: dict[str, Any], phase: Phase | None, limit: int) -> None:
    v, at = moment(kw)
    assert decide.phase(v, at["now"]) is phase
    assert decide.local_limit(v, now=at["now"], held=at["held"]) == limit


def test_leases_count_in_redis_until_a_little_before_the_lease_ends() -> None:
    # 2% for the clocks' rates, and the call's timeout less again.
    assert decide.holding_until(10.0, 2.0, 0.25) == pytest.approx(11.71)


@pytest.mark.parametrize(("held", "share", "cap"), [(1, 3, 3), (5, 3, 5), (0, 0, 0)])
def test_after_a_rejoin_acquire_up_to_the_share_for_one_lease(
    held: int, share: int, cap: int
) -> None:
    assert decide.rejoin(50.0, 2.0, held, share) == Grace(until=52.0, cap=cap)
    assert decide.NO_GRACE.until == -math.inf
