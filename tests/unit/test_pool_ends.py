"""How admitted requests ended lately (``extproc.pool.ends``): counts and the abandoned share
of their slot time over a window, in one-second bins, and the memory they keep."""

from __future__ import annotations

import pytest

from extproc.pool.ends import KEEP_S, Ends


def test_the_abandoned_share_is_of_the_slot_time_of_the_window() -> None:
    e = Ends()
    assert e.count(0.0, 10.0) == (0, 0.0)
    for t in range(20):  # one end a second, each held 1 s; every fourth abandoned after 3 s
        e.record(float(t) + 0.5, 3.0 if t % 4 == 0 else 1.0, t % 4 == 0)
    ended, share = e.count(20.0, 20.0)
    assert ended == 20 and share == pytest.approx(15 / 30)  # 5 x 3 s of 15 x 1 + 5 x 3
    # The last 10 s in whole bins: bins 9..19 (one bin more than asked at most): 12, 16.
    ended, share = e.count(19.9, 10.0)
    assert ended == 11 and share == pytest.approx(6 / 15)
    assert e.count(100.0, 10.0) == (0, 0.0)  # nothing lately


def test_one_long_answer_abandoned_weighs_more_than_many_short_ones_served() -> None:
    e = Ends()
    for _ in range(90):
        e.record(5.2, 1.0, False)
    e.record(5.9, 30.0, True)  # an answer abandoned after 30 s of decoding
    ended, share = e.count(6.0, 2.0)
    assert ended == 91 and share == pytest.approx(30 / 120)
    zero = Ends()
    zero.record(1.0, 0.0, True)  # held no time at all: no share to speak of
    assert zero.count(1.0, 2.0) == (1, 0.0)


def test_memory_is_bounded_by_time_not_by_requests() -> None:
    e = Ends()
    for t in range(10_000):  # nobody counts (no adaptive limit): the bins still go
        e.record(float(t), 1.0, False)
    assert len(e._bins) <= KEEP_S + 2
    e.count(10_000.0, 300.0)  # a longer window keeps more from now on
    for t in range(10_000, 11_000):
        e.record(float(t), 1.0, True)
    assert len(e._bins) <= 302
    assert e.count(11_000.0, 300.0) == (300, 1.0)


def test_answers_past_their_clients_own_short_deadline_are_left_out() -> None:
    """A deadline the client stated, sooner than its bucket's queue timeout
    (``Ticket.client_deadline``), is the client's impatience, not the pool's doing: its answer
    is left out of the count and the share, so it cannot cut the limit for everyone. One past
    the route's deadline, or past a client's no sooner than the queue timeout, counts."""
    e = Ends()
    for _ in range(30):
        e.record(1.0, 2.0, True, client_deadline=True)
    e.record(1.0, 2.0, True)
    e.record(1.0, 2.0, False)
    e.record(1.0, 4.0, False, client_deadline=True)
    assert e.count(2.0, 10.0) == (2, 0.5)
