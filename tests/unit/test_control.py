"""PoolControl on a real Gate: the overload monitor reads the protected band, cuts the least
urgent one, logs each transition once and shows it in the gauges; recovery in steps. On a
virtual clock (``testing.clock``): the queue timeouts and the overload tick loop's seconds pass
at once, and a tick comes at its exact loop time. A reload that changes ``pool.shared`` is
refused (why: ``test_reload``); one that keeps it applies to the lease manager in place."""

from __future__ import annotations

import asyncio
import logging

import pytest

from extproc.config.policy import Policy, PolicyError, policy_from_yaml
from extproc.ops.metrics import Metrics
from extproc.pool.control.overload import Overload
from extproc.pool.control.reload import shared_change
from extproc.pool.control.wiring import OVERLOAD_TICK_S, PoolControl
from extproc.pool.core.values import Entry
from extproc.pool.gate import Gate, Refused, Slot, Waiter
from testing.clock import run_virtual

POLICY = policy_from_yaml(
    """
pool:
  max_concurrency: 4
  overload: {step_hold: 10s, window: 5s}
buckets:
  - {name: chat, match: {headers: {x: y}}, priority: 0, queue_timeout: 1s, max_queue: 100}
  - {name: batch, priority: 10, min_share: 0.25, queue_timeout: 1s, max_queue: 100}
"""
)


def test_overload_cuts_the_least_urgent_band_and_recovers_in_steps(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        gate = Gate(POLICY)
        control = PoolControl(gate, Metrics(gate.statistics, lambda: control.gauges()))
        control.apply(POLICY)
        # Batch borrowed the whole pool
        held = [gate.enter(Entry(bucket="batch", timeout_s=1.0)) for _ in range(4)]
        assert all(isinstance(s, Slot) for s in held)
        assert control.tick(0.0) is not None  # the first totals: nothing to compare yet
        waiters = [gate.enter(Entry(bucket="chat", timeout_s=0.01)) for _ in range(25)]
        for w in waiters:
            assert isinstance(w, Waiter)
            with pytest.raises(Refused):
                await w.admitted()  # evicted at the deadline: all 25
        assert control.gauges()["overload_state"] == 0
        verdict = control.tick(1.0)
        assert verdict is not None and str(verdict.state) == "overloaded"
        assert control.gauges()["overload_state"] == 1 and control.gauges()["overload_factor"] == 0
        # Protected traffic waiting: the cut applies
        busy = gate.enter(Entry(bucket="chat", timeout_s=5.0))
        assert isinstance(busy, Waiter)
        assert gate.statistics()["batch"].capacity == 1  # its guaranteed quarter of 4
        for s in held:
            assert isinstance(s, Slot)
            s.release()
        slot = await busy.admitted()
        # One batch request (its guarantee)
        assert gate.enter(Entry(bucket="batch", timeout_s=1.0)) is not None
        # The cut holds the second
        assert isinstance(gate.enter(Entry(bucket="batch", timeout_s=0.5)), Waiter)
        # Clear from here on: no more evictions. Steps after 10 s each.
        states = []
        for t in range(2, 50):
            v = control.tick(float(t))
            assert v is not None
            if v.changed:
                states.append((t, str(v.state), v.factor))
        assert [s[1:] for s in states] == [
            ("recovering", 0.5),
            ("recovering", 0.8),
            ("normal", 1.0),
        ]
        assert states[0][0] >= 11 and states[1][0] - states[0][0] >= 10
        slot.release()
        debug = control.debug()
        assert debug is not None and debug["overload"]["state"] == "normal"
        text = control._metrics.render().decode()
        assert 'llm_extproc_overload_transitions_total{state="overloaded"} 1.0' in text
        assert 'llm_extproc_overload_transitions_total{state="normal"} 1.0' in text
        assert "llm_extproc_pool_limit 4.0" in text
        await control.stop()

    with caplog.at_level(logging.WARNING, logger="extproc.control"):
        run_virtual(main())
    lines = [r.getMessage() for r in caplog.records if r.name == "extproc.control"]
    assert len(lines) == 4, lines  # overloaded, 50 %, 80 %, normal: one line each
    assert "pool overloaded: least urgent band at 0% of its cap (evictions" in lines[0]


def test_the_tick_loop_looks_every_tick_on_the_loops_clock(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``start`` runs ``tick(loop.time())`` every ``OVERLOAD_TICK_S``: the cut comes at the
    first tick after the evictions and each step at the tick the policy's clocks say; a tick
    that raises is logged, counted (``llm_extproc_loop_errors_total{loop="overload"}``) and
    the next one comes all the same."""
    metrics: list[Metrics] = []

    async def main() -> None:
        gate = Gate(POLICY)
        metrics.append(Metrics(gate.statistics))
        control = PoolControl(gate, metrics[0])
        control.apply(POLICY)
        changes: list[tuple[float, str, float]] = []
        tick = control.tick
        ticks: list[float] = []

        def recording(now: float) -> Overload | None:
            now = round(now, 9)  # the clock's sums of float steps
            ticks.append(now)
            if len(ticks) == 3:
                raise RuntimeError("tick broke")
            verdict = tick(now)
            if verdict is not None and verdict.changed:
                changes.append((now, str(verdict.state), verdict.factor))
            return verdict

        control.tick = recording  # type: ignore[method-assign]
        # Batch borrowed the whole pool
        held = [gate.enter(Entry(bucket="batch", timeout_s=1.0)) for _ in range(4)]
        control.start()
        await asyncio.sleep(1.5)  # past the first tick (the first totals); virtual: at once
        for w in [gate.enter(Entry(bucket="chat", timeout_s=0.01)) for _ in range(25)]:
            assert isinstance(w, Waiter)
            with pytest.raises(Refused):
                await w.admitted()  # evicted at 1.51
        await asyncio.sleep(1.0)  # the next tick
        assert changes == [(2.0, "overloaded", 0.0)]  # the first tick after the evictions
        for s in held:
            assert isinstance(s, Slot)
            s.release()
        await asyncio.sleep(40.0)  # forty ticks more
        await control.stop()
        assert ticks == [OVERLOAD_TICK_S * n for n in range(1, 43)]  # every tick, none missed
        # Clear from tick 7 (the 5 s window has forgotten the evictions), then a step every
        # step_hold (10 s).
        assert changes[1:] == [
            (17.0, "recovering", 0.5),
            (27.0, "recovering", 0.8),
            (37.0, "normal", 1.0),
        ]

    with caplog.at_level(logging.ERROR, logger="extproc.control"):
        run_virtual(main())
    assert [r.getMessage() for r in caplog.records] == [
        "overload: a round failed (1 in a row); the loop goes on in 1.00 s"
    ]
    assert caplog.records[0].exc_info is not None  # with its traceback
    errors = metrics[0].registry.get_sample_value(
        "llm_extproc_loop_errors_total", {"loop": "overload"}
    )
    assert errors == 1


def test_client_deadlines_that_pass_do_not_trip_the_cut() -> None:
    """Protected requests whose clients' own deadlines, shorter than the queue timeout, pass
    while they wait expire (``expired_client_deadline``) and are not evictions: however many,
    the least urgent band keeps its capacity. The same wait at the bucket's deadline trips it."""

    async def main() -> None:
        gate = Gate(POLICY)
        control = PoolControl(gate, Metrics(gate.statistics, lambda: control.gauges()))
        control.apply(POLICY)
        # Batch borrowed the whole pool
        held = [gate.enter(Entry(bucket="batch", timeout_s=1.0)) for _ in range(4)]
        assert control.tick(0.0) is not None
        for _ in range(25):
            w = gate.enter(Entry(bucket="chat", timeout_s=0.01, client_deadline=True))
            assert isinstance(w, Waiter)
            with pytest.raises(Refused) as info:
                await w.admitted()
            assert str(info.value.outcome) == "expired_client_deadline"
        verdict = control.tick(1.0)
        assert verdict is not None and str(verdict.state) == "normal" and not verdict.changed
        assert verdict.samples == 0 and verdict.eviction_rate is None
        assert gate.statistics()["chat"].client_expired_total == 25
        for s in held:
            assert isinstance(s, Slot)
            s.release()
        await control.stop()

    asyncio.run(main())


def test_one_band_has_nothing_to_protect() -> None:
    policy = policy_from_yaml(
        "pool: {max_concurrency: 2}\nbuckets: [{name: a, queue_timeout: 1s, max_queue: 5}]"
    )

    async def main() -> None:
        gate = Gate(policy)
        control = PoolControl(gate, Metrics(gate.statistics))
        control.apply(policy)
        assert control.tick(0.0) is None
        assert control.gauges()["pool_limit"] == 2

    run_virtual(main())


def test_without_a_pool_there_is_nothing_to_control() -> None:
    policy = policy_from_yaml("buckets: [{name: a, max_concurrency: 1, queue_timeout: 1s}]")

    async def main() -> None:
        gate = Gate(policy)
        control = PoolControl(gate, Metrics(gate.statistics))
        control.apply(policy)
        assert control.tick(0.0) is None
        assert control.gauges() == {} and control.debug() is None

    run_virtual(main())


def test_latency_objectives_apply_while_a_more_urgent_band_has_requests() -> None:
    """The adaptive limit's objectives protect the urgent bands: with only batch running they
    are left out; a chat request running or waiting brings them back; one band, always."""

    async def main() -> None:
        gate = Gate(POLICY)
        control = PoolControl(gate, Metrics(gate.statistics))
        control.apply(POLICY)
        assert control._objectives_apply() is False  # nobody at all
        held = [gate.enter(Entry(bucket="batch", timeout_s=1.0)) for _ in range(4)]
        assert control._objectives_apply() is False  # batch alone
        waiting = gate.enter(Entry(bucket="chat", timeout_s=5.0))
        assert isinstance(waiting, Waiter)
        assert control._objectives_apply() is True  # chat waits
        for s in held:
            assert isinstance(s, Slot)
            s.release()
        chat = await waiting.admitted()
        assert control._objectives_apply() is True  # chat runs
        chat.release()
        assert control._objectives_apply() is False
        one = policy_from_yaml(
            "pool: {max_concurrency: 2}\nbuckets: [{name: a, queue_timeout: 1s, max_queue: 5}]"
        )
        control.apply(one)
        assert control._objectives_apply() is True

    run_virtual(main())


@pytest.mark.parametrize(
    ("batch", "demand"),
    [
        ("max_share: 0.5", (2, 3)),  # held at its share of the limit: a higher one lets them in
        ("max_share: 0.5, max_concurrency: 2", (2, 0)),  # its own cap binds: no demand
    ],
)
def test_waiters_held_by_their_share_are_demand_for_a_higher_limit(
    batch: str, demand: tuple[int, int]
) -> None:
    policy = policy_from_yaml(
        f"""
pool: {{max_concurrency: 4}}
buckets:
  - {{name: chat, match: {{headers: {{x: y}}}}, priority: 0, queue_timeout: 1s, max_queue: 9}}
  - {{name: batch, priority: 10, {batch}, queue_timeout: 5s, max_queue: 9}}
"""
    )

    async def main() -> None:
        gate = Gate(policy)
        control = PoolControl(gate, Metrics(gate.statistics))
        control.apply(policy)
        entered = [gate.enter(Entry(bucket="batch", timeout_s=5.0)) for _ in range(5)]
        assert [isinstance(e, Slot) for e in entered] == [True, True, False, False, False]
        assert control._demand() == demand
        # The pool is full: all waiters count
        full = [gate.enter(Entry(bucket="chat", timeout_s=1.0)) for _ in range(2)]
        assert all(isinstance(e, Slot) for e in full)
        assert control._demand() == (4, 3)
        full.pop().release()  # room again; chat still runs, so a cut applies to batch
        gate.set_cut(0.0)
        assert gate.statistics()["batch"].capacity == 0  # cut to its guaranteed share, none
        assert control._demand() == (3, 0)  # held by the cut: the limit would not let them in
        for e in entered + full:
            if isinstance(e, Slot):
                e.release()
            else:
                e.cancel()

    run_virtual(main())


def adaptive_policy(shared: str = "", most: int = 16) -> Policy:
    """An adaptive pool of two bands (a band cut applies), with ``shared`` as its
    ``pool.shared`` keys when given. Nothing answers at the Redis URL or the metrics URL: the
    test looks at what a reload does."""
    return policy_from_yaml(
        f"""
pool:
  max_concurrency: 4
  adaptive: {{min: 1, max: {most}, initial: 8}}
  {f"shared: {{{shared}}}" if shared else ""}
backend: {{metrics: ["http://127.0.0.1:1/metrics"]}}
buckets:
  - {{name: chat, match: {{headers: {{x: y}}}}, priority: 0, queue_timeout: 1s, max_queue: 9}}
  - {{name: batch, priority: 10, queue_timeout: 1s, max_queue: 9}}
"""
    )


SHARED = 'redis: "redis://127.0.0.1:1/0", lease: 1s'


@pytest.mark.parametrize(
    ("before", "after"),
    [("", SHARED), (SHARED, ""), (SHARED, 'redis: "redis://127.0.0.1:1/1", lease: 1s')],
)
def test_a_reload_that_changes_pool_shared_is_refused_and_changes_nothing(
    before: str, after: str
) -> None:
    """Into or out of shared mode, or to another ``pool.shared``: ``prepare`` refuses it with
    ``shared_change``'s message (the sidecar's reload keeps the policy in force)."""

    async def main() -> None:
        old = adaptive_policy(before)
        gate = Gate(old)
        control = PoolControl(gate, Metrics(gate.statistics))
        control.apply(old)
        manager, poller = control._shared, control._poller
        assert (manager is None) is (before == "") and (poller is None) is (before != "")
        new = adaptive_policy(after)
        with pytest.raises(PolicyError) as refused:
            control.prepare(new)
        assert str(refused.value) == shared_change(old.pool, new.pool)
        assert (control._policy, control._shared, control._poller) == (old, manager, poller)
        await control.stop()
        await control.close()

    asyncio.run(main())


def test_a_reload_that_keeps_pool_shared_applies_to_its_lease_manager_in_place() -> None:
    """A new adaptive ``max`` (or limit) with ``pool.shared`` as it was: the same manager, on
    the new bounds."""

    async def main() -> None:
        old, new = adaptive_policy(SHARED), adaptive_policy(SHARED, most=12)
        gate = Gate(old)
        control = PoolControl(gate, Metrics(gate.statistics))
        control.apply(old)
        manager = control._shared
        assert manager is not None and manager.ledger.bounds == (1, 16)
        gate.reconfigure(new)
        control.apply(control.prepare(new))
        assert control._shared is manager and manager.ledger.bounds == (1, 12)
        await control.stop()
        await control.close()

    asyncio.run(main())
