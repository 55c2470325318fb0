"""The pool's named decisions, table-driven: the order within a bucket and the choice across
buckets, each class alone, then plugged into the core. Pure: no event loop."""

from __future__ import annotations

import pytest

from extproc.config.policy import Order
from extproc.pool.core.admission import Admission
from extproc.pool.core.fair import FairOrder
from extproc.pool.core.order import (
    COST_EWMA_ALPHA,
    QUEUE_ORDERS,
    BucketChoice,
    CostKey,
    CostOrder,
    FifoOrder,
    GuaranteeBandHead,
    HeapOrder,
)
from extproc.pool.core.state import BucketState, PoolState
from extproc.pool.core.values import Entry, Ticket, Verdict
from testing.buckets import rule


def ticket(at: float = 0.0, cost: int = 0, tid: int = 1) -> Ticket:
    return Ticket(id=tid, bucket="b", enqueued_at=at, deadline=at + 10.0, cost=cost)


def test_the_policy_order_maps_to_one_class_each() -> None:
    made = {order: type(new()) for order, new in QUEUE_ORDERS.items()}
    assert made == {Order.FIFO: FifoOrder, Order.COST: CostOrder, Order.FAIR: FairOrder}
    assert set(QUEUE_ORDERS) == set(Order)
    fair = QUEUE_ORDERS[Order.FAIR]()
    assert isinstance(fair, FairOrder) and isinstance(fair.within, CostKey)


@pytest.mark.parametrize(
    ("at", "cost", "timeout", "key"),
    [(0.0, 0, 10.0, 0.0), (3.5, 10_000, 10.0, 3.5), (7.0, 1, 0.0, 7.0)],
)
def test_fifo_keys_by_arrival_alone(at: float, cost: int, timeout: float, key: float) -> None:
    assert FifoOrder().key(ticket(at, cost), timeout) == key


@pytest.mark.parametrize(
    ("costs", "keys"),
    [
        # The first request is its own mean: keyed a quarter of its timeout after arrival.
        ([100], [2.5]),
        # Free requests are never delayed.
        ([0, 0], [0.0, 0.0]),
        # Then the running mean moves 5 % towards each new cost: c0 = 100 -> 100 + 0.05 x 9900.
        ([100, 10_000], [2.5, 5 * 10_000 / (10_000 + 100)]),
        # A cheap one after an expensive one: keyed far earlier.
        ([10_000, 10], [2.5, 5 * 10 / (10 + 10_000)]),
    ],
)
def test_cost_keys_delay_by_relative_cost(costs: list[int], keys: list[float]) -> None:
    order = CostOrder()
    got = [order.key(ticket(0.0, c), 10.0) for c in costs]
    assert got == pytest.approx(keys)
    mean = float(costs[0])
    for c in costs[1:]:
        mean += COST_EWMA_ALPHA * (c - mean)
    assert order.mean_cost == pytest.approx(mean)


def test_cost_delay_is_at_most_half_the_timeout() -> None:
    order = CostOrder()
    order.key(ticket(0.0, 1), 10.0)
    assert order.key(ticket(0.0, 10**9), 10.0) == pytest.approx(5.0, abs=1e-6)


def bucket(priority: int, running: int, min_share: float) -> BucketState:
    b = BucketState("b", PoolState("p", 10), rule("b", priority=priority, min_share=min_share))
    for i in range(running):
        b.running[i] = (ticket(tid=i), 0.0)
    return b


@pytest.mark.parametrize(
    ("priority", "running", "min_share", "head", "rank"),
    [
        (5, 0, 0.2, 3.0, (0, 5, 3.0)),  # below its guarantee of 2: first
        (5, 2, 0.2, 3.0, (1, 5, 3.0)),  # at its guarantee: by band
        (0, 9, 0.0, 1.0, (1, 0, 1.0)),  # no guarantee: by band, then head
    ],
)
def test_guarantee_band_head_ranks(
    priority: int, running: int, min_share: float, head: float, rank: tuple[float, ...]
) -> None:
    assert GuaranteeBandHead().rank(bucket(priority, running, min_share), head, 10) == rank


def test_a_new_choice_is_a_class_the_core_takes() -> None:
    """Earliest head first, whatever the band: the core's fill loop is unchanged."""

    class EarliestHead(BucketChoice):
        def rank(self, bucket: BucketState, head_key: float, limit: int) -> tuple[float, ...]:
            return (head_key,)

    for choice, first in ((None, "hi"), (EarliestHead(), "lo")):
        a = Admission({})
        a.set_pool("p", 1, 0.0, choice=choice)
        a.set_bucket("p", rule("hi", max_queue=5, priority=0), 0.0)
        a.set_bucket("p", rule("lo", max_queue=5, priority=10), 0.0)
        holder = a.enqueue(Entry(bucket="hi", timeout_s=10.0), 0.0).ticket
        lo = a.enqueue(Entry(bucket="lo", timeout_s=10.0), 1.0).ticket
        hi = a.enqueue(Entry(bucket="hi", timeout_s=10.0), 2.0).ticket
        assert a.release(holder.id, 3.0) == [hi if first == "hi" else lo]


def test_a_fair_order_hears_its_bucket_admissions_and_departures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bucket's one hook (``BucketState.fair``): its fair order hears each admission (with
    the head's key) and each waiter that leaves unserved; a heap order hears nothing."""
    heard: list[tuple[str, int]] = []

    class Heard(FairOrder):
        def admitted(self, ticket: Ticket, key: float, now: float) -> None:
            heard.append(("admitted", ticket.id))
            super().admitted(ticket, key, now)

        def left(self, ticket: Ticket) -> None:
            heard.append(("left", ticket.id))
            super().left(ticket)

    a = Admission({"b": (1, 5)})
    monkeypatch.setitem(QUEUE_ORDERS, Order.FAIR, lambda: Heard(CostKey()))
    a._buckets["b"].configure(rule("b", max_queue=5, order=Order.FAIR))
    assert a._buckets["b"].fair is a._buckets["b"].order
    first = a.enqueue(Entry(bucket="b", timeout_s=10.0), 0.0)
    second = a.enqueue(Entry(bucket="b", timeout_s=10.0), 1.0)
    third = a.enqueue(Entry(bucket="b", timeout_s=10.0), 1.0)
    assert (first.verdict, second.verdict) == (Verdict.ADMITTED, Verdict.QUEUED)
    a.cancel(third.ticket.id, 1.5)
    a.release(first.ticket.id, 2.0)
    assert heard == [
        ("admitted", first.ticket.id),
        ("left", third.ticket.id),
        ("admitted", second.ticket.id),
    ]


def test_the_same_order_class_keeps_its_state_across_a_reconfiguration() -> None:
    b = bucket(0, 0, 0.0)
    b.configure(rule("b", max_queue=10, order=Order.COST))
    order = b.order
    assert isinstance(order, CostOrder)
    order.key(ticket(0.0, 500), 1.0)
    b.configure(rule("b", max_queue=20, order=Order.COST))
    assert b.order is order and order.mean_cost == 500.0 and b.fair is None
    b.configure(rule("b", max_queue=20, order=Order.FAIR))
    fair = b.order
    assert isinstance(fair, FairOrder) and b.fair is fair
    b.configure(rule("b", max_queue=20, order=Order.FAIR))
    assert b.order is fair
    b.configure(rule("b", max_queue=20))
    assert isinstance(b.order, FifoOrder) and b.fair is None


def test_the_base_classes_name_the_one_method_to_write() -> None:
    with pytest.raises(NotImplementedError):
        HeapOrder().key(ticket(), 1.0)
    with pytest.raises(NotImplementedError):
        BucketChoice().rank(bucket(0, 0, 0.0), 0.0, 1)
