"""The one percentile definition every benchmark reports.

Linear interpolation between the two nearest ranks (numpy's default, "type 7" in Hyndman and
Fan's list): ``percentile([1, 2, 3, 4], 50) == 2.5``; the 50th is the median
(``statistics.median``). With the thousands of samples a benchmark takes, it differs from
nearest-rank by less than one sample's spacing; what matters is that every figure in docs/
means the same thing. Everything in bench/ takes its quantiles from here, medians included.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["percentile", "percentile_scaled"]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (``q`` in [0, 100]) of unsorted values; None when empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside [0, 100]")
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def percentile_scaled(values: Sequence[float], q: float, scale: float = 1.0) -> float:
    """:func:`percentile` times ``scale`` (1e3: seconds to ms), NaN when there is no value: a
    table cell that is always a number (a way whose every request failed still has its row,
    and misses its targets)."""
    v = percentile(values, q)
    return float("nan") if v is None else scale * v
