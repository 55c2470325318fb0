"""How admitted requests ended lately (``extproc.pool.ends``): counts over a window, in
one-second bins, and the memory they keep."""

from __future__ import annotations

from extproc.pool.ends import KEEP_S, Ends


def test_counts_the_ends_and_the_abandoned_of_the_window() -> None:
    e = Ends()
    assert e.count(0.0, 10.0) == (0, 0)
    for t in range(20):  # one end a second, every fourth abandoned
        e.record(float(t) + 0.5, t % 4 == 0)
    assert e.count(20.0, 20.0) == (20, 5)
    # The last 10 s in whole bins: bins 9..19 (one bin more than asked at most).
    assert e.count(19.9, 10.0) == (11, 2)  # 12 and 16
    assert e.count(100.0, 10.0) == (0, 0)  # nothing lately


def test_several_ends_in_one_bin() -> None:
    e = Ends()
    for _ in range(1000):
        e.record(5.2, False)
    e.record(5.9, True)
    assert e.count(6.0, 2.0) == (1001, 1)


def test_memory_is_bounded_by_time_not_by_requests() -> None:
    e = Ends()
    for t in range(10_000):  # nobody counts (no adaptive limit): the bins still go
        e.record(float(t), False)
    assert len(e._bins) <= KEEP_S + 2
    e.count(10_000.0, 300.0)  # a longer window keeps more from now on
    for t in range(10_000, 11_000):
        e.record(float(t), True)
    assert len(e._bins) <= 302
    assert e.count(11_000.0, 300.0) == (300, 300)
