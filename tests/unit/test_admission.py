"""Tier 1: the admission core with plain numbers for time. No event loop, no sleeps."""

from __future__ import annotations

import random

import pytest

from extproc.pool.core.admission import Admission
from extproc.pool.core.values import Entry, Verdict


def core(capacity: int = 1, max_queue: int = 10) -> Admission:
    return Admission({"b": (capacity, max_queue)})


def stats(a: Admission, bucket: str = "b") -> tuple[int, int]:
    s = a.statistics()[bucket]
    return s.in_flight, s.queued


def test_fast_path_until_capacity_then_queue_then_full() -> None:
    a = core(capacity=2, max_queue=1)
    verdicts = [a.enqueue(Entry(bucket="b", timeout_s=5.0), 0.0).verdict for _ in range(4)]
    assert verdicts == [Verdict.ADMITTED, Verdict.ADMITTED, Verdict.QUEUED, Verdict.QUEUE_FULL]
    assert stats(a) == (2, 1)
    assert repr(a.statistics()["b"]) == "b 2/2 +1 queued"


def test_fifo_hand_over_on_release() -> None:
    a = core(capacity=1)
    first = a.enqueue(Entry(bucket="b", timeout_s=5.0), 0.0).ticket
    waiting = [a.enqueue(Entry(bucket="b", timeout_s=5.0), float(i)).ticket for i in range(1, 4)]
    assert a.release(first.id, 4.0) == [waiting[0]]
    assert a.release(waiting[0].id, 4.5) == [waiting[1]]
    assert a.release(waiting[1].id, 4.6) == [waiting[2]]
    assert a.release(waiting[2].id, 4.7) == []
    assert stats(a) == (0, 0)


def test_no_queue_jumping_while_someone_waits() -> None:
    a = core(capacity=1)
    first = a.enqueue(Entry(bucket="b", timeout_s=5.0), 0.0).ticket
    second = a.enqueue(Entry(bucket="b", timeout_s=5.0), 0.0).ticket
    # The slot is freed and handed to `second` in the same call; a newcomer must queue.
    assert a.release(first.id, 1.0) == [second]
    assert a.enqueue(Entry(bucket="b", timeout_s=5.0), 1.0).verdict is Verdict.QUEUED


def test_release_is_exactly_once() -> None:
    a = core(capacity=1)
    first = a.enqueue(Entry(bucket="b", timeout_s=5.0), 0.0).ticket
    second = a.enqueue(Entry(bucket="b", timeout_s=5.0), 0.0).ticket
    assert a.release(first.id, 1.0) == [second]
    # A second release of the same ticket must not free `second`'s slot.
    assert a.release(first.id, 1.0) == []
    assert stats(a) == (1, 0)
    assert a.cancel(first.id, 1.0) == []
    assert stats(a) == (1, 0)


def test_deadline_eviction_is_by_deadline_not_queue_position() -> None:
    a = Admission({"b": (1, 10)})
    a.enqueue(Entry(bucket="b", timeout_s=100.0), 0.0)  # holds the slot
    # Head of queue, late deadline
    long_wait = a.enqueue(Entry(bucket="b", timeout_s=10.0), 0.0).ticket
    # Behind it, early deadline (deadline 3.0)
    short_wait = a.enqueue(Entry(bucket="b", timeout_s=2.0), 1.0).ticket
    assert a.next_deadline() == 3.0
    assert a.expire(2.999) == []
    assert a.expire(3.0) == [short_wait]
    assert a.next_deadline() == 10.0
    assert a.expire(10.0) == [long_wait]
    assert a.next_deadline() is None
    assert stats(a) == (1, 0)


def test_expire_evicts_all_due_in_deadline_order_across_buckets() -> None:
    a = Admission({"x": (1, 10), "y": (1, 10)})
    a.enqueue(Entry(bucket="x", timeout_s=99.0), 0.0)
    a.enqueue(Entry(bucket="y", timeout_s=99.0), 0.0)
    t1 = a.enqueue(Entry(bucket="y", timeout_s=2.0), 0.0).ticket
    t2 = a.enqueue(Entry(bucket="x", timeout_s=1.0), 0.0).ticket
    t3 = a.enqueue(Entry(bucket="x", timeout_s=5.0), 0.0).ticket
    assert a.expire(2.5) == [t2, t1]
    assert a.statistics()["x"].queued == 1 and a.statistics()["y"].queued == 0
    assert a.expire(5.0) == [t3]


def test_a_client_deadline_that_passes_is_counted_apart_from_evictions() -> None:
    """A ticket whose deadline is its client's own leaves at it like any other (rule 3), but
    counts as ``client_expired_total``, not ``evicted_total`` (the overload monitor reads
    only the evictions)."""
    a = core(capacity=1)
    holder = a.enqueue(Entry(bucket="b", timeout_s=100.0), 0.0).ticket
    own = a.enqueue(Entry(bucket="b", timeout_s=0.5, client_deadline=True), 0.0).ticket
    bucket = a.enqueue(Entry(bucket="b", timeout_s=1.0), 0.0).ticket
    assert own.client_deadline and not bucket.client_deadline
    assert a.expire(0.5) == [own]
    assert a.expire(1.0) == [bucket]
    s = a.statistics()["b"]
    assert (s.evicted_total, s.client_expired_total, s.admitted_total) == (1, 1, 1)
    # Admitted before it passes: an admission like any other.
    late = a.enqueue(Entry(bucket="b", timeout_s=0.5, client_deadline=True), 1.0).ticket
    assert a.release(holder.id, 1.2) == [late]
    assert a.statistics()["b"].admitted_total == 2 and a.ticket(late.id) == late
    assert a.expire(2.0) == []
    s = a.statistics()["b"]
    assert (s.evicted_total, s.client_expired_total) == (1, 1)


def test_admitted_waiter_is_not_evicted_later() -> None:
    a = core(capacity=1)
    first = a.enqueue(Entry(bucket="b", timeout_s=5.0), 0.0).ticket
    second = a.enqueue(Entry(bucket="b", timeout_s=1.0), 0.0).ticket
    assert a.release(first.id, 0.5) == [second]
    assert a.expire(10.0) == []
    assert a.next_deadline() is None
    assert stats(a) == (1, 0)


def test_cancel_while_queued_leaves_at_once_and_keeps_order() -> None:
    a = core(capacity=1)
    first = a.enqueue(Entry(bucket="b", timeout_s=5.0), 0.0).ticket
    gone = a.enqueue(Entry(bucket="b", timeout_s=5.0), 0.0).ticket
    stays = a.enqueue(Entry(bucket="b", timeout_s=5.0), 0.0).ticket
    assert a.cancel(gone.id, 1.0) == []
    assert stats(a) == (1, 1)
    assert a.release(first.id, 2.0) == [stays]
    assert a.expire(100.0) == []


def test_cancel_of_running_ticket_releases_and_wakes_next() -> None:
    """The cancel-after-wake race: the waiter was handed a slot but its task was cancelled
    before it resumed. Cancelling it must pass the slot on."""
    a = core(capacity=1)
    first = a.enqueue(Entry(bucket="b", timeout_s=5.0), 0.0).ticket
    woken = a.enqueue(Entry(bucket="b", timeout_s=5.0), 0.0).ticket
    nxt = a.enqueue(Entry(bucket="b", timeout_s=5.0), 0.0).ticket
    assert a.release(first.id, 1.0) == [woken]
    assert a.cancel(woken.id, 1.0) == [nxt]
    assert stats(a) == (1, 0)


def test_queue_full_holds_nothing() -> None:
    a = core(capacity=1, max_queue=0)
    a.enqueue(Entry(bucket="b", timeout_s=5.0), 0.0)
    d = a.enqueue(Entry(bucket="b", timeout_s=5.0), 0.0)
    assert d.verdict is Verdict.QUEUE_FULL
    assert a.release(d.ticket.id, 1.0) == [] and a.cancel(d.ticket.id, 1.0) == []
    assert stats(a) == (1, 0)


def test_raising_capacity_admits_waiters_lowering_lets_running_finish() -> None:
    a = core(capacity=1)
    running = [a.enqueue(Entry(bucket="b", timeout_s=5.0), 0.0).ticket]
    waiting = [a.enqueue(Entry(bucket="b", timeout_s=5.0), 0.0).ticket for _ in range(3)]
    assert a.set_limits("b", 3, 10, now=1.0) == waiting[:2]
    assert stats(a) == (3, 1)
    assert a.set_limits("b", 1, 10, now=1.0) == []
    assert stats(a) == (3, 1)  # nobody is thrown out
    assert a.release(running[0].id, 2.0) == []  # 2 running >= capacity 1
    assert a.release(waiting[0].id, 2.0) == []
    assert a.release(waiting[1].id, 2.0) == [waiting[2]]


def test_drain_estimate_uses_mean_hold() -> None:
    a = core(capacity=2)
    assert a.drain_estimate_s("b", default_hold_s=4.0) == pytest.approx(2.0)  # (0+1)*4/2
    t = a.enqueue(Entry(bucket="b", timeout_s=5.0), 0.0).ticket
    a.release(t.id, 3.0)  # first hold: 3s
    assert a.statistics()["b"].mean_hold_s == pytest.approx(3.0)
    a.enqueue(Entry(bucket="b", timeout_s=5.0), 3.0)
    a.enqueue(Entry(bucket="b", timeout_s=5.0), 3.0)
    for _ in range(3):
        a.enqueue(Entry(bucket="b", timeout_s=5.0), 3.0)
    assert a.drain_estimate_s("b", default_hold_s=4.0) == pytest.approx(4 * 3.0 / 2)


def test_heap_stays_bounded_when_waiters_are_admitted_early() -> None:
    a = core(capacity=1, max_queue=10_000)
    holder = a.enqueue(Entry(bucket="b", timeout_s=1e6), 0.0).ticket
    for i in range(5000):
        t = a.enqueue(Entry(bucket="b", timeout_s=1e6), float(i)).ticket
        admitted = a.release(holder.id, float(i))
        assert admitted == [t]
        holder = t
    assert len(a._deadlines.heap) <= 200  # stale entries were compacted away


@pytest.mark.parametrize("seed", range(20))
def test_random_operations_keep_invariants(seed: int) -> None:
    """A random mix of enqueue/release/cancel/expire/set_limits: no slot is lost or
    duplicated, and in_flight never exceeds capacity unless capacity was lowered."""
    rng = random.Random(seed)
    a = Admission({"x": (2, 5), "y": (1, 3)})
    capacity = {"x": 2, "y": 1}
    running: set[int] = set()
    waiting: dict[int, str] = {}
    now = 0.0
    for _ in range(600):
        now += rng.random()
        op = rng.random()
        if op < 0.4:
            bucket = rng.choice("xy")
            d = a.enqueue(Entry(bucket=bucket, timeout_s=rng.uniform(0.5, 4)), now)
            if d.verdict is Verdict.ADMITTED:
                running.add(d.ticket.id)
            elif d.verdict is Verdict.QUEUED:
                waiting[d.ticket.id] = bucket
        elif op < 0.65 and running:
            tid = rng.choice(sorted(running))
            running.discard(tid)
            woken = a.release(tid, now)
            for t in woken:
                waiting.pop(t.id)
                running.add(t.id)
        elif op < 0.8 and (running or waiting):
            tid = rng.choice(sorted(running | set(waiting)))
            running.discard(tid)
            waiting.pop(tid, None)
            for t in a.cancel(tid, now):
                waiting.pop(t.id)
                running.add(t.id)
        elif op < 0.95:
            for t in a.expire(now):
                assert t.deadline <= now
                waiting.pop(t.id)
        else:
            bucket = rng.choice("xy")
            capacity[bucket] = rng.randint(1, 3)
            for t in a.set_limits(bucket, capacity[bucket], 5, now):
                waiting.pop(t.id)
                running.add(t.id)
        st = a.statistics()
        assert sum(s.in_flight for s in st.values()) == len(running)
        assert sum(s.queued for s in st.values()) == len(waiting)
        for s in st.values():
            if s.queued:  # a waiter exists only while the bucket is at capacity
                assert s.in_flight >= s.capacity
    # Drain: everything given back leaves nothing behind.
    for tid in list(waiting):
        assert a.cancel(tid, now) == []
    for tid in running:
        assert a.release(tid, now) == []
    assert all(s.in_flight == 0 and s.queued == 0 for s in a.statistics().values())


def test_queued_bytes_bound_refuses_at_once_and_counts_only_waiters() -> None:
    a = Admission({"x": (1, 10), "y": (1, 10)}, max_queued_bytes=100)
    running_x = a.enqueue(Entry(bucket="x", timeout_s=5.0, held_bytes=1_000), 0.0)
    assert running_x.verdict is Verdict.ADMITTED  # the fast path counts nothing
    assert (
        a.enqueue(Entry(bucket="y", timeout_s=5.0, held_bytes=1_000), 0.0).verdict
        is Verdict.ADMITTED
    )
    first = a.enqueue(Entry(bucket="x", timeout_s=5.0, held_bytes=60), 0.0)
    assert first.verdict is Verdict.QUEUED
    # 60 + 50 > 100 across buckets: refused at once, holding nothing.
    assert (
        a.enqueue(Entry(bucket="y", timeout_s=5.0, held_bytes=50), 0.0).verdict
        is Verdict.QUEUE_FULL
    )
    second = a.enqueue(Entry(bucket="y", timeout_s=5.0, held_bytes=40), 0.0)
    assert second.verdict is Verdict.QUEUED and a.queued_bytes == 100
    st = a.statistics()
    assert (st["x"].queued_bytes, st["y"].queued_bytes) == (60, 40)
    # Admitted by a hand-over: its bytes leave the count.
    assert a.release(running_x.ticket.id, 1.0) == [first.ticket] and a.queued_bytes == 40
    # Evicted and cancelled waiters give their bytes back too.
    assert a.enqueue(Entry(bucket="x", timeout_s=0.5, held_bytes=30), 1.0).verdict is Verdict.QUEUED
    assert a.queued_bytes == 70
    assert [t.held_bytes for t in a.expire(2.0)] == [30] and a.queued_bytes == 40
    assert a.cancel(second.ticket.id, 2.0) == [] and a.queued_bytes == 0


@pytest.mark.parametrize("seed", range(10))
def test_random_operations_keep_queued_bytes_exact(seed: int) -> None:
    rng = random.Random(seed)
    a = Admission({"x": (2, 5), "y": (1, 3)}, max_queued_bytes=500)
    running: set[int] = set()
    waiting: dict[int, int] = {}  # ticket id -> bytes
    now = 0.0
    for _ in range(600):
        now += rng.random()
        op = rng.random()
        if op < 0.45:
            size = rng.randint(0, 200)
            d = a.enqueue(
                Entry(bucket=rng.choice("xy"), timeout_s=rng.uniform(0.5, 4), held_bytes=size), now
            )
            if d.verdict is Verdict.ADMITTED:
                running.add(d.ticket.id)
            elif d.verdict is Verdict.QUEUED:
                waiting[d.ticket.id] = size
        elif op < 0.7 and running:
            tid = rng.choice(sorted(running))
            running.discard(tid)
            for t in a.release(tid, now):
                assert waiting.pop(t.id) == t.held_bytes
                running.add(t.id)
        elif op < 0.85 and waiting:
            tid = rng.choice(sorted(waiting))
            del waiting[tid]
            assert a.cancel(tid, now) == []
        else:
            for t in a.expire(now):
                assert waiting.pop(t.id) == t.held_bytes
        assert a.queued_bytes == sum(waiting.values()) <= 500
        assert sum(s.queued_bytes for s in a.statistics().values()) == a.queued_bytes
