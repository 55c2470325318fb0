"""Selective relegation in the admission core (``extproc.pool.core.relegate``): a waiter at its
bucket's deadline moves once into the bucket it relegates to, keeps its place in time, and is
evicted at the second deadline. Pure: plain numbers for time."""

from __future__ import annotations

import asyncio

import pytest

from extproc.config.policy import Order, TenantPolicy, policy_from_mapping
from extproc.outcome import Outcome
from extproc.pool.core.admission import Admission
from extproc.pool.core.demand import lease_demand
from extproc.pool.core.relegate import Relegation
from extproc.pool.core.values import Entry, Ticket, Verdict
from extproc.pool.gate import Gate, Refused, Slot, Waiter
from testing.buckets import rule
from testing.clock import run_virtual

POOL = "p"


def pool(
    limit: int = 1,
    *,
    relegate_s: float = 2.0,
    target_queue: int = 100,
    hi: dict[str, object] | None = None,
    lo: dict[str, object] | None = None,
) -> Admission:
    """A pool of ``limit``: ``hi`` (priority 0) relegates to ``lo`` (priority 1), whose queue
    timeout is ``relegate_s``."""
    a = Admission({}, max_queued_bytes=10_000)
    a.set_pool(POOL, limit, 0.0)
    late = Relegation(target="lo", timeout_s=relegate_s)
    a.set_bucket(POOL, rule("hi", priority=0, relegate_to=late, **(hi or {})), 0.0)
    a.set_bucket(POOL, rule("lo", max_queue=target_queue, priority=1, **(lo or {})), 0.0)
    return a


def enqueue(a: Admission, bucket: str, now: float, verdict: Verdict, **kw: object) -> Ticket:
    kw.setdefault("timeout_s", 1.0)
    d = a.enqueue(Entry(bucket=bucket, **kw), now)  # type: ignore[arg-type]
    assert d.verdict is verdict, d
    return d.ticket


def where(a: Admission) -> dict[str, tuple[int, int]]:
    """bucket -> (in flight, queued)."""
    return {name: (s.in_flight, s.queued) for name, s in a.statistics().items()}


def test_a_waiter_is_relegated_once_at_its_deadline_then_evicted_at_the_second() -> None:
    a = pool()
    enqueue(a, "hi", 0.0, Verdict.ADMITTED)  # holds the one slot throughout
    t = enqueue(a, "hi", 0.0, Verdict.QUEUED, held_bytes=300)
    assert a.next_deadline() == 1.0
    assert a.expire(1.0) == []  # not evicted: moved
    moved = a.ticket(t.id)
    assert moved is not None
    assert (moved.bucket, moved.deadline, moved.relegated_from) == ("lo", 3.0, "hi")
    assert moved.enqueued_at == 0.0  # its place in time
    assert where(a) == {"hi": (1, 0), "lo": (0, 1)}
    s = a.statistics()
    assert (s["hi"].relegated_total, s["hi"].evicted_total) == (1, 0)
    assert (s["hi"].queued_bytes, s["lo"].queued_bytes, a.queued_bytes) == (0, 300, 300)
    assert a.next_deadline() == 3.0
    assert a.expire(2.999) == []
    assert a.expire(3.0) == [moved]  # evicted at the second deadline: never relegated twice
    s = a.statistics()
    assert (s["hi"].evicted_total, s["lo"].evicted_total, s["lo"].relegated_total) == (0, 1, 0)
    assert where(a) == {"hi": (1, 0), "lo": (0, 0)}
    assert a.queued_bytes == 0 and a.next_deadline() is None


def test_a_relegated_waiter_is_admitted_from_its_new_bucket_ahead_of_later_arrivals() -> None:
    a = pool()
    holder = enqueue(a, "hi", 0.0, Verdict.ADMITTED)
    early = enqueue(a, "lo", -5.0, Verdict.QUEUED, timeout_s=10.0)  # came before it
    t = enqueue(a, "hi", 0.0, Verdict.QUEUED)
    late = enqueue(a, "lo", 0.5, Verdict.QUEUED, timeout_s=10.0)  # came after it
    assert a.expire(1.0) == []
    assert [x.id for x in a.release(holder.id, 1.5)] == [early.id]
    (admitted,) = a.release(early.id, 1.6)
    assert admitted.id == t.id and admitted.bucket == "lo" and admitted.relegated_from == "hi"
    assert a.statistics()["lo"].admitted_total == 2
    assert a.recent_waits("lo")[-1] == pytest.approx(1.6)  # the whole wait, since it arrived
    assert a.release(admitted.id, 2.0) == [late]
    assert where(a) == {"hi": (0, 0), "lo": (1, 0)}


def test_a_relegated_waiter_is_admitted_at_once_when_its_new_bucket_has_room() -> None:
    a = pool(2, hi={"cap": 1})  # hi may hold one slot of two: the other is free for lo
    enqueue(a, "hi", 0.0, Verdict.ADMITTED)
    t = enqueue(a, "hi", 0.0, Verdict.QUEUED)
    assert a.expire(1.0) == []
    (admitted,) = a.take_admitted()  # nobody waits while the rules would admit it (rule 2)
    assert admitted.id == t.id and admitted.bucket == "lo"
    assert where(a) == {"hi": (1, 0), "lo": (1, 0)}


@pytest.mark.parametrize(
    ("stated", "expired_as"),
    [(True, "client_expired_total"), (False, "evicted_total")],
)
def test_the_requests_own_deadline_bounds_the_relegation(stated: bool, expired_as: str) -> None:
    a = pool()
    enqueue(a, "hi", 0.0, Verdict.ADMITTED)
    t = enqueue(a, "hi", 0.0, Verdict.QUEUED, own_deadline=1.5, own_stated=stated)
    assert a.expire(1.0) == []
    moved = a.ticket(t.id)
    assert moved is not None
    assert (moved.deadline, moved.client_deadline) == (1.5, stated)  # not 1 + 2 s
    assert a.expire(1.5) == [moved]
    assert getattr(a.statistics()["lo"], expired_as) == 1


def test_no_relegation_past_the_requests_own_deadline_or_at_its_clients() -> None:
    a = pool()
    enqueue(a, "hi", 0.0, Verdict.ADMITTED)
    # Its own deadline is now: nothing is left to wait for.
    at_own = enqueue(a, "hi", 0.0, Verdict.QUEUED, own_deadline=1.0)
    # Its queue deadline is its client's own: the client is out of time.
    clients = enqueue(a, "hi", 0.0, Verdict.QUEUED, client_deadline=True)
    assert a.expire(1.0) == [at_own, clients]
    s = a.statistics()["hi"]
    assert (s.relegated_total, s.evicted_total, s.client_expired_total) == (0, 1, 1)


def test_a_full_target_queue_means_evicted_as_before() -> None:
    a = pool(target_queue=1)
    enqueue(a, "hi", 0.0, Verdict.ADMITTED)
    enqueue(a, "lo", 0.0, Verdict.QUEUED, timeout_s=10.0)
    t = enqueue(a, "hi", 0.0, Verdict.QUEUED, held_bytes=100)
    assert a.expire(1.0) == [t]  # evicted from its own bucket, counted there
    s = a.statistics()
    assert (s["hi"].evicted_total, s["hi"].relegated_total, s["lo"].queued) == (1, 0, 1)
    assert a.queued_bytes == 0


def test_a_target_whose_tenant_bounds_refuse_means_evicted_as_before() -> None:
    a = pool(lo={"tenant": TenantPolicy(max_queue=1)})
    enqueue(a, "hi", 0.0, Verdict.ADMITTED)
    enqueue(a, "lo", 0.0, Verdict.QUEUED, timeout_s=10.0, tenant="t")
    t = enqueue(a, "hi", 0.0, Verdict.QUEUED, tenant="t")
    other = enqueue(a, "hi", 0.0, Verdict.QUEUED, tenant="u")
    assert a.expire(1.0) == [t]
    moved = a.ticket(other.id)
    assert moved is not None and moved.bucket == "lo"


def test_cancel_while_relegated_frees_its_place_exactly_once() -> None:
    a = pool(hi={"order": Order.COST}, lo={"order": Order.COST})
    holder = enqueue(a, "hi", 0.0, Verdict.ADMITTED)
    t = enqueue(a, "hi", 0.0, Verdict.QUEUED, held_bytes=200, cost=50)
    assert a.expire(1.0) == []
    assert a.cancel(t.id, 1.2) == []
    assert a.cancel(t.id, 1.3) == []  # gone already: nothing changes
    assert where(a) == {"hi": (1, 0), "lo": (0, 0)}
    assert a.queued_bytes == 0 and a.ticket(t.id) is None
    assert a.expire(10.0) == [] and a.next_deadline() is None
    assert a.release(holder.id, 10.0) == []  # nobody left to admit
    s = a.statistics()
    assert (s["lo"].evicted_total, s["lo"].admitted_total, s["hi"].relegated_total) == (0, 0, 1)


def test_what_a_shared_pools_lease_manager_counts_moves_with_the_waiter() -> None:
    """Shared mode: the lease adapter reads the waiters per bucket and band from the core's
    statistics (``demand.lease_demand``); a relegated waiter is counted once, in its new band."""
    a = pool()
    enqueue(a, "hi", 0.0, Verdict.ADMITTED)
    enqueue(a, "hi", 0.0, Verdict.QUEUED)
    caps = {"hi": 10, "lo": 10}
    assert lease_demand(a.pool_statistics(0.0)[POOL], a.statistics(), caps) == (1, {0: 1})
    a.expire(1.0)
    assert lease_demand(a.pool_statistics(1.0)[POOL], a.statistics(), caps) == (1, {1: 1})
    assert a.pool_statistics(1.0)[POOL].queued == 1


GATE_POLICY = policy_from_mapping(
    {
        "retry_after": {"min": "1s", "max": "30s", "jitter": 0.0},
        "pool": {"max_concurrency": 1},
        "buckets": [
            {"name": "hi", "match": {"headers": {"x-class": "hi"}}, "queue_timeout": "1s",
             "max_queue": 10, "relegate_to": "lo"},
            {"name": "lo", "priority": 1, "queue_timeout": "2s", "max_queue": 10},
        ],
    }
)  # fmt: skip


def test_the_gate_hands_a_relegated_waiter_its_slot_or_its_refusal() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        gate = Gate(GATE_POLICY)
        t0 = loop.time()
        holder = gate.enter(Entry(bucket="hi", timeout_s=1.0))
        assert isinstance(holder, Slot)
        served, refused = (
            gate.enter(Entry(bucket="hi", timeout_s=1.0)),
            gate.enter(Entry(bucket="hi", timeout_s=1.0)),
        )
        assert isinstance(served, Waiter) and isinstance(refused, Waiter)
        loop.call_at(t0 + 1.5, holder.release)  # after the relegation, before its deadline
        slot = await served.admitted()
        assert loop.time() - t0 == pytest.approx(1.5, abs=1e-9)
        assert (slot.ticket.bucket, slot.ticket.relegated_from) == ("lo", "hi")
        with pytest.raises(Refused) as info:
            await refused.admitted()  # the slot stays busy: evicted at 1 + 2 s
        assert loop.time() - t0 == pytest.approx(3.0, abs=1e-9)
        r = info.value
        assert (r.outcome, r.bucket, r.relegated_from) == (Outcome.EVICTED_TIMEOUT, "lo", "hi")
        slot.release()
        assert gate.statistics()["lo"].in_flight == 0

    run_virtual(asyncio.wait_for(main(), 10))


def test_fail_fast_refuses_only_a_wait_past_the_relegations_deadline_too() -> None:
    a = Admission({})
    a.set_pool(POOL, 1, 0.0, fail_fast=True)
    late = Relegation(target="lo", timeout_s=5.0)
    a.set_bucket(POOL, rule("hi", max_queue=100, relegate_to=late), 0.0)
    a.set_bucket(POOL, rule("lo", max_queue=100, priority=1), 0.0)
    now = 0.0
    for _ in range(10):  # teach the pool its release rate: 1 slot a second
        x = enqueue(a, "hi", now, Verdict.ADMITTED)
        now += 1.0
        a.release(x.id, now)
    enqueue(a, "hi", now, Verdict.ADMITTED)
    for _ in range(2):
        enqueue(a, "hi", now, Verdict.QUEUED, timeout_s=10.0)
    # About 3 s ahead of it: past its 1 s deadline, within 1 s + 5 s.
    enqueue(a, "hi", now, Verdict.QUEUED)
    # Its own deadline leaves no time for the relegation, or its queue deadline is its
    # client's: refused as before.
    enqueue(a, "hi", now, Verdict.WAIT_TOO_LONG, own_deadline=now + 1.0, own_stated=True)
    enqueue(a, "hi", now, Verdict.WAIT_TOO_LONG, client_deadline=True)
    d = a.enqueue(Entry(bucket="hi", timeout_s=1.0, own_deadline=now + 2.0, own_stated=True), now)
    assert d.verdict is Verdict.WAIT_TOO_LONG and 3 < d.predicted_wait_s < 6
