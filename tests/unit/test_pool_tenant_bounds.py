"""A tenant's bounds through the gate: of the whole pool's limit in shared mode (not of the
leases this replica holds, nor of a published limit of 0), and the room a full fair bucket
keeps for a lighter tenant (the waiter it takes the place of is refused at once). No Redis:
the lease manager is stood in for by hand (``LeaseAdapter.set_leases``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from extproc.config.policy import policy_from_yaml
from extproc.outcome import Outcome
from extproc.pool.core.values import Entry
from extproc.pool.gate import Gate, Refused, Slot, Waiter
from extproc.pool.shared.adapter import LeaseAdapter

SHARED = policy_from_yaml(
    """
trusted_headers: [x-tenant]
pool: {max_concurrency: 8, shared: {redis: "redis://127.0.0.1:1/0"}}
buckets:
  - {name: chat, queue_timeout: 5s, max_queue: 50, order: fair,
     tenant: {header: x-tenant, max_share: 0.25}}
"""
)

LOCAL = policy_from_yaml(
    """
trusted_headers: [x-tenant]
pool: {max_concurrency: 1}
buckets:
  - {name: chat, queue_timeout: 5s, max_queue: 3, order: fair, tenant: {header: x-tenant}}
"""
)


class Hooks:
    def on_release(self) -> None:
        pass

    def on_change(self) -> None:
        pass


def run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(main())


def verdict(gate: Gate, tenant: str) -> str:
    try:
        entry = gate.enter(Entry(bucket="chat", timeout_s=5.0, tenant=tenant))
    except Refused as r:
        return str(r.outcome)
    return "admitted" if isinstance(entry, Slot) else "queued"


@pytest.mark.parametrize(("held", "pool_limit"), [(0, 8), (1, 8), (0, 0)])
def test_a_tenants_share_in_a_shared_pool_is_of_the_whole_pools_limit(
    held: int, pool_limit: int
) -> None:
    """0.25 of the shared pool's 8: two requests of a tenant, waiting and running, whatever
    this replica holds (no lease, one lease) and while the pool's published limit is 0 (no
    backend yet: the share stays of the last positive limit)."""

    async def main() -> None:
        gate = Gate(SHARED)
        leases = LeaseAdapter(gate)
        leases.attach(Hooks(), 8)
        leases.set_leases(held, pool_limit)
        got = [verdict(gate, "t") for _ in range(3)]
        first = "admitted" if held else "queued"
        assert got == [first, "queued", "rejected_tenant_over_share"]
        assert verdict(gate, "u") == "queued"  # another tenant has its own share

    run(main)


def test_the_waiter_a_lighter_tenant_takes_the_place_of_is_refused_queue_full() -> None:
    async def main() -> None:
        gate = Gate(LOCAL)
        # A cost, as every request has one: served, it moves its tenant's finish tag (at 0
        # every tag stays at V, and the tie goes to the tenant whose turn came first).
        holder = gate.enter(Entry(bucket="chat", timeout_s=5.0, cost=100, tenant="heavy"))
        assert isinstance(holder, Slot)
        heavy = [
            gate.enter(Entry(bucket="chat", timeout_s=5.0, cost=100, tenant="heavy"))
            for _ in range(3)
        ]
        assert all(isinstance(w, Waiter) for w in heavy)
        light = gate.enter(Entry(bucket="chat", timeout_s=5.0, cost=100, tenant="light"))
        assert isinstance(light, Waiter)
        last = heavy[-1]
        assert isinstance(last, Waiter)
        with pytest.raises(Refused) as refused:
            await last.admitted()
        assert refused.value.outcome is Outcome.REJECTED_QUEUE_FULL
        assert gate.statistics()["chat"].queued == 3
        holder.release()  # the light tenant's turn starts at V: it goes next
        slot = await light.admitted()
        assert slot.ticket.tenant == "light"

    run(main)
