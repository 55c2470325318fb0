"""Histogram windows and quantiles: pure, table-driven, ``now`` passed in."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from extproc.backend.window import HistogramWindow, histogram_quantile, observations

INF = float("inf")

QUANTILES = [
    # rank 36 falls in (0.5, 1.0], 6 of its 10: 0.5 + 0.5 * 6/10
    (0.9, {0.1: 10.0, 0.5: 30.0, 1.0: 40.0, INF: 40.0}, 0.8),
    # rank 3 falls in the first bucket, which starts at 0: 0.1 * 3/10
    (0.1, {0.1: 10.0, 0.5: 30.0, INF: 30.0}, 0.03),
    # the whole first bucket below 0 or at it: its bound
    (0.5, {0.0: 10.0, INF: 10.0}, 0.0),
    (0.5, {-1.0: 10.0, INF: 10.0}, -1.0),
    # in +Inf: the largest finite bound; +Inf alone: none
    (0.9, {0.1: 10.0, 1.0: 20.0, INF: 100.0}, 1.0),
    (0.9, {INF: 5.0}, None),
    # no observation
    (0.9, {}, None),
    (0.9, {0.1: 0.0, INF: 0.0}, None),
    # made monotonic first: {0.1: 10, 0.5: 10, 1.0: 20}, rank 15 in (0.5, 1.0]
    (0.75, {0.1: 10.0, 0.5: 8.0, 1.0: 20.0, INF: 20.0}, 0.75),
    # bounds in any order
    (0.5, {INF: 20.0, 1.0: 20.0, 0.5: 10.0}, 0.5),
]


@pytest.mark.parametrize(("q", "buckets", "expected"), QUANTILES)
def test_histogram_quantile(q: float, buckets: dict[float, float], expected: float | None) -> None:
    assert histogram_quantile(q, buckets) == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize(
    ("buckets", "n"), [({}, 0), ({0.1: 2.0, INF: 7.0}, 7), ({0.1: 2.4, INF: 2.4}, 2)]
)
def test_observations(buckets: dict[float, float], n: int) -> None:
    assert observations(buckets) == n


B = Mapping[float, float] | None

# Each case: window_s, then rounds of (now, {endpoint: its cumulative buckets}, the window's
# total after the round).
WINDOWS: dict[str, tuple[float, list[tuple[float, dict[str, B], dict[float, float]]]]] = {
    "first sight is a baseline, then deltas": (
        10.0,
        [
            (0.0, {"a": {0.1: 1000.0, INF: 1000.0}}, {}),
            (1.0, {"a": {0.1: 1000.0, INF: 1020.0}}, {0.1: 0.0, INF: 20.0}),
            (2.0, {"a": {0.1: 1000.0, INF: 1020.0}}, {0.1: 0.0, INF: 20.0}),  # nothing new
        ],
    ),
    "endpoints summed, each against its own previous counts": (
        10.0,
        [
            (0.0, {"a": {1.0: 5.0}, "b": {1.0: 50.0}}, {}),
            (1.0, {"a": {1.0: 6.0}, "b": {1.0: 52.0}}, {1.0: 3.0}),
            (2.0, {"a": {1.0: 6.0}, "c": {1.0: 9.0}}, {1.0: 3.0}),  # c: a baseline
        ],
    ),
    "a count that went down: a restart, all of it new": (
        10.0,
        [
            (0.0, {"a": {1.0: 100.0}}, {}),
            (1.0, {"a": {1.0: 10.0}}, {1.0: 10.0}),
        ],
    ),
    "other bounds: re-bucketed, all of it new": (
        10.0,
        [
            (0.0, {"a": {1.0: 100.0}}, {}),
            (1.0, {"a": {1.0: 100.0, 2.0: 101.0}}, {1.0: 100.0, 2.0: 101.0}),
        ],
    ),
    "entries leave the window once window_s old": (
        10.0,
        [
            (0.0, {"a": {1.0: 0.0}}, {}),
            (1.0, {"a": {1.0: 20.0}}, {1.0: 20.0}),
            (2.0, {"a": {1.0: 30.0}}, {1.0: 30.0}),
            (10.5, {"a": {1.0: 30.0}}, {1.0: 30.0}),
            (11.0, {"a": {1.0: 30.0}}, {1.0: 10.0}),  # t=1 is out: (1, 11]
            (12.0, {"a": {1.0: 30.0}}, {1.0: 0.0}),  # rounds with nothing new remain
        ],
    ),
    "a gap of window_s: a baseline again": (
        10.0,
        [
            (0.0, {"a": {1.0: 0.0}}, {}),
            (10.0, {"a": {1.0: 500.0}}, {}),
            (11.0, {"a": {1.0: 510.0}}, {1.0: 10.0}),
        ],
    ),
    "an endpoint missing a round is read against its last reading": (
        10.0,
        [
            (0.0, {"a": {1.0: 0.0}, "b": {1.0: 0.0}}, {}),
            (1.0, {"a": {1.0: 1.0}}, {1.0: 1.0}),  # b failed this round
            (2.0, {"a": {1.0: 1.0}, "b": {1.0: 4.0}}, {1.0: 5.0}),
        ],
    ),
    "a page without the family: the next one is a baseline": (
        10.0,
        [
            (0.0, {"a": {1.0: 0.0}}, {}),
            (1.0, {"a": None}, {}),
            (2.0, {"a": {1.0: 7.0}}, {}),
            (3.0, {"a": {1.0: 9.0}}, {1.0: 2.0}),
        ],
    ),
}


@pytest.mark.parametrize("case", list(WINDOWS))
def test_histogram_window(case: str) -> None:
    window_s, rounds = WINDOWS[case]
    window = HistogramWindow(window_s)
    for now, readings, total in rounds:
        window.add(now, readings)
        assert window.total(now) == total, now


def test_endpoints_not_read_within_the_window_are_forgotten() -> None:
    window = HistogramWindow(10.0)
    window.add(0.0, {"a": {1.0: 1.0}, "b": {1.0: 1.0}})
    assert len(window) == 2
    window.add(5.0, {"a": {1.0: 1.0}})
    assert len(window) == 2
    window.add(10.0, {"a": {1.0: 1.0}})
    assert len(window) == 1  # b, last read at 0, is window_s old
