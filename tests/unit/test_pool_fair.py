"""Fairness between tenants within a bucket: the fair order (start-time fair queueing on
weighted tokens) alone and in the core, and the tenants' bounds. Pure: no event loop."""

from __future__ import annotations

import pytest

from extproc.config.policy import Order, TenantPolicy
from extproc.pool.core.admission import Admission
from extproc.pool.core.fair import OUTPUT_WEIGHT, FairOrder
from extproc.pool.core.order import CostKey
from extproc.pool.core.values import Entry, Ticket, Verdict
from testing.buckets import rule


def ticket(tenant: str | None, at: float = 0.0, cost: int = 100, **kw: object) -> Ticket:
    return Ticket(
        id=1, bucket="b", enqueued_at=at, deadline=at + 60, cost=cost, tenant=tenant, **kw
    )  # type: ignore[arg-type]


def pool(limit: int = 1, tenant: TenantPolicy | None = None, max_queue: int = 1000) -> Admission:
    a = Admission({})
    a.set_pool("p", limit, 0.0, fail_fast=False)
    a.set_bucket(
        "p", rule("b", max_queue=max_queue, order=Order.FAIR, tenant=tenant or TenantPolicy()), 0.0
    )
    return a


def drain(a: Admission, holder: int, now: float = 1.0) -> list[str | None]:
    """Release one at a time from ``holder`` on; the tenants in the order they were admitted."""
    order: list[str | None] = []
    while True:
        admitted = a.release(holder, now)
        if not admitted:
            return order
        (t,) = admitted
        order.append(t.tenant)
        holder = t.id


@pytest.mark.parametrize("tenant", ["a", None])
def test_a_tenant_alone_is_served_as_the_cost_order_serves(tenant: str | None) -> None:
    """Within a tenant the fair order is the cost order: cheaper first, an expensive request
    put back by at most half its queue timeout. Alone, a tenant (or the anonymous one) is
    served exactly as ``order: cost`` serves the same requests."""
    costs = [5000, 100, 3000, 100, 800, 100, 20_000, 100, 100, 400]
    served: dict[Order, list[int]] = {}
    for order in (Order.FAIR, Order.COST):
        a = Admission({})
        a.set_pool("p", 1, 0.0, fail_fast=False)
        a.set_bucket("p", rule("b", max_queue=100, order=order, tenant=TenantPolicy()), 0.0)
        holder = a.enqueue(Entry(bucket="b", timeout_s=10, tenant=tenant), 0.0).ticket
        ids: dict[int, int] = {}
        for i, c in enumerate(costs):
            d = a.enqueue(Entry(bucket="b", timeout_s=10, cost=c, tenant=tenant), 0.5 * i)
            ids[d.ticket.id] = c
        served[order] = []
        while admitted := a.release(holder.id, 6.0):
            (holder,) = admitted
            served[order].append(ids[holder.id])
    assert served[Order.FAIR] == served[Order.COST]
    assert served[Order.FAIR][:3] == [100, 100, 100] and served[Order.FAIR] != costs


def test_output_tokens_weigh_more_and_a_weight_divides() -> None:
    """A tenant's finish tag moves, when it is served, by (prompt + 2 x max_tokens) / weight."""
    a = pool(limit=2)
    # 200 prompt + 100 output
    a.enqueue(Entry(bucket="b", timeout_s=60, cost=300, tenant="a", output=100), 0.0)
    a.enqueue(Entry(bucket="b", timeout_s=60, cost=300, tenant="b", weight=2.0, output=100), 0.0)
    order = a._buckets["b"].order
    assert isinstance(order, FairOrder)
    assert order.tags["a"][0] == 300 + (OUTPUT_WEIGHT - 1) * 100
    assert order.tags["b"][0] == (300 + (OUTPUT_WEIGHT - 1) * 100) / 2


def test_a_light_tenant_waits_behind_at_most_one_request_of_a_heavy_queue() -> None:
    a = pool()
    holder = a.enqueue(Entry(bucket="b", timeout_s=60, cost=100, tenant="heavy"), 0.0).ticket
    for _ in range(20):
        a.enqueue(Entry(bucket="b", timeout_s=60, cost=100, tenant="heavy"), 0.0)
    a.enqueue(Entry(bucket="b", timeout_s=60, cost=100, tenant="light"), 0.5)
    order = drain(a, holder.id)
    assert order.index("light") <= 1 and order.count("heavy") == 20


def test_two_busy_tenants_share_tokens_not_requests() -> None:
    """Tenant "big" asks 4x the tokens per request: while both wait, "small" gets about four
    requests for each of big's, so both get the same tokens."""
    a = pool()
    holder = a.enqueue(Entry(bucket="b", timeout_s=60, cost=1, tenant="x"), 0.0).ticket
    for _ in range(10):
        a.enqueue(Entry(bucket="b", timeout_s=60, cost=400, tenant="big"), 0.0)
    for _ in range(40):
        a.enqueue(Entry(bucket="b", timeout_s=60, cost=100, tenant="small"), 0.0)
    first = drain(a, holder.id)[:25]
    assert first.count("big") in (5, 6) and first.count("small") in (19, 20)


def test_weights_share_in_proportion() -> None:
    a = pool()
    holder = a.enqueue(Entry(bucket="b", timeout_s=60, tenant="x"), 0.0).ticket
    for _ in range(30):
        a.enqueue(Entry(bucket="b", timeout_s=60, cost=100, tenant="gold", weight=2.0), 0.0)
        a.enqueue(Entry(bucket="b", timeout_s=60, cost=100, tenant="free"), 0.0)
    first = drain(a, holder.id)[:30]
    assert first.count("gold") in (19, 20, 21)


def test_no_credit_is_banked_by_an_idle_tenant() -> None:
    """A tenant that sent nothing while another was served starts at the virtual time, not
    before it: it goes ahead of the busy tenant's queue, but does not jump it by the service
    the busy one had while alone."""
    a = pool()
    holder = a.enqueue(Entry(bucket="b", timeout_s=60, tenant="busy"), 0.0).ticket
    for _ in range(10):
        a.enqueue(Entry(bucket="b", timeout_s=60, cost=100, tenant="busy"), 0.0)
    for _ in range(5):
        holder = a.release(holder.id, 1.0)[0]  # busy alone: served five
    for _ in range(3):
        a.enqueue(Entry(bucket="b", timeout_s=60, cost=100, tenant="late"), 2.0)
    order = drain(a, holder.id, 3.0)
    assert order[:6].count("late") == 3 and order[:6].count("busy") == 3  # interleaved


def test_state_is_bounded_by_max_tracked_and_idle_ttl() -> None:
    order = FairOrder(CostKey())
    order.tune(TenantPolicy(max_tracked=100, idle_ttl_s=10.0))
    for i in range(10_000):
        order.push(ticket(f"t{i}", at=0.0), 5.0)
    assert len(order.tags) == 100 and "t9999" in order.tags and "t0" not in order.tags
    order.push(ticket("late", at=11.0), 5.0)  # everyone else idle past the TTL
    assert list(order.tags) == ["late"]


def test_a_forgotten_tenant_starts_at_the_virtual_time() -> None:
    a = pool(limit=2, tenant=TenantPolicy(max_tracked=1))
    a.enqueue(Entry(bucket="b", timeout_s=60, cost=1000, tenant="a"), 0.0)  # served: F = 1000
    a.enqueue(Entry(bucket="b", timeout_s=60, tenant="b"), 0.0)  # "a" forgotten
    order = a._buckets["b"].order
    assert isinstance(order, FairOrder) and "a" not in order.tags
    a.enqueue(Entry(bucket="b", timeout_s=60, tenant="a"), 0.0)  # queued: its turn starts at V
    assert order.queues["a"].start == order.virtual == 0.0


@pytest.mark.parametrize("how", ["refused and cancelled", "evicted"])
def test_a_request_that_leaves_unserved_charges_its_tenant_nothing(how: str) -> None:
    """The heavy tenant's finish tag moves only when it is served: ten requests refused at the
    door, cancelled or evicted from the queue do not put its later ones behind the light
    tenant's. After them, the two alternate, as if they had never come."""
    a = pool(max_queue=4)
    # Served: F = 100
    holder = a.enqueue(Entry(bucket="b", timeout_s=60, cost=100, tenant="heavy"), 0.0).ticket
    flood = [
        a.enqueue(Entry(bucket="b", timeout_s=1.0, cost=100, tenant="heavy"), 0.0)
        for _ in range(10)
    ]
    if how == "evicted":
        assert len(a.expire(1.0)) == 4  # and 6 refused at the door
    else:
        assert [d.verdict for d in flood].count(Verdict.QUEUE_FULL) == 6
        for d in flood[:4]:
            a.cancel(d.ticket.id, 0.5)
    for tenant in ("light", "heavy", "light", "heavy"):
        a.enqueue(Entry(bucket="b", timeout_s=60, cost=100, tenant=tenant), 2.0)
    assert drain(a, holder.id, 3.0) == ["light", "heavy", "light", "heavy"]
    order = a._buckets["b"].order
    assert isinstance(order, FairOrder) and not order.queues and order.stale == 0


def test_within_a_tenant_cheaper_first_and_still_a_light_tenant_first() -> None:
    """The heavy tenant's queue is served cheapest first (its own order), and the light
    tenant's one request still goes ahead of all of it."""
    a = pool()
    holder = a.enqueue(Entry(bucket="b", timeout_s=60, cost=100, tenant="heavy"), 0.0).ticket
    costs: dict[int, int] = {}
    for i, c in enumerate([4000, 3000, 2000, 1000]):
        d = a.enqueue(Entry(bucket="b", timeout_s=60, cost=c, tenant="heavy"), 0.1 * i)
        costs[d.ticket.id] = c
    light = a.enqueue(Entry(bucket="b", timeout_s=60, cost=5000, tenant="light"), 1.0).ticket
    served = []
    while admitted := a.release(holder.id, 2.0):
        (holder,) = admitted
        served.append(costs.get(holder.id, "light"))
    assert served == ["light", 1000, 2000, 3000, 4000]
    assert light.id not in costs


def test_the_queues_stay_bounded_while_requests_come_and_go() -> None:
    """Entries of requests that left are dropped lazily; a busy tenant's heap and the heap of
    turns never hold more than about twice the live ones (plus 64)."""
    a = pool(max_queue=10_000)
    a.enqueue(Entry(bucket="b", timeout_s=600, tenant="x"), 0.0)  # holds the slot
    for _ in range(5):
        a.enqueue(Entry(bucket="b", timeout_s=600, tenant="heavy"), 0.0)
    order = a._buckets["b"].order
    assert isinstance(order, FairOrder)
    for i in range(2_000):
        for tenant in ("heavy", f"light-{i}"):
            d = a.enqueue(Entry(bucket="b", timeout_s=600, tenant=tenant), 1.0)
            a.cancel(d.ticket.id, 1.0)
        entries = sum(len(q.heap) for q in order.queues.values()) + len(order.turns)
        assert entries <= 2 * (5 + len(order.queues)) + 66
    assert list(order.queues) == ["heavy"] and len(order.queues["heavy"].ids) == 5


def test_across_buckets_the_fair_bucket_competes_by_arrival() -> None:
    """Its keys are tokens, not times: across buckets its head competes by when it came."""
    a = Admission({})
    a.set_pool("p", 1, 0.0, fail_fast=False)
    a.set_bucket("p", rule("fair", max_queue=10, order=Order.FAIR, tenant=TenantPolicy()), 0.0)
    a.set_bucket("p", rule("fifo", max_queue=10), 0.0)
    holder = a.enqueue(Entry(bucket="fair", timeout_s=60, cost=10_000, tenant="t"), 0.0).ticket
    # Tagged 10,000
    fair = a.enqueue(Entry(bucket="fair", timeout_s=60, cost=10_000, tenant="t"), 1.0).ticket
    a.enqueue(Entry(bucket="fifo", timeout_s=60), 2.0)
    assert FairOrder(CostKey()).band_key(10_000.0, fair) == 1.0
    assert a.release(holder.id, 3.0) == [fair]


@pytest.mark.parametrize(
    ("bounds", "verdicts"),
    [
        (TenantPolicy(max_queue=2), ["admitted", "queued", "queued", "tenant_queue_full"]),
        # max_share 0.5 of 4 slots: two in the bucket at once, waiting and running together.
        (TenantPolicy(max_share=0.5), ["admitted", "admitted", "tenant_over_share"]),
    ],
)
def test_a_tenant_over_its_bounds_is_refused_before_it_joins(
    bounds: TenantPolicy, verdicts: list[str]
) -> None:
    a = pool(limit=4 if bounds.max_share else 1, tenant=bounds)
    got = [a.enqueue(Entry(bucket="b", timeout_s=60, tenant="t"), 0.0).verdict for _ in verdicts]
    assert got == [Verdict(v) for v in verdicts]
    assert a.enqueue(Entry(bucket="b", timeout_s=60, tenant="other"), 0.0).verdict in (
        Verdict.ADMITTED,
        Verdict.QUEUED,
    )
    assert a.statistics()["b"].refused_total == 0  # a tenant's bound is not the pool's


def test_tenant_counts_go_back_to_nothing_whatever_ends_a_request() -> None:
    a = pool(limit=2, tenant=TenantPolicy(max_queue=5), max_queue=3)
    counts = a._buckets["b"].tenants
    assert counts is not None
    tickets = [
        a.enqueue(Entry(bucket="b", timeout_s=1.0, tenant=f"t{i % 3}"), 0.0) for i in range(8)
    ]
    assert {t.verdict for t in tickets} == {Verdict.ADMITTED, Verdict.QUEUED, Verdict.QUEUE_FULL}
    queued = [t.ticket for t in tickets if t.verdict is Verdict.QUEUED]
    a.cancel(queued[0].id, 0.5)  # left
    a.expire(1.0)  # the rest evicted
    for t in tickets:
        if t.verdict is Verdict.ADMITTED:
            a.release(t.ticket.id, 2.0)
    assert (counts.waiting, counts.running, len(counts)) == ({}, {}, 0)


@pytest.mark.parametrize(
    ("bounds", "limit", "verdicts"),
    [
        (TenantPolicy(max_queue=1), 1, ["admitted", "queued", "tenant_queue_full"]),
        (TenantPolicy(max_share=0.5), 4, ["admitted", "admitted", "tenant_over_share"]),
    ],
)
def test_no_tenant_key_is_one_tenant_under_the_same_bounds(
    bounds: TenantPolicy, limit: int, verdicts: list[str]
) -> None:
    """The requests without a key are one tenant, the anonymous one, bounded as any other:
    a header missing from many clients bounds them together, and never fills the bucket."""
    a = pool(limit=limit, tenant=bounds)
    got = [a.enqueue(Entry(bucket="b", timeout_s=60), 0.0).verdict for _ in verdicts]
    assert got == [Verdict(v) for v in verdicts]
    assert a.enqueue(Entry(bucket="b", timeout_s=60, tenant="t"), 0.0).verdict in (
        Verdict.ADMITTED,
        Verdict.QUEUED,
    )


def test_a_tenants_share_is_of_the_pools_capacity_not_of_a_limit_of_zero() -> None:
    """max_share is of the bucket's largest number of slots at the pool's limit as configured
    or adapted; a limit of 0 (no backend yet: scale from zero; a shared pool without a
    lease) is no capacity to take a share of, so the share stays of the last positive limit
    and each tenant may queue its part of what is coming, not one request."""
    a = pool(limit=8, tenant=TenantPolicy(max_share=0.25))
    a.set_pool_limit("p", 0, 0.0)
    got = [a.enqueue(Entry(bucket="b", timeout_s=60, tenant="t"), 0.0).verdict for _ in range(3)]
    assert got == [Verdict.QUEUED, Verdict.QUEUED, Verdict.TENANT_OVER_SHARE]  # 0.25 x 8
    a.set_pool_limit("p", 4, 0.0)  # adapted: the share follows the limit in force
    assert a.enqueue(Entry(bucket="b", timeout_s=60, tenant="u"), 0.0).verdict is Verdict.ADMITTED
    # 0.25 x 4
    assert (
        a.enqueue(Entry(bucket="b", timeout_s=60, tenant="u"), 0.0).verdict
        is Verdict.TENANT_OVER_SHARE
    )


def test_a_light_tenants_first_request_finds_room_behind_a_heavy_tenants_full_queue() -> None:
    """A full fair bucket keeps room for lighter tenants: a newcomer whose tenant, once it
    joined, waits with fewer requests than the tenant with the most waiters takes the place
    of that tenant's newest waiter (at equal costs, the one its order would serve last), which
    is refused queue_full in its stead; a newcomer of a tenant as heavy as the heaviest is
    refused."""
    a = pool(limit=1, max_queue=6)
    a.enqueue(Entry(bucket="b", timeout_s=60, tenant="heavy"), 0.0)  # runs
    heavy = [a.enqueue(Entry(bucket="b", timeout_s=60, tenant="heavy"), 0.1 * i) for i in range(6)]
    assert {d.verdict for d in heavy} == {Verdict.QUEUED}
    assert (
        a.enqueue(Entry(bucket="b", timeout_s=60, tenant="heavy"), 1.0).verdict
        is Verdict.QUEUE_FULL
    )
    light = a.enqueue(Entry(bucket="b", timeout_s=60, tenant="light"), 1.0)
    assert light.verdict is Verdict.QUEUED
    assert light.displaced == heavy[-1].ticket
    assert a.queued("b") == 6 and a.statistics()["b"].refused_total == 2
    others = [
        a.enqueue(Entry(bucket="b", timeout_s=60, tenant=t), 2.0) for t in ("light", "l2", "l3")
    ]
    assert [d.verdict for d in others] == [Verdict.QUEUED] * 3
    assert [d.displaced for d in others] == [h.ticket for h in heavy[-2:-5:-1]]
    # Waiting now: heavy 2, light 2, l2 1, l3 1. light's next would make it the heaviest.
    assert (
        a.enqueue(Entry(bucket="b", timeout_s=60, tenant="light"), 3.0).verdict
        is Verdict.QUEUE_FULL
    )
    assert (
        a.enqueue(Entry(bucket="b", timeout_s=60, tenant="heavy"), 3.0).verdict
        is Verdict.QUEUE_FULL
    )
    assert a.enqueue(Entry(bucket="b", timeout_s=60, tenant="l4"), 3.0).displaced in (
        heavy[1].ticket,
        others[0].ticket,
    )
    assert a.queued("b") == 6 and a.statistics()["b"].refused_total == 8


def test_a_reload_to_another_order_keys_the_waiters_again() -> None:
    """fifo keys are times and fair keys tokens: after the change the waiters are keyed by
    the new order, in the order they came, so the heap never mixes the two."""
    a = Admission({})
    a.set_pool("p", 1, 0.0, fail_fast=False)
    a.set_bucket("p", rule("b", max_queue=10), 0.0)  # fifo
    holder = a.enqueue(Entry(bucket="b", timeout_s=60, tenant="heavy"), 0.0).ticket
    for _ in range(3):
        a.enqueue(Entry(bucket="b", timeout_s=60, cost=100, tenant="heavy"), 100.0)
    a.enqueue(Entry(bucket="b", timeout_s=60, cost=100, tenant="light"), 200.0)
    a.set_bucket("p", rule("b", max_queue=10, order=Order.FAIR, tenant=TenantPolicy()), 0.0)
    assert drain(a, holder.id, 300.0) == ["heavy", "light", "heavy", "heavy"]


@pytest.mark.parametrize(("order", "light"), [(Order.FAIR, Verdict.QUEUED), (Order.FIFO, None)])
def test_a_predicted_wait_counts_only_what_the_fair_order_puts_ahead(
    order: Order, light: Verdict | None
) -> None:
    """fail_fast: a light tenant's request behind a heavy tenant's queue of 20 (one release a
    second) is predicted to wait about one request, not twenty, so it is not refused at once;
    the heavy tenant's next one still is. In a fifo bucket both wait for the whole queue."""
    a = Admission({})
    a.set_pool("p", 1, 0.0, fail_fast=True)
    a.set_bucket("p", rule("b", max_queue=100, order=order, tenant=TenantPolicy()), 0.0)
    t = 0.0
    for _ in range(8):  # a release rate: one slot a second
        held = a.enqueue(Entry(bucket="b", timeout_s=60, tenant="heavy"), t).ticket
        t += 1.0
        a.release(held.id, t)
    a.enqueue(Entry(bucket="b", timeout_s=60, tenant="heavy"), t)  # runs
    for _ in range(20):
        assert (
            a.enqueue(Entry(bucket="b", timeout_s=60, tenant="heavy"), t).verdict is Verdict.QUEUED
        )
    assert (
        a.enqueue(Entry(bucket="b", timeout_s=5, tenant="heavy"), t).verdict
        is Verdict.WAIT_TOO_LONG
    )
    got = a.enqueue(Entry(bucket="b", timeout_s=5, tenant="light"), t).verdict
    assert got is (light or Verdict.WAIT_TOO_LONG)
