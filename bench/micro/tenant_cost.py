"""Admission cost against tenants tracked, in process: ``python -m bench.micro.tenant_cost
[--ops 5000]``.

``extproc.pool.gate.Gate`` with one slot and one bucket in the ``fair`` order (tenants by
``x-tenant-id``, the default ``max_tracked`` of 10,000, a per-tenant ``max_queue`` so the
tenant bounds count too), the queue kept at :data:`QUEUED` waiters. Each request's enter (the
fair order's tag lookup, the tenant bounds) and admit (the head waiter's ``admitted()``: the
fair order hears the admission) are timed with ``perf_counter_ns``, for three populations:
``1 tenant``; ``10,000 tracked``, all tracked before the timed pass, so every lookup hits; and
``fresh keys``, a tenant never seen per request with 10,000 tracked, so each evicts the least
recently seen. The target (p50 of enter + admit with 10,000 tracked within 10 % of one
tenant's; ``bench.overhead`` runs this step) and its figures: docs/performance.md, "Targets".
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Final

from bench.common.policy import policy_yaml
from bench.common.stats import percentile_scaled
from bench.common.table import format_table
from extproc.pool.core.values import Entry

__all__ = ["POPULATIONS", "TRACKED", "fair_policy", "format_tenant_costs", "tenant_costs"]

TRACKED: Final = 10_000
QUEUED: Final = 10
TENANT_HEADER: Final = "x-tenant-id"
POPULATIONS: Final = ("1 tenant", f"{TRACKED:,} tracked", "fresh keys")


def fair_policy() -> str:
    """A pool of one slot, one bucket in the fair order on tenants from a trusted header
    (default ``max_tracked``), a per-tenant bound that never refuses here."""
    data = {
        "trusted_headers": [TENANT_HEADER],
        "pool": {"max_concurrency": 1},
        "buckets": [
            {
                "name": "fair",
                "queue_timeout": "300s",
                "max_queue": QUEUED + 10,
                "order": "fair",
                "tenant": {"header": TENANT_HEADER, "max_queue": QUEUED + 10},
            }
        ],
    }
    return policy_yaml(data, source="bench.micro tenant_cost")


def _tenants(population: str) -> tuple[Callable[[int], str], int]:
    """Request i's tenant, and how many requests go untimed first (to fill the table)."""
    if population == POPULATIONS[0]:
        return (lambda i: "t"), 0
    if population == POPULATIONS[1]:
        return (lambda i: f"t{i % TRACKED}"), TRACKED
    return (lambda i: f"t{i}"), TRACKED


def _stats_us(ns: list[int]) -> dict[str, float]:
    return {
        "p50_us": percentile_scaled(ns, 50, 1e-3),
        "p99_us": percentile_scaled(ns, 99, 1e-3),
        "mean_us": sum(ns) / len(ns) / 1e3,
    }


def population_costs(population: str, ops: int) -> dict[str, dict[str, float]]:
    """Per-request cost of ``Gate`` for one population: enter, admit, and both together; and
    ``tracked``: how many tenants the fair order held at the end (read from the core, the
    check that the population is what it says)."""
    from extproc.config.policy import policy_from_yaml
    from extproc.pool.core.fair import FairOrder
    from extproc.pool.gate import Gate, Waiter

    policy = policy_from_yaml(fair_policy(), "<bench>")
    tenant_of, untimed = _tenants(population)
    clock = time.perf_counter_ns
    out: dict[str, list[int]] = defaultdict(list)
    tracked = 0

    async def run() -> None:
        nonlocal tracked
        gate = Gate(policy)
        slot = gate.enter(
            Entry(bucket="fair", timeout_s=300.0, cost=300, tenant=tenant_of(0), output=100)
        )
        assert not isinstance(slot, Waiter)
        waiters: deque[Waiter] = deque()
        for i in range(1, untimed + ops + QUEUED + 1):
            entry = Entry(bucket="fair", timeout_s=300.0, cost=300, tenant=tenant_of(i), output=100)
            t0 = clock()
            w = gate.enter(entry)
            t1 = clock()
            assert isinstance(w, Waiter)
            waiters.append(w)
            if len(waiters) <= QUEUED:
                continue  # filling the queue
            slot.release()
            slot = await waiters.popleft().admitted()
            t2 = clock()
            if i > untimed + QUEUED:
                out["enter"].append(t1 - t0)
                out["admit"].append(t2 - t1)
                out["request"].append(t2 - t0)
        order = gate._core._buckets["fair"].order  # the bench's look inside, not an API
        tracked = len(order.tags) if isinstance(order, FairOrder) else 0
        for w in waiters:
            w.cancel()
        slot.release()

    asyncio.run(run())
    return {**{op: _stats_us(ns) for op, ns in out.items()}, "tracked": {"tenants": tracked}}


def tenant_costs(ops: int) -> dict[str, dict[str, dict[str, float]]]:
    """Every population: {population: {"enter"|"admit"|"request": figures}}."""
    return {p: population_costs(p, ops) for p in POPULATIONS}


def format_tenant_costs(costs: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    ops = ("enter", "admit", "request")
    rows = [
        [p, *(f"{r[op]['p50_us']:.2f} / {r[op]['p99_us']:.2f}" for op in ops)]
        for p, r in costs.items()
    ]
    return [
        f"admission cost against tenants tracked, extproc.pool.gate.Gate, fair order, {QUEUED} "
        "queued: us per request, p50 / p99",
        format_table(["tenants", *ops], rows),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.micro.tenant_cost", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--ops", type=int, default=5000, help="timed requests per population")
    print("\n".join(format_tenant_costs(tenant_costs(parser.parse_args(argv).ops))))


if __name__ == "__main__":
    main()
