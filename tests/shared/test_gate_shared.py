"""The gate in shared mode through its lease adapter, no Redis: the local pool admits on leases
only (none: nobody), shares are of the whole pool's limit, the lease manager hears of a release
before the slot is handed on, and what it reads as demand leaves out waiters a lease would not
let in."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from extproc.config.policy import policy_from_yaml
from extproc.pool.gate import POOL, Gate, Slot, Waiter
from extproc.pool.lease_adapter import LeaseAdapter

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
        entries = [gate.enter("batch", 5.0) for _ in range(3)]
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
            gate.enter("batch", 5.0)
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
        slot = gate.enter("batch", 5.0)
        waiter = gate.enter("batch", 5.0)
        assert isinstance(slot, Slot) and isinstance(waiter, Waiter)
        # The lease goes to another replica: the waiter here stays queued.
        hooks.on_release_do = lambda: leases.set_leases(0, 10)
        slot.release()
        assert not waiter.future.done() and leases.shared_view() == (0, {10: 1})
        hooks.on_release_do = lambda: None
        leases.set_leases(1, 10)
        assert waiter.future.done()

    run(main)


def test_detached_the_pool_is_the_policys_again() -> None:
    def main() -> None:
        gate, hooks = Gate(POLICY), Hooks()
        leases = LeaseAdapter(gate)
        leases.attach(hooks, 10)
        waiter = gate.enter("interactive", 5.0)
        assert isinstance(waiter, Waiter) and not waiter.future.done()
        leases.detach()
        assert waiter.future.done() and gate.pool_statistics()[POOL].limit == 10
        assert gate.statistics()["batch"].capacity == 5

    run(main)


def test_a_new_manager_takes_over_and_the_old_one_keeps_what_runs() -> None:
    """Three run on the old manager's leases, two wait. At the switch the gate admits nobody
    (its limit: what the old one keeps); a release takes one off what it keeps, so the slot
    is not handed on until the new manager holds a lease; when it keeps none it is done."""

    def main() -> None:
        gate, old_hooks, new_hooks = Gate(POLICY), Hooks(), Hooks()
        old = LeaseAdapter(gate)
        old.attach(old_hooks, 10)
        old.set_leases(3, 10)
        slots = [gate.enter("interactive", 5.0) for _ in range(3)]
        waiters = [gate.enter("interactive", 5.0) for _ in range(2)]
        assert all(isinstance(s, Slot) for s in slots)
        new, done, changes = LeaseAdapter(gate), list[None](), old_hooks.changes
        new.take_over(old, new_hooks, 10, lambda: done.append(None))
        assert old_hooks.changes > changes  # it looks at its spares
        assert gate.pool_statistics()[POOL].limit == 3
        assert not any(w.future.done() for w in waiters if isinstance(w, Waiter))
        assert new.shared_view() == (0, {0: 2}) and old.shared_view() == (3, {})
        old.set_leases(5, 10)  # the old manager's leases no longer set the limit
        assert gate.pool_statistics()[POOL].limit == 3
        changes = old_hooks.changes
        slots[0].release()  # type: ignore[union-attr]
        assert old.shared_view() == (2, {}) and old_hooks.changes > changes
        assert gate.pool_statistics()[POOL].limit == 2
        assert not any(w.future.done() for w in waiters if isinstance(w, Waiter))
        new.set_leases(1, 10)  # the new manager's first lease: one waiter in
        assert [w.future.done() for w in waiters if isinstance(w, Waiter)] == [True, False]
        assert new.shared_view() == (1, {0: 1})
        slots[1].release()  # type: ignore[union-attr]
        assert not done
        slots[2].release()  # type: ignore[union-attr]
        assert done == [None] and old.shared_view() == (0, {})
        assert gate.pool_statistics()[POOL].limit == 1 and new.shared_view() == (1, {0: 1})

    run(main)


def test_a_second_take_over_keeps_what_the_first_did_not() -> None:
    def main() -> None:
        gate = Gate(POLICY)
        first = LeaseAdapter(gate)
        first.attach(Hooks(), 10)
        first.set_leases(2, 10)
        slots = [gate.enter("interactive", 5.0) for _ in range(2)]
        second, third, done = LeaseAdapter(gate), LeaseAdapter(gate), list[str]()
        second.take_over(first, Hooks(), 10, lambda: done.append("first"))
        second.set_leases(1, 10)
        slots.append(gate.enter("interactive", 5.0))
        assert all(isinstance(s, Slot) for s in slots)
        third.take_over(second, Hooks(), 10, lambda: done.append("second"))
        assert (first.shared_view(), second.shared_view()) == ((2, {}), (1, {}))
        assert gate.pool_statistics()[POOL].limit == 3
        for s in slots:
            s.release()  # type: ignore[union-attr]
        assert done == ["first", "second"] and gate.pool_statistics()[POOL].limit == 0

    run(main)


def test_nothing_running_the_old_manager_is_done_at_once() -> None:
    def main() -> None:
        gate, old_hooks = Gate(POLICY), Hooks()
        old, new, done = LeaseAdapter(gate), LeaseAdapter(gate), list[None]()
        old.attach(old_hooks, 10)
        old.set_leases(2, 10)
        new.take_over(old, Hooks(), 10, lambda: done.append(None))
        assert done == [None]
        assert gate.pool_statistics()[POOL].limit == 0

    run(main)


def test_a_new_manager_of_another_pool_covers_what_runs_too() -> None:
    """Another pool (another Redis or prefix): the new manager counts the kept requests as
    its own (it claims leases for them there) and admits only on its leases; a release is
    one fewer kept for the old manager and a release for the new one."""

    def main() -> None:
        gate, old_hooks, new_hooks = Gate(POLICY), Hooks(), Hooks()
        old, new = LeaseAdapter(gate, ("r", "a")), LeaseAdapter(gate, ("r", "b"))
        old.attach(old_hooks, 10)
        old.set_leases(2, 10)
        slots = [gate.enter("interactive", 5.0) for _ in range(2)]
        waiter = gate.enter("interactive", 5.0)
        assert isinstance(waiter, Waiter)
        done = list[None]()
        new.take_over(old, new_hooks, 10, lambda: done.append(None))
        assert gate.pool_statistics()[POOL].limit == 0
        assert new.shared_view() == (2, {0: 1}) and old.shared_view() == (2, {})
        new.set_leases(2, 10)  # claimed for the two running: still nobody new
        assert not waiter.future.done()
        released = list[None]()
        new_hooks.on_release_do = lambda: released.append(None)
        slots[0].release()  # type: ignore[union-attr]
        assert old.shared_view() == (1, {}) and released == [None]
        assert waiter.future.done()  # the new manager's lease of the one that ended
        slots[1].release()  # type: ignore[union-attr]
        assert done == [None] and released == [None, None]

    run(main)
