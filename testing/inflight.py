"""A backend's in-flight history, exact: every request's start and end, and what they add up to.

The recording backend (``testing.recorder``) appends one :class:`Event` per request start
(``+1``) and end (``-1``), stamped with ``time.monotonic()`` (``CLOCK_MONOTONIC``, one clock for
every process on the machine, so the test's own timestamps of a fault compare with it). The
readers here are pure: the count after each event is the in-flight count from that instant to
the next event, so its maximum over a window is the exact maximum at any instant of the window,
not a sample's. Events at one instant are applied ends first, so a request that ends as another
starts never counts as two.

- :func:`max_in_flight` the most at once in ``[start, end)``, :func:`first_at` when a count was
  first reached;
- :func:`mean_in_flight` the time-weighted mean over ``[start, end)``;
- :func:`time_to_usage` how long after ``since`` a window of ``window_s`` first averaged at
  least ``level`` in flight (the pool "used at 90% of its limit" after a fault).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Event", "History", "first_at", "max_in_flight", "mean_in_flight", "time_to_usage"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    t: float  # time.monotonic() at the backend
    delta: int  # +1 a request started, -1 one ended


@dataclass(frozen=True, slots=True, kw_only=True)
class History:
    """The count after each event: ``times[i]``, ``counts[i]`` (``counts[i]`` holds until
    ``times[i + 1]``). Before the first event nothing was in flight."""

    times: tuple[float, ...]
    counts: tuple[int, ...]

    @classmethod
    def of(cls, events: Iterable[Event]) -> History:
        ordered = sorted(events, key=lambda e: (e.t, e.delta))  # ends first at one instant
        times: list[float] = []
        counts: list[int] = []
        n = 0
        for e in ordered:
            n += e.delta
            if times and times[-1] == e.t:
                counts[-1] = n
            else:
                times.append(e.t)
                counts.append(n)
        return cls(times=tuple(times), counts=tuple(counts))

    def at(self, t: float) -> int:
        """In flight at instant ``t``."""
        i = bisect.bisect_right(self.times, t) - 1
        return self.counts[i] if i >= 0 else 0

    def segments(self, start: float, end: float) -> list[tuple[float, float, int]]:
        """``(from, to, count)`` pieces covering ``[start, end)``."""
        if end <= start:
            return []
        out: list[tuple[float, float, int]] = []
        t, n = start, self.at(start)
        i = bisect.bisect_right(self.times, start)
        while i < len(self.times) and self.times[i] < end:
            out.append((t, self.times[i], n))
            t, n = self.times[i], self.counts[i]
            i += 1
        out.append((t, end, n))
        return out


def max_in_flight(h: History, start: float = float("-inf"), end: float = float("inf")) -> int:
    """The most requests in flight at any instant of ``[start, end)``."""
    best = h.at(start) if start != float("-inf") else 0
    lo = bisect.bisect_left(h.times, start)
    hi = bisect.bisect_left(h.times, end)
    return max([best, *h.counts[lo:hi]])


def first_at(h: History, n: int) -> float | None:
    """The first instant with at least ``n`` in flight; None if never."""
    return next((t for t, c in zip(h.times, h.counts, strict=True) if c >= n), None)


def mean_in_flight(h: History, start: float, end: float) -> float:
    """The time-weighted mean of the in-flight count over ``[start, end)``."""
    pieces = h.segments(start, end)
    if not pieces:
        return 0.0
    return sum((b - a) * n for a, b, n in pieces) / (end - start)


def time_to_usage(
    h: History, since: float, *, level: float, window_s: float, within_s: float
) -> float | None:
    """Seconds from ``since`` to the first window of ``window_s`` starting within ``within_s``
    whose mean in flight is at least ``level``; None if none. The windows tried start at
    ``since`` and at each event after it, within ``within_s``."""
    lo = bisect.bisect_right(h.times, since)
    hi = bisect.bisect_right(h.times, since + within_s)
    starts: Sequence[float] = [since, *h.times[lo:hi]]
    for t in starts:
        if mean_in_flight(h, t, t + window_s) >= level:
            return t - since
    return None
