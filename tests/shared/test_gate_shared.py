"""The gate in shared mode through its lease adapter, no Redis: the local pool admits on leases
only (none: nobody), shares are of the whole pool's limit, the lease manager hears of a release
before the slot is handed on, and what it reads as demand leaves out waiters a lease would not
let in."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from extproc.config.policy import policy_from_yaml
from extproc.pool.core.values import Entry
from extproc.pool.gate import POOL, Gate, Slot, Waiter
from extproc.pool.shared.adapter import LeaseAdapter

POLICY = policy_from_yaml(
    """
pool: {max_concurrency: 10, shared: {redis: "redis://127.0.0.1:1/0"}}
buckets:
  - {name: interactive, match: {headers: {x: i}}, priority: 0, queue_timeout: 5s, max_queue: 50}
  - {name: batch, priority: 10, max_share: 0.5, queue_timeout: 5s, max_queue: 50}
"""
)


class Hooks:
    def __init__(self) -> None:
        self.changes = 0
        self.on_release_do: Callable[[], None] = lambda: None

    def on_release(self) -> None:
        self.on_release_do()

    def on_change(self) -> None:
        self.changes += 1


def run(main: Callable[[], Any]) -> None:
    async def go() -> None:
        main()

    asyncio.run(go())


def test_no_lease_admits_nobody_and_each_lease_admits_one() -> None:
    def main() -> None:
        gate, hooks = Gate(POLICY), Hooks()
        leases = LeaseAdapter(gate)
        leases.attach(hooks, 10)
        entries = [gate.enter(Entry(bucket="batch", timeout_s=5.0)) for _ in range(3)]
        assert all(isinstance(e, Waiter) for e in entries) and hooks.changes >= 3
        assert leases.shared_view() == (0, {10: 3})
        leases.set_leases(2, 10)
        assert [e.future.done() for e in entries if isinstance(e, Waiter)] == [True, True, False]
        assert leases.shared_view() == (2, {10: 1})
        assert gate.pool_statistics()[POOL].limit == 2

    run(main)


def test_max_share_is_of_the_whole_pool_and_capped_waiters_are_no_demand() -> None:
    def main() -> None:
        gate, hooks = Gate(POLICY), Hooks()
        leases = LeaseAdapter(gate)
        leases.attach(hooks, 10)
        leases.set_leases(8, 10)  # 8 held: batch may still hold only 5, half of the pool's 10
        for _ in range(7):
            gate.enter(Entry(bucket="batch", timeout_s=5.0))
        assert gate.statistics()["batch"].in_flight == 5
        assert leases.shared_view() == (5, {})  # two wait, but a lease would not let them in
        leases.set_leases(8, 16)  # the pool's limit grew: batch's cap is 8 now
        assert gate.statistics()["batch"].in_flight == 7

    run(main)


def test_the_manager_hears_of_a_release_before_the_slot_is_handed_on() -> None:
    def main() -> None:
        gate, hooks = Gate(POLICY), Hooks()
        leases = LeaseAdapter(gate)
        leases.attach(hooks, 10)
        leases.set_leases(1, 10)
        slot = gate.enter(Entry(bucket="batch", timeout_s=5.0))
        waiter = gate.enter(Entry(bucket="batch", timeout_s=5.0))
        assert isinstance(slot, Slot) and isinstance(waiter, Waiter)
        # The lease goes to another replica: the waiter here stays queued.
        hooks.on_release_do = lambda: leases.set_leases(0, 10)
        slot.release()
        assert not waiter.future.done() and leases.shared_view() == (0, {10: 1})
        hooks.on_release_do = lambda: None
        leases.set_leases(1, 10)
        assert waiter.future.done()

    run(main)
