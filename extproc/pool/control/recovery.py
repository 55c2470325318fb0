"""Staged recovery (``pool.overload``) on the gate, each tick of ``PoolControl`` (once a second).

The counts of the protected traffic (``demand.protected``: every band but the least urgent) go
from the gate (admitted, evicted or relegated, refused, the p95 of recent waits, the queue; not
the requests whose client's own deadline passed: ``client_expired_total``) to
``extproc.pool.control.overload.OverloadMonitor``, and when its state or factor changes, the
factor to ``Gate.set_cut``: while overloaded, the least urgent band holds no more than its
guaranteed share; when it clears, its cap comes back 50% -> 80% -> 100%, each step held
``step_hold``. A policy whose buckets share one priority has nothing to protect and no cut. Each
change is one log line; a change of state is counted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from extproc.config.policy import BucketPolicy, OverloadPolicy, Policy
from extproc.pool.control.overload import Overload, OverloadMonitor, OverloadSnapshot
from extproc.pool.core import demand
from extproc.pool.gate import Gate

__all__ = ["Recovery"]

log = logging.getLogger("extproc.control")


def _p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


class Recovery:
    """The overload monitor of the policy in force on ``gate``; ``on_transition``: the state
    entered, to count."""

    def __init__(self, gate: Gate, on_transition: Callable[[str], None]) -> None:
        self._gate = gate
        self._on_transition = on_transition
        self._monitor: OverloadMonitor | None = None
        self._settings: OverloadPolicy | None = None
        self._buckets: tuple[BucketPolicy, ...] = ()

    def follow(self, policy: Policy) -> None:
        """A (re)load: a new monitor, and no cut, only when ``pool.overload`` changed."""
        self._buckets, pool = policy.buckets, policy.pool
        settings = pool.overload if pool is not None and pool.overload.enabled else None
        if settings != self._settings:
            self._settings = settings
            if pool is not None:
                self._gate.set_cut(1.0)
            self._monitor = OverloadMonitor(settings) if settings is not None else None

    def tick(self, now: float) -> Overload | None:
        """One look at the protected bands; apply the factor when it changes."""
        monitor = self._monitor
        if monitor is None:
            return None
        stats = self._gate.statistics()
        protected = [b for b in demand.protected(self._buckets) if b.name in stats]
        if not protected:
            return None  # one band: nothing to protect it from
        waits: list[float] = []
        for b in protected:
            waits.extend(self._gate.recent_waits(b.name))
        before = monitor.state
        verdict = monitor.update(
            now,
            admitted=sum(stats[b.name].admitted_total for b in protected),
            # A relegation is a miss of its bucket's deadline: an eviction to the monitor.
            evicted=sum(
                stats[b.name].evicted_total + stats[b.name].relegated_total for b in protected
            ),
            refused=sum(stats[b.name].refused_total for b in protected),
            p95_wait_s=_p95(waits),
            queued=sum(stats[b.name].queued for b in protected),
            deadline_s=max((b.queue_timeout_s for b in protected), default=0.0),
        )
        if verdict.changed:
            self._gate.set_cut(verdict.factor)
            if verdict.state is not before:
                self._on_transition(str(verdict.state))
            rate = "-" if verdict.eviction_rate is None else f"{verdict.eviction_rate:.1%}"
            log.warning(
                "pool %s: least urgent band at %.0f%% of its cap (%s; eviction rate %s, "
                "p95 wait %s s%s)",
                verdict.state,
                100 * verdict.factor,
                verdict.reason,
                rate,
                "-" if verdict.p95_wait_s is None else f"{verdict.p95_wait_s:.2f}",
                "; the backend needs capacity" if verdict.needs_capacity else "",
            )
        return verdict

    def snapshot(self, cut: float) -> OverloadSnapshot:
        """The monitor's, or an idle one at the pool's ``cut``."""
        return OverloadSnapshot.idle(cut) if self._monitor is None else self._monitor.snapshot()
