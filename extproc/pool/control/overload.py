"""Staged recovery: when the protected traffic suffers, cut the other bands, then let them back.

The most urgent band (the protected traffic) should not wait behind batch work. When it does,
the lower-priority bands are cut to their guaranteed share at once, and given their borrowed
capacity back in steps, each held long enough to see that the protected band stays well.

States and factor (the share of their borrowed capacity the lower bands may use)
-------------------------------------------------------------------------------
::

    normal (1.0) --breach--> overloaded (0.0) --clear for step_hold_s--> recovering (0.5)
    recovering (0.5) --clear for step_hold_s--> recovering (0.8) --clear ...--> normal (1.0)
    recovering (any) --breach--> overloaded (0.0)

The settings (``window``, ``tighten_eviction_rate``, ``step_hold``) come from the policy's
``OverloadPolicy``; the law's other constants are named below (``CLEAR_RATE``, ...).

Each tick the caller passes cumulative totals of the protected traffic (admitted, evicted at
their deadline, refused at once) and the monitor takes their deltas over a sliding window
(``window_s``, 30 s): ``eviction_rate = evicted / (admitted + evicted)``, ``refusal_rate =
refused / (admitted + evicted + refused)``, reported but no trigger: a refusal at once costs the
client no wait, an eviction cost it its whole deadline. "Evicted" is at the deadline the
operator set (the bucket's or the route's); a request whose client's own, sooner deadline
passed (``client_expired_total``) is in none of the counts: a client picks its deadline, and
short ones must not cut the other bands (nor, as samples, dilute a real eviction rate).

- Breach: ``eviction_rate > tighten_rate`` (0.05), or the p95 queue wait ``>= 0.8 *
  deadline_s`` (the band is about to start evicting).
- Clear: ``eviction_rate < clear_rate`` (0.01) and the p95 wait below that threshold. Between
  the two rates nothing moves, but the clear time restarts: a step is entered only after
  ``step_hold_s`` (120 s) of clear ticks in a row (the first clear tick starts the count; every
  step restarts it). The gap between the rates is the hysteresis that keeps the bands from
  flapping, and the long hold lets the window (and the batch requests admitted at the higher
  factor, which hold their slots for minutes) show the effect of each step before the next.
- ``needs_capacity``: ``eviction_rate >= capacity_rate`` (0.20). With a fifth of the protected
  traffic evicted, the pool is short of GPUs: tighter admission of the other bands is not
  enough, so this flag is for an operator or an autoscaler.

Small samples: the eviction rate and the p95 count only with at least ``min_samples`` (20)
decisions (admitted + evicted) in the window, the refusal rate with as many arrivals (refused
too): one eviction among 5 requests is 20% and would cut every other band for minutes. Below
that nothing is a breach; a window is clear when it holds no eviction at all and fewer than
``min_samples`` protected requests are queued now (an idle or lightly used band is not
overloaded, so recovery proceeds without protected traffic, while a queue that long is pressure
before anyone was evicted); anything else restarts the clear time.

Totals that go down (the counters were reset) restart the window from the new totals. Pure:
``update`` takes ``now`` from the caller; no clock, no I/O. ``snapshot()`` is what the gauges
and /debug/queues show (``extproc.pool.view``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from extproc.config.policy import OverloadPolicy
from extproc.pool.view import gauge

__all__ = [
    "CAPACITY_RATE",
    "CLEAR_RATE",
    "MIN_SAMPLES",
    "STEPS",
    "WAIT_FRACTION",
    "Overload",
    "OverloadMonitor",
    "OverloadReason",
    "OverloadSnapshot",
    "OverloadState",
]

# The law's constants (the settings are the policy's).
CLEAR_RATE: Final = 0.01  # at most: never above the policy's tighten_eviction_rate
WAIT_FRACTION: Final = 0.8  # p95 wait / deadline that is a breach
STEPS: Final = (0.5, 0.8)  # the recovering factors, in order; after the last, normal
CAPACITY_RATE: Final = 0.20  # the eviction rate that says the backend needs capacity
MIN_SAMPLES: Final = 20  # decisions in the window before a rate counts


class OverloadState(StrEnum):
    NORMAL = "normal"
    OVERLOADED = "overloaded"
    RECOVERING = "recovering"


class OverloadReason(StrEnum):
    """Why the state or factor last changed."""

    INITIAL = "initial"
    EVICTIONS = "evictions"  # breach: the eviction rate above tighten_rate
    WAIT = "wait"  # breach: the p95 wait near the deadline
    CLEARED = "cleared"  # overloaded -> the first recovering step
    STEP = "step"  # the next recovering step
    RECOVERED = "recovered"  # -> normal


@dataclass(frozen=True, slots=True, kw_only=True)
class Overload:
    """The verdict of one tick."""

    state: OverloadState
    factor: float  # the share of borrowed capacity the lower-priority bands may use, 0..1
    eviction_rate: float | None  # None: fewer than min_samples decisions in the window
    refusal_rate: float | None
    p95_wait_s: float | None
    needs_capacity: bool
    changed: bool  # state or factor changed at this tick
    reason: OverloadReason
    samples: int  # admitted + evicted in the window


_STATE_CODES: dict[str, int] = {
    OverloadState.NORMAL: 0,
    OverloadState.OVERLOADED: 1,
    OverloadState.RECOVERING: 2,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class OverloadSnapshot:
    """The monitor as the gauges and /debug/queues' ``overload`` show it."""

    state: OverloadState = field(
        metadata=gauge(
            "overload_state", "0 normal, 1 overloaded, 2 recovering.", codes=_STATE_CODES
        )
    )
    factor: float = field(
        metadata=gauge(
            "overload_factor", "Share of its cap the least urgent band may hold (1: no cut)."
        )
    )
    reason: OverloadReason | None  # None before the first tick
    eviction_rate: float | None = field(
        metadata=gauge(
            "overload_eviction_rate", "Eviction rate of the protected bands over the window."
        )
    )
    p95_wait_s: float | None = field(
        metadata=gauge(
            "overload_p95_wait_seconds", "P95 queue wait of the protected bands' recent admissions."
        )
    )
    needs_capacity: bool

    @classmethod
    def idle(cls, factor: float) -> OverloadSnapshot:
        """No tick yet (or no monitor): normal, at the pool's ``factor``."""
        return cls(
            state=OverloadState.NORMAL,
            factor=factor,
            reason=None,
            eviction_rate=None,
            p95_wait_s=None,
            needs_capacity=False,
        )


@dataclass(frozen=True, slots=True)
class _Totals:
    at: float
    admitted: int
    evicted: int
    refused: int


class OverloadMonitor:
    def __init__(
        self,
        policy: OverloadPolicy,
        *,
        clear_rate: float | None = None,
        wait_fraction: float = WAIT_FRACTION,
        steps: Sequence[float] = STEPS,
        capacity_rate: float = CAPACITY_RATE,
        min_samples: int = MIN_SAMPLES,
    ) -> None:
        """The policy's settings; the keywords replace the law's constants (tests).
        ``clear_rate`` None: ``CLEAR_RATE``, or the tighten rate when that is lower.
        ``steps``: the factors of the recovering state, in order; after the last, normal."""
        window_s, tighten_rate = policy.window_s, policy.tighten_eviction_rate
        step_hold_s = policy.step_hold_s
        if clear_rate is None:
            clear_rate = min(CLEAR_RATE, tighten_rate)
        if not 0.0 <= clear_rate <= tighten_rate <= capacity_rate <= 1.0:
            raise ValueError("need 0 <= clear_rate <= tighten_rate <= capacity_rate <= 1")
        if list(steps) != sorted(steps) or any(not 0.0 < f < 1.0 for f in steps):
            raise ValueError("steps must rise, each in (0, 1)")
        if window_s <= 0 or step_hold_s < 0 or min_samples < 1:
            raise ValueError("need window_s > 0, step_hold_s >= 0, min_samples >= 1")
        self.window_s = window_s
        self.tighten_rate = tighten_rate
        self.clear_rate = clear_rate
        self.wait_fraction = wait_fraction
        self.step_hold_s = step_hold_s
        self.steps = tuple(steps)
        self.capacity_rate = capacity_rate
        self.min_samples = min_samples
        self._totals: deque[_Totals] = deque()
        self._state = OverloadState.NORMAL
        self._step = -1  # index into steps while recovering
        self._reason = OverloadReason.INITIAL
        self._clear_since: float | None = None
        self._last: Overload | None = None

    @property
    def state(self) -> OverloadState:
        return self._state

    @property
    def factor(self) -> float:
        if self._state is OverloadState.OVERLOADED:
            return 0.0
        if self._state is OverloadState.RECOVERING:
            return self.steps[self._step]
        return 1.0

    def update(
        self,
        now: float,
        *,
        admitted: int,
        evicted: int,
        refused: int,
        p95_wait_s: float | None,
        queued: int,
        deadline_s: float,
    ) -> Overload:
        """One tick. The counts are cumulative totals of the protected traffic; ``queued`` is
        how many of its requests wait now; ``deadline_s`` is its queue timeout."""
        d_admitted, d_evicted, d_refused = self._deltas(now, admitted, evicted, refused)
        samples = d_admitted + d_evicted
        counts = samples >= self.min_samples
        eviction_rate = d_evicted / samples if counts else None
        arrivals = samples + d_refused
        refusal_rate = d_refused / arrivals if arrivals >= self.min_samples else None
        slow = (
            p95_wait_s is not None
            and deadline_s > 0
            and p95_wait_s >= self.wait_fraction * deadline_s
        )

        breach: OverloadReason | None = None
        if eviction_rate is not None and eviction_rate > self.tighten_rate:
            breach = OverloadReason.EVICTIONS
        elif counts and slow:
            breach = OverloadReason.WAIT
        if eviction_rate is not None:
            clear = eviction_rate < self.clear_rate and not slow
        else:
            clear = d_evicted == 0 and queued < self.min_samples and not slow

        before = (self._state, self.factor)
        if breach is not None:
            self._clear_since = None
            if self._state is not OverloadState.OVERLOADED:
                self._state = OverloadState.OVERLOADED
                self._step = -1
                self._reason = breach
        elif not clear:
            self._clear_since = None
        elif self._state is not OverloadState.NORMAL:
            if self._clear_since is None:
                self._clear_since = now
            elif now - self._clear_since >= self.step_hold_s:
                self._advance()
                self._clear_since = now
        self._last = Overload(
            state=self._state,
            factor=self.factor,
            eviction_rate=eviction_rate,
            refusal_rate=refusal_rate,
            p95_wait_s=p95_wait_s,
            needs_capacity=eviction_rate is not None and eviction_rate >= self.capacity_rate,
            changed=(self._state, self.factor) != before,
            reason=self._reason,
            samples=samples,
        )
        return self._last

    def snapshot(self) -> OverloadSnapshot:
        """The state and factor now, and the rates of the last tick."""
        o = self._last
        if o is None:
            return OverloadSnapshot.idle(self.factor)
        return OverloadSnapshot(
            state=self._state,
            factor=self.factor,
            reason=o.reason,
            eviction_rate=o.eviction_rate,
            p95_wait_s=o.p95_wait_s,
            needs_capacity=o.needs_capacity,
        )

    def __repr__(self) -> str:
        return f"<OverloadMonitor {self._state} x{self.factor} ({self._reason})>"

    # --- internals ---------------------------------------------------------------------------

    def _advance(self) -> None:
        if self._step + 1 < len(self.steps):
            overloaded = self._state is OverloadState.OVERLOADED
            self._reason = OverloadReason.CLEARED if overloaded else OverloadReason.STEP
            self._state = OverloadState.RECOVERING
            self._step += 1
        else:
            self._state = OverloadState.NORMAL
            self._step = -1
            self._reason = OverloadReason.RECOVERED

    def _deltas(
        self, now: float, admitted: int, evicted: int, refused: int
    ) -> tuple[int, int, int]:
        """The totals' growth since the newest tick at least ``window_s`` old (or the first
        tick, early on); older ticks are dropped."""
        ring = self._totals
        if ring:
            last = ring[-1]
            if admitted < last.admitted or evicted < last.evicted or refused < last.refused:
                ring.clear()  # the counters were reset: start again from these totals
        ring.append(_Totals(now, admitted, evicted, refused))
        while len(ring) >= 2 and ring[1].at <= now - self.window_s:
            ring.popleft()
        base = ring[0]
        return admitted - base.admitted, evicted - base.evicted, refused - base.refused
