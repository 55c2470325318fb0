"""Windowed quantiles from cumulative histograms: pure, ``now`` passed in.

Histogram buckets are cumulative since the vLLM process started; a quantile over them would
describe its whole life. A ``HistogramWindow`` keeps each endpoint's previous bucket counts
(keyed by the caller, ``address:port``); each ``add`` puts the delta (now minus previous) of all
endpoints together into a time-stamped ring, and ``total`` sums the ring's entries of the last
``window_s``, for ``histogram_quantile`` (Prometheus' interpolation) and ``observations``.

Rules of a reading:
1. The first sight of an endpoint only records its counts (its history is not recent); so does
   a sight after a gap of ``window_s`` or more since its previous reading.
2. A count that went down, or bounds that changed, mean the process restarted (or re-bucketed):
   its new counts are all new observations and are the delta.
3. An endpoint not read within ``window_s`` is forgotten (its next reading is a baseline by
   rule 1 anyway); an entry of the ring leaves it once it is ``window_s`` old.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping

__all__ = ["HistogramWindow", "histogram_quantile", "observations"]

# Upper bound (``le``, +Inf included) -> cumulative count.
Buckets = Mapping[float, float]


def histogram_quantile(q: float, buckets: Buckets) -> float | None:
    """The ``q`` quantile of cumulative ``buckets`` (upper bound -> count), as Prometheus'
    ``histogram_quantile``: linear interpolation inside the bucket where the rank falls, the
    first bucket starting at 0; a rank in the +Inf bucket gives the largest finite bound.
    None when there is no observation (or no finite bound).

    Counts are made monotonic first (summing endpoints whose bounds differ can break it),
    as Prometheus does."""
    bounds = sorted(buckets)
    if not bounds:
        return None
    counts: list[float] = []
    running_max = 0.0
    for b in bounds:
        running_max = max(running_max, buckets[b])
        counts.append(running_max)
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    i = next(i for i, c in enumerate(counts) if c >= rank)
    upper = bounds[i]
    if math.isinf(upper):
        return bounds[i - 1] if i > 0 else None
    if i == 0:
        if upper <= 0:
            return upper
        lower, below = 0.0, 0.0
    else:
        lower, below = bounds[i - 1], counts[i - 1]
    return lower + (upper - lower) * (rank - below) / (counts[i] - below)


def observations(buckets: Buckets) -> int:
    """How many observations cumulative ``buckets`` hold (the largest count)."""
    return round(max(buckets.values(), default=0.0))


def _delta(prev: Buckets | None, cur: Buckets | None) -> dict[float, float] | None:
    """New observations between two readings of one endpoint's histogram (rule 2); None when
    there is nothing to subtract from or nothing to subtract."""
    if cur is None or prev is None:
        return None
    if prev.keys() != cur.keys() or any(cur[b] < prev[b] for b in cur):
        return dict(cur)  # restarted (or re-bucketed): everything it has is new
    return {b: cur[b] - prev[b] for b in cur}


def _add_into(into: dict[float, float], delta: Buckets | None) -> None:
    if delta:
        for b, n in delta.items():
            into[b] = into.get(b, 0.0) + n


class HistogramWindow:
    """One histogram family over many endpoints, windowed (the rules above)."""

    __slots__ = ("_last", "_ring", "window_s")

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._last: dict[str, tuple[float, Buckets | None]] = {}  # key -> (at, its counts)
        self._ring: deque[tuple[float, dict[float, float]]] = deque()

    def add(self, now: float, readings: Mapping[str, Buckets | None]) -> None:
        """This round's reading of each endpoint read (None: the page had no such family)."""
        delta: dict[float, float] = {}
        for key, cur in readings.items():
            last = self._last.get(key)
            if last is not None and last[0] > now - self.window_s:
                _add_into(delta, _delta(last[1], cur))
            self._last[key] = (now, cur)
        for key in [k for k, (at, _) in self._last.items() if at <= now - self.window_s]:
            del self._last[key]
        if delta:
            self._ring.append((now, delta))

    def total(self, now: float) -> dict[float, float]:
        """The new observations of the last ``window_s``, all endpoints together, cumulative
        per bound as the pages are."""
        ring = self._ring
        while ring and ring[0][0] <= now - self.window_s:
            ring.popleft()
        out: dict[float, float] = {}
        for _, delta in ring:
            _add_into(out, delta)
        return out

    def __len__(self) -> int:
        """Endpoints known (read within the window)."""
        return len(self._last)
