"""Staged recovery of the lower-priority bands, driven tick by tick with plain numbers."""

from __future__ import annotations

import pytest

from extproc.config.policy import OverloadPolicy
from extproc.pool.control.overload import Overload, OverloadMonitor, OverloadState

NORMAL, OVERLOADED, RECOVERING = (
    OverloadState.NORMAL,
    OverloadState.OVERLOADED,
    OverloadState.RECOVERING,
)


class Feed:
    """Keeps the protected traffic's cumulative totals; each tick adds to them."""

    def __init__(self, monitor: OverloadMonitor | None = None) -> None:
        self.monitor = monitor or OverloadMonitor(OverloadPolicy())
        self.admitted = self.evicted = self.refused = 0

    def tick(
        self,
        now: float,
        admitted: int = 0,
        evicted: int = 0,
        refused: int = 0,
        *,
        p95: float | None = None,
        queued: int = 0,
        deadline_s: float = 10.0,
    ) -> Overload:
        self.admitted += admitted
        self.evicted += evicted
        self.refused += refused
        return self.monitor.update(
            now,
            admitted=self.admitted,
            evicted=self.evicted,
            refused=self.refused,
            p95_wait_s=p95,
            queued=queued,
            deadline_s=deadline_s,
        )


def overload_at_1(feed: Feed) -> Overload:
    feed.tick(0.0)  # the baseline
    o = feed.tick(1.0, admitted=100, evicted=10)  # 10/110 = 9.1% > 5%
    assert (o.state, o.factor, o.changed, o.reason) == (OVERLOADED, 0.0, True, "evictions")
    assert o.eviction_rate == pytest.approx(10 / 110)
    assert o.needs_capacity is False
    return o


def test_the_full_path_with_exact_timings() -> None:
    feed = Feed()
    first = feed.tick(0.0)
    assert (first.state, first.factor, first.changed, first.eviction_rate) == (
        NORMAL,
        1.0,
        False,
        None,
    )
    overload_at_1(feed)
    changes: list[tuple[float, OverloadState, float, str]] = []
    for t in range(2, 400):
        # 100 admitted a second, none evicted: the 10 evictions of t=1 dilute in the window;
        # the rate is 10 / (100 t + 10): 4.8% at t=2 (between the rates), below 1% from t=10.
        o = feed.tick(float(t), admitted=100)
        if t == 9:
            assert o.eviction_rate == pytest.approx(10 / 910)
        if t == 31:
            assert o.eviction_rate == 0.0  # t=1 has left the 30 s window
        if o.changed:
            changes.append((t, o.state, o.factor, o.reason))
    # Clear from t=10: each step after 120 s of clear ticks.
    assert changes == [
        (130, RECOVERING, 0.5, "cleared"),
        (250, RECOVERING, 0.8, "step"),
        (370, NORMAL, 1.0, "recovered"),
    ]


def test_between_the_rates_the_clear_time_restarts() -> None:
    feed = Feed()
    overload_at_1(feed)
    for t in range(2, 131):
        # Clear from t=10, but at t=60 a little trouble: 60 evicted among 3060 in the window
        # (2%: between the rates) until it leaves the window at t=90.
        o = feed.tick(float(t), admitted=100, evicted=60 if t == 60 else 0)
        if 60 <= t < 90:
            assert o.eviction_rate == pytest.approx(60 / 3060)
    assert o.state is OVERLOADED  # not at t=130: the count restarted at t=90
    for t in range(131, 250):
        o = feed.tick(float(t), admitted=100)
        if o.changed:
            break
    assert (t, o.state, o.factor) == (210, RECOVERING, 0.5)


def test_a_breach_during_recovery_goes_back_to_overloaded() -> None:
    feed = Feed()
    overload_at_1(feed)
    for t in range(2, 131):
        o = feed.tick(float(t), admitted=100)
    assert (o.state, o.factor) == (RECOVERING, 0.5)
    o = feed.tick(131.0, admitted=100, evicted=200)  # 200 / (3000 + 200) = 6.25%
    assert (o.state, o.factor, o.changed, o.reason) == (OVERLOADED, 0.0, True, "evictions")
    o = feed.tick(132.0, admitted=100, evicted=200)
    assert (o.state, o.changed) == (OVERLOADED, False)
    # 400 evictions stay in the window until t=162; then clear, and 120 s more.
    for t in range(133, 400):
        o = feed.tick(float(t), admitted=100)
        if o.changed:
            break
    assert (t, o.state, o.factor, o.reason) == (282, RECOVERING, 0.5, "cleared")


def test_a_slow_queue_is_a_breach_before_anyone_is_evicted() -> None:
    feed = Feed()
    feed.tick(0.0)
    o = feed.tick(1.0, admitted=100, p95=7.9, deadline_s=10.0)
    assert o.state is NORMAL
    o = feed.tick(2.0, admitted=100, p95=8.0, deadline_s=10.0)  # 0.8 x deadline
    assert (o.state, o.reason, o.eviction_rate, o.p95_wait_s) == (OVERLOADED, "wait", 0.0, 8.0)
    # No evictions, but the wait stays high: not clear.
    for t in range(3, 200):
        o = feed.tick(float(t), admitted=100, p95=8.5, deadline_s=10.0)
    assert o.state is OVERLOADED
    for t in range(200, 321):
        o = feed.tick(float(t), admitted=100, p95=1.0, deadline_s=10.0)
    assert (o.state, o.factor) == (RECOVERING, 0.5)  # clear from t=200, stepped at t=320


def test_needs_capacity_at_a_fifth_evicted() -> None:
    feed = Feed()
    feed.tick(0.0)
    o = feed.tick(1.0, admitted=100, evicted=25)  # 25/125 = 20%
    assert (o.state, o.needs_capacity) == (OVERLOADED, True)
    feed2 = Feed()
    feed2.tick(0.0)
    o = feed2.tick(1.0, admitted=100, evicted=24)  # 19.4%
    assert (o.state, o.needs_capacity) == (OVERLOADED, False)


def test_small_samples_do_not_count() -> None:
    feed = Feed()
    feed.tick(0.0)
    o = feed.tick(1.0, admitted=10, evicted=5, p95=9.9)  # a third evicted, but of 15
    assert (o.state, o.eviction_rate, o.samples, o.needs_capacity) == (NORMAL, None, 15, False)
    o = feed.tick(2.0, admitted=5)  # 20 decisions now: 5/20 = 25%
    assert (o.state, o.eviction_rate, o.needs_capacity) == (OVERLOADED, 0.25, True)


def test_no_protected_traffic_lets_recovery_proceed_but_a_long_queue_does_not() -> None:
    idle = Feed()
    overload_at_1(idle)
    for t in range(2, 31):
        o = idle.tick(float(t))  # idle, but t=1's evictions are still in the window
        assert o.state is OVERLOADED
    for t in range(31, 152):
        o = idle.tick(float(t))
        if o.changed:
            break
    assert (t, o.state, o.eviction_rate) == (151, RECOVERING, None)  # clear from t=31

    stuck = Feed()
    overload_at_1(stuck)
    for t in range(2, 400):
        o = stuck.tick(float(t), queued=20)  # nothing decided, 20 waiting: pressure
    assert o.state is OVERLOADED


def test_refusals_are_reported_not_a_trigger() -> None:
    feed = Feed()
    feed.tick(0.0)
    o = feed.tick(1.0, admitted=100, refused=50)
    assert o.refusal_rate == pytest.approx(50 / 150)
    assert o.state is NORMAL
    assert feed.tick(2.0).refusal_rate == pytest.approx(50 / 150)


def test_totals_that_go_down_restart_the_window() -> None:
    feed = Feed()
    overload_at_1(feed)
    feed.admitted = feed.evicted = 0  # counters reset (a restart of the process that counts)
    o = feed.tick(2.0)
    assert (o.samples, o.eviction_rate) == (0, None)
    for t in range(3, 123):
        o = feed.tick(float(t))
    assert (t, o.state) == (122, RECOVERING)  # clear from t=2


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        OverloadMonitor(OverloadPolicy(tighten_eviction_rate=0.05), clear_rate=0.1)
    with pytest.raises(ValueError):
        OverloadMonitor(OverloadPolicy(), steps=(0.8, 0.5))
    with pytest.raises(ValueError):
        OverloadMonitor(OverloadPolicy(), min_samples=0)
    m = OverloadMonitor(OverloadPolicy(step_hold_s=10.0), steps=())  # straight back to normal
    feed = Feed(m)
    overload_at_1(feed)
    for t in range(2, 100):
        o = feed.tick(float(t), admitted=100)
        if o.changed:
            break
    assert (t, o.state, o.factor) == (20, NORMAL, 1.0)  # clear from t=10
    assert repr(m) == "<OverloadMonitor normal x1.0 (recovered)>"
