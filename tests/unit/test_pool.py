"""The shared pool of the admission core: bands, shares, the token bound, queue order, the
predicted wait, and the invariants under random operations. Pure: plain numbers for time."""

from __future__ import annotations

import random

import pytest

from extproc.config.policy import Order, TenantPolicy
from extproc.pool.core.admission import Admission
from extproc.pool.core.fair import FairOrder
from extproc.pool.core.relegate import Relegation
from extproc.pool.core.values import Entry, Ticket, Verdict
from testing.buckets import rule

POOL = "p"


def pool(limit: int, *, max_tokens: int | None = None, fail_fast: bool = False) -> Admission:
    a = Admission({})
    a.set_pool(POOL, limit, 0.0, max_tokens=max_tokens, fail_fast=fail_fast)
    return a


def bucket(a: Admission, name: str, **kw: object) -> None:
    kw.setdefault("max_queue", 100)
    a.set_bucket(POOL, rule(name, **kw), 0.0)  # type: ignore[arg-type]


def admit(
    a: Admission, name: str, now: float = 0.0, cost: int = 0, timeout: float = 10.0
) -> Ticket:
    d = a.enqueue(Entry(bucket=name, timeout_s=timeout, cost=cost), now)
    assert d.verdict is Verdict.ADMITTED, d
    return d.ticket


def queue(
    a: Admission, name: str, now: float = 0.0, cost: int = 0, timeout: float = 10.0
) -> Ticket:
    d = a.enqueue(Entry(bucket=name, timeout_s=timeout, cost=cost), now)
    assert d.verdict is Verdict.QUEUED, d
    return d.ticket


def test_idle_capacity_is_borrowed_by_whoever_waits() -> None:
    a = pool(4)
    bucket(a, "hi", priority=0)
    bucket(a, "lo", priority=10)
    held = [admit(a, "lo") for _ in range(4)]  # nobody else wants it: lo takes the whole pool
    assert a.pool_statistics(0.0)[POOL].in_flight == 4
    queue(a, "lo")
    assert a.statistics()["lo"].in_flight == 4 and held


def test_a_freed_slot_goes_to_the_most_urgent_band_then_fifo() -> None:
    a = pool(1)
    bucket(a, "hi", priority=0)
    bucket(a, "lo", priority=10)
    first = admit(a, "lo")
    lo_waiting = queue(a, "lo", now=1.0)
    hi1 = queue(a, "hi", now=2.0)
    hi2 = queue(a, "hi", now=3.0)
    assert a.release(first.id, 4.0) == [hi1]  # hi came later but is more urgent
    assert a.release(hi1.id, 5.0) == [hi2]
    assert a.release(hi2.id, 6.0) == [lo_waiting]


def test_same_band_is_fifo_across_buckets() -> None:
    a = pool(1)
    bucket(a, "x", priority=5)
    bucket(a, "y", priority=5)
    t = admit(a, "x")
    y = queue(a, "y", now=1.0)
    x = queue(a, "x", now=2.0)
    assert a.release(t.id, 3.0) == [y]
    assert a.release(y.id, 4.0) == [x]


def test_a_band_below_its_guaranteed_share_goes_first() -> None:
    a = pool(4)
    bucket(a, "hi", priority=0)
    bucket(a, "lo", priority=10, min_share=0.5)  # 2 of 4 guaranteed
    hi = [admit(a, "hi") for _ in range(4)]
    lo1 = queue(a, "lo", now=1.0)
    lo2 = queue(a, "lo", now=1.0)
    lo3 = queue(a, "lo", now=1.0)
    his = [queue(a, "hi", now=0.5) for _ in range(3)]
    # lo holds 0 < 2 guaranteed: it gets the next two slots despite hi's earlier, more urgent
    # waiters; then hi again.
    assert a.release(hi[0].id, 2.0) == [lo1]
    assert a.release(hi[1].id, 2.0) == [lo2]
    assert a.release(hi[2].id, 2.0) == [his[0]]
    assert lo3.id not in [t.id for t in a.release(hi[3].id, 2.0)]


def test_max_share_caps_a_bucket_and_the_rest_stays_for_others() -> None:
    a = pool(10)
    bucket(a, "batch", priority=10, max_share=0.7)
    for _ in range(7):
        admit(a, "batch")
    queue(a, "batch")
    assert a.statistics()["batch"].capacity == 7
    bucket(a, "chat", priority=0)
    for _ in range(3):
        admit(a, "chat")  # the three slots batch may not take
    queue(a, "chat")


def test_absolute_cap_applies_with_the_share() -> None:
    a = pool(10)
    bucket(a, "b", cap=2)
    admit(a, "b")
    admit(a, "b")
    queue(a, "b")


def test_cut_holds_lower_bands_to_their_guaranteed_share_then_steps_back() -> None:
    a = pool(11)
    bucket(a, "hi", priority=0)
    bucket(a, "lo", priority=10, min_share=0.2, max_share=10 / 11)
    a.set_cut(POOL, 0.0, 0.0)
    admit(a, "hi")  # the protected band is busy: the cut applies
    admit(a, "lo")
    admit(a, "lo")
    queue(a, "lo")  # cut to its guaranteed 2
    assert a.statistics()["lo"].capacity == 2
    admitted = a.set_cut(POOL, 0.5, 1.0)  # 50 %: 5 of its usual 10
    assert len(admitted) == 1 and a.statistics()["lo"].capacity == 5
    for _ in range(2):
        admit(a, "lo")
    queue(a, "lo")
    assert len(a.set_cut(POOL, 1.0, 2.0)) == 1  # back to 10: the last waiter goes in
    for _ in range(4):
        admit(a, "hi")  # the most urgent band is never cut: it takes the other 4
    queue(a, "hi")


def test_no_cut_while_the_protected_bands_are_idle() -> None:
    """Overloaded, but nothing more urgent runs or waits: the cut would only idle the pool."""
    a = pool(10)
    bucket(a, "hi", priority=0)
    bucket(a, "lo", priority=10)
    a.set_cut(POOL, 0.0, 0.0)
    lo = [admit(a, "lo") for _ in range(10)]
    hi = queue(a, "hi")
    late = queue(a, "lo")
    assert a.release(lo[0].id, 1.0) == [hi]  # now the cut holds lo (min share 0)
    assert a.release(lo[1].id, 1.0) == []
    assert a.release(hi.id, 2.0) == [late]  # hi idle again: lo may use the pool


def test_token_bound_binds_before_the_slot_limit() -> None:
    a = pool(10, max_tokens=1000)
    bucket(a, "b")
    t1 = admit(a, "b", cost=600)
    t2 = queue(a, "b", cost=600)  # 1200 > 1000
    small = queue(a, "b", cost=10)  # may not pass the blocked head
    assert a.pool_statistics(0.0)[POOL].tokens_in_flight == 600
    assert a.release(t1.id, 1.0) == [t2, small]
    assert a.pool_statistics(1.0)[POOL].tokens_in_flight == 610


def test_an_oversize_request_runs_alone() -> None:
    a = pool(10, max_tokens=100)
    bucket(a, "b")
    big = admit(a, "b", cost=5000)  # an empty pool admits anything
    nxt = queue(a, "b", cost=1)
    assert a.release(big.id, 1.0) == [nxt]


def test_a_blocked_head_that_leaves_lets_the_next_in() -> None:
    a = pool(10, max_tokens=1000)
    bucket(a, "b")
    admit(a, "b", cost=900)
    blocked = queue(a, "b", cost=500, timeout=1.0)
    small = queue(a, "b", cost=50, timeout=10.0)
    assert a.cancel(blocked.id, 0.5) == [small]
    a2 = pool(10, max_tokens=1000)
    bucket(a2, "b")
    admit(a2, "b", cost=900)
    queue(a2, "b", cost=500, timeout=1.0)
    small2 = queue(a2, "b", cost=50, timeout=10.0)
    assert len(a2.expire(1.0)) == 1
    assert a2.take_admitted() == [small2]


def test_cost_order_serves_cheap_first_with_bounded_delay() -> None:
    a = pool(1)
    bucket(a, "b", order=Order.COST)
    t = admit(a, "b", cost=100)
    big = queue(a, "b", now=0.0, cost=10_000, timeout=10.0)  # delay <= 5 s
    cheap = queue(a, "b", now=1.0, cost=10, timeout=10.0)
    late = queue(a, "b", now=6.0, cost=10, timeout=10.0)  # arrived > 5 s after big
    assert a.release(t.id, 7.0) == [cheap]
    assert a.release(cheap.id, 7.0) == [big]
    assert a.release(big.id, 7.0) == [late]


def test_fail_fast_refuses_at_once_when_the_wait_cannot_fit() -> None:
    a = pool(2, fail_fast=True)
    bucket(a, "b")
    now = 0.0
    # Teach the pool its release rate: 2 slots freed per second.
    for _ in range(10):
        x, y = admit(a, "b", now), admit(a, "b", now)
        now += 1.0
        a.release(x.id, now)
        a.release(y.id, now)
    rate = a.pool_statistics(now)[POOL].release_rate
    assert rate is not None and 1.5 < rate < 2.5
    admit(a, "b", now)
    admit(a, "b", now)
    for _ in range(5):
        queue(a, "b", now, timeout=10.0)  # the 5th needs about 3 s
    d = a.enqueue(Entry(bucket="b", timeout_s=1.0), now)  # 6 ahead + itself at 2/s: ~3.5 s > 1 s
    assert d.verdict is Verdict.WAIT_TOO_LONG
    assert 2.5 < d.predicted_wait_s < 4.5
    assert a.statistics()["b"].queued == 5  # nothing held
    assert a.enqueue(Entry(bucket="b", timeout_s=10.0), now).verdict is Verdict.QUEUED


@pytest.mark.parametrize(("order", "cheap"), [(Order.COST, Verdict.QUEUED), (Order.FIFO, None)])
def test_a_predicted_wait_counts_only_what_the_cost_order_puts_ahead(
    order: Order, cheap: Verdict | None
) -> None:
    """fail_fast: behind 20 expensive waiters that came just before (one release a second), a
    cheap request goes ahead of them in the cost order: predicted to wait about one release,
    it is not refused at once, and it is served first. In a fifo bucket it waits for the
    whole queue (every waiter was counted in the cost order too, and the cheap requests it
    would serve first were refused at the door)."""
    a = pool(1, fail_fast=True)
    bucket(a, "b", order=order)
    t = 0.0
    for _ in range(8):  # a release rate: one slot a second
        held = admit(a, "b", t, cost=100)
        t += 1.0
        a.release(held.id, t)
    holder = admit(a, "b", t, cost=100)  # runs
    for _ in range(20):
        queue(a, "b", t, cost=1000, timeout=60.0)
    d = a.enqueue(Entry(bucket="b", timeout_s=5.0, cost=10), t)
    assert d.verdict is (cheap or Verdict.WAIT_TOO_LONG)
    if cheap is not None:  # and the order serves it first, as predicted
        assert a.release(holder.id, t + 1.0) == [d.ticket]


def test_a_cost_ordered_queue_past_the_scan_bound_counts_every_waiter() -> None:
    """Past ``AHEAD_SCAN`` heap entries the count would cost more than the call: every
    waiter counts, as in fifo (the prediction errs towards refusing, within its bound)."""
    from extproc.pool.core.order import AHEAD_SCAN

    a = pool(1, fail_fast=True)
    bucket(a, "b", order=Order.COST, max_queue=AHEAD_SCAN + 10)
    t = 0.0
    for _ in range(8):
        held = admit(a, "b", t, cost=100)
        t += 1.0
        a.release(held.id, t)
    admit(a, "b", t, cost=100)
    for _ in range(AHEAD_SCAN):
        queue(a, "b", t, cost=1000, timeout=1000.0)
    assert a.enqueue(Entry(bucket="b", timeout_s=5.0, cost=10), t).verdict is Verdict.WAIT_TOO_LONG


def test_no_prediction_before_the_rate_is_known() -> None:
    a = pool(1, fail_fast=True)
    bucket(a, "b")
    admit(a, "b")
    for _ in range(50):
        queue(a, "b", timeout=0.001)


def test_moving_buckets_between_own_slots_and_the_pool_keeps_every_count() -> None:
    a = Admission({"x": (2, 10), "y": (2, 10)})
    x1, _ = admit(a, "x"), admit(a, "x")
    y1 = admit(a, "y")
    a.set_pool(POOL, 3, 0.0)
    a.set_bucket(POOL, rule("x", max_queue=10), 0.0)
    a.set_bucket(POOL, rule("y", max_queue=10), 0.0)
    ps = a.pool_statistics(0.0)[POOL]
    assert ps.in_flight == 3
    w = queue(a, "y")
    assert a.release(x1.id, 1.0) == [w]
    a.set_limits("x", 5, 10, now=1.0)  # back to its own slots, with its running request
    a.set_limits("y", 5, 10, now=1.0)
    st = a.statistics()
    assert (st["x"].in_flight, st["y"].in_flight, st["x"].pool) == (1, 2, None)
    assert a.remove_pool(POOL)
    assert a.release(y1.id, 2.0) == []


def test_raising_the_pool_limit_admits_at_once_lowering_takes_nothing_away() -> None:
    a = pool(2)
    bucket(a, "b")
    t = [admit(a, "b"), admit(a, "b")]
    w = [queue(a, "b"), queue(a, "b")]
    assert a.set_pool_limit(POOL, 3, 1.0) == [w[0]]
    assert a.set_pool_limit(POOL, 1, 1.0) == []
    assert a.pool_statistics(1.0)[POOL].in_flight == 3
    for x in (t[0], t[1]):
        assert a.release(x.id, 2.0) == []  # 2 running, limit 1: nobody new
    assert a.release(w[0].id, 2.0) == [w[1]]


@pytest.mark.parametrize("relegate", [False, True])
def test_random_operations_keep_the_invariants(relegate: bool) -> None:
    """No slot lost or given twice, the limit and caps hold, the token bound holds (bar one
    running alone), and nobody waits while the rules would admit them; with ``relegate``, the
    most urgent bucket's waiters relegated once at their deadline
    (``extproc.pool.core.relegate``)."""
    rng = random.Random(7)
    a = Admission({}, max_queued_bytes=5000)
    a.set_pool(POOL, 6, 0.0, max_tokens=3000, fail_fast=True)
    names = ("a", "b", "c")
    for i, name in enumerate(names):
        a.set_bucket(
            POOL,
            rule(
                name,
                max_queue=8,
                priority=(0, 5, 5)[i],
                min_share=(0.0, 0.3, 0.0)[i],
                max_share=(1.0, 1.0, 0.5)[i],
                order=Order.COST if i == 2 else Order.FIFO,
                relegate_to=Relegation(target="c", timeout_s=0.5) if relegate and i == 0 else None,
            ),
            0.0,
        )
    running: set[int] = set()
    waiting: set[int] = set()
    now = 0.0
    for step in range(6000):
        now += rng.random() * 0.2
        op = rng.random()
        admitted: list[Ticket] = []
        if op < 0.45:
            d = a.enqueue(
                Entry(
                    bucket=rng.choice(names),
                    timeout_s=rng.random() * 3,
                    held_bytes=rng.randrange(400),
                    cost=rng.randrange(1200),
                ),
                now,
            )
            if d.verdict is Verdict.ADMITTED:
                running.add(d.ticket.id)
            elif d.verdict is Verdict.QUEUED:
                waiting.add(d.ticket.id)
        elif op < 0.75 and running:
            admitted = a.release(rng.choice(sorted(running)), now)
            running.intersection_update(t for t in running if a.ticket(t) is not None)
        elif op < 0.85 and (running or waiting):
            tid = rng.choice(sorted(running | waiting))
            admitted = a.cancel(tid, now)
            running.discard(tid)
            waiting.discard(tid)
        elif op < 0.9:
            a.set_pool_limit(POOL, rng.randrange(1, 10), now)
            admitted = []
        elif op < 0.93:
            admitted = a.set_cut(POOL, rng.choice((0.0, 0.5, 0.8, 1.0)), now)
        else:
            for t in a.expire(now):
                waiting.discard(t.id)
            admitted = a.take_admitted()
        for t in admitted:
            waiting.discard(t.id)
            running.add(t.id)
        # Tickets admitted by set_pool_limit are found through the core itself.
        for tid in list(waiting):
            t = a.ticket(tid)
            if t is None:
                waiting.discard(tid)
            elif t.relegated_from is not None:
                assert (t.relegated_from, t.bucket) == ("a", "c")  # once, to its target
        st = a.statistics()
        ps = a.pool_statistics(now)[POOL]
        assert ps.in_flight == sum(s.in_flight for s in st.values())
        assert ps.tokens_in_flight == sum(s.tokens_in_flight for s in st.values())
        assert a.queued_bytes == sum(s.queued_bytes for s in st.values()) <= 5000
        if ps.in_flight < ps.limit:
            # Nobody admissible waits: every bucket with waiters is at its cap, or the most
            # highly ranked head is held by the token bound.
            for s in st.values():
                if s.queued and s.in_flight < s.capacity:
                    assert ps.max_tokens is not None and ps.in_flight > 0, (step, st, ps)
    for tid in list(running):
        a.release(tid, now)
    for t in a.expire(now + 100):
        waiting.discard(t.id)
    for t in a.take_admitted():
        a.release(t.id, now + 100)
    leftover = [tid for tid in range(1, 100_000) if a.ticket(tid) is not None]
    for tid in leftover:
        a.cancel(tid, now + 100)
    st = a.statistics()
    assert all(s.in_flight == 0 and s.queued == 0 for s in st.values())
    assert (st["a"].relegated_total > 0) is relegate
    assert a.pool_statistics(now)[POOL].in_flight == 0
    assert a.pool_statistics(now)[POOL].tokens_in_flight == 0
    assert a.queued_bytes == 0


@pytest.mark.parametrize("bad", [{"min_share": 0.6, "max_share": 0.5}, {"max_share": 0.0}])
def test_bad_shares_are_refused(bad: dict[str, float]) -> None:
    a = pool(2)
    with pytest.raises(ValueError):
        bucket(a, "b", **bad)


def heap_entries(a: Admission, name: str) -> int:
    """Entries the bucket's order keeps: its heap, or a fair order's tenants' heaps and
    turns."""
    order = a._buckets[name].order
    if isinstance(order, FairOrder):
        return sum(len(q.heap) for q in order.queues.values()) + len(order.turns)
    return len(order.heap)


@pytest.mark.parametrize("order", list(Order))
def test_refused_and_expired_requests_leave_no_entries_behind_at_limit_zero(order: Order) -> None:
    """At limit 0 (scale from zero, a shared pool without a lease) nobody is admitted, so
    nothing admits the compaction the lazy deletion counts on: every request refused at a full
    queue, and every waiter that reaches its deadline, must still not leave an entry in the
    order's heaps or in the deadlines' heap. Memory stays O(waiters), not O(requests)."""
    a = pool(0)
    tenant = TenantPolicy() if order is Order.FAIR else None
    bucket(a, "b", max_queue=10, order=order, tenant=tenant)
    for i in range(20_000):
        now = i * 0.01
        d = a.enqueue(Entry(bucket="b", timeout_s=1.0, cost=i % 500, tenant=f"t{i % 7}"), now)
        assert d.verdict in (Verdict.QUEUED, Verdict.QUEUE_FULL)
        if i % 50 == 0:
            a.expire(now)  # the waiters past their deadline leave
    assert a.queued("b") == 10
    assert heap_entries(a, "b") <= 2 * 64
    assert len(a._deadlines.heap) <= 2 * 64
