"""Admission cost against queue length, in process: ``python -m bench.micro.admission_cost
[--ops 2000]``.

``extproc.pool.gate.Gate`` (the asyncio shell) and ``extproc.pool.core.admission.Admission``
(the pure core) with 10, 1,000 and 10,000 waiters behind one slot: enter (join the tail),
admit (release + hand-over), cancel and evict, each timed with ``perf_counter_ns`` around the
one call; p50 / p99 / max per operation (``bench.common.stats.percentile``). None of them may
grow with the queue. ``bench.overhead`` runs the same step after its servers have stopped and
holds it to its target (p50 at 10,000 within 1.5x of p50 at 10).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import defaultdict, deque
from typing import Any

from bench.common.stats import percentile_scaled
from bench.common.table import format_table
from bench.overhead.ways import held_policy
from extproc.pool.core.values import Entry

__all__ = ["LEVELS", "QUEUE_LENGTHS", "admission_costs", "core_costs", "format_costs", "gate_costs"]

QUEUE_LENGTHS = (10, 1000, 10000)
# The two levels measured, as they are reported.
LEVELS = {
    "gate": "extproc.pool.gate.Gate (asyncio)",
    "core": "extproc.pool.core.admission.Admission (pure)",
}


def _stats_us(ns: list[int]) -> dict[str, float]:
    return {
        "p50_us": percentile_scaled(ns, 50, 1e-3),
        "p99_us": percentile_scaled(ns, 99, 1e-3),
        "max_us": max(ns) / 1e3,
        "mean_us": sum(ns) / len(ns) / 1e3,
    }


def gate_costs(n: int, ops: int) -> dict[str, dict[str, float]]:
    """Per-operation cost of ``Gate`` with ``n`` waiters queued behind one slot, the queue kept
    at ``n`` throughout: enter (join the tail), admit (release the slot, the head waiter's
    ``admitted()`` returns it), cancel (a waiter in the middle leaves), evict (a waiter with a
    0 s deadline: the gate's real timer fires on the event loop and ``admitted()`` raises
    Refused; includes one turn of the loop)."""
    from extproc.config.policy import policy_from_yaml
    from extproc.pool.gate import Gate, Refused, Waiter

    policy = policy_from_yaml(held_policy(n + 10), "<bench>")
    clock = time.perf_counter_ns
    out: dict[str, list[int]] = defaultdict(list)

    held, due = Entry(bucket="held", timeout_s=300.0), Entry(bucket="held", timeout_s=0.0)

    async def run() -> None:
        gate = Gate(policy)
        slot = gate.enter(held)
        assert not isinstance(slot, Waiter)
        waiters: deque[Waiter] = deque()
        for _ in range(n):
            w = gate.enter(held)
            assert isinstance(w, Waiter)
            waiters.append(w)
        for i in range(ops):
            # admit: the slot goes back and the head waiter is handed it.
            t0 = clock()
            slot.release()
            head = waiters.popleft()
            slot = await head.admitted()
            t1 = clock()
            # enter: a newcomer joins the tail (keeps the queue at n).
            w = gate.enter(held)
            t2 = clock()
            assert isinstance(w, Waiter)
            waiters.append(w)
            out["admit"].append(t1 - t0)
            out["enter"].append(t2 - t1)
            # cancel: a waiter from the middle leaves; a newcomer takes its place at the tail.
            if n >= 2:
                mid = waiters[len(waiters) // 2]
                t0 = clock()
                mid.cancel()
                t1 = clock()
                _remove_middle(waiters, mid)
                w = gate.enter(held)
                assert isinstance(w, Waiter)
                waiters.append(w)
                out["cancel"].append(t1 - t0)
            # evict: a waiter whose deadline is now; the timer fires on the next loop turn.
            if i % 4 == 0:
                t0 = clock()
                e = gate.enter(due)
                assert isinstance(e, Waiter)
                try:
                    await e.admitted()
                except Refused:
                    pass
                else:
                    raise AssertionError("a 0 s deadline was admitted")
                out["evict"].append(clock() - t0)
        for w in waiters:
            w.cancel()
        slot.release()

    asyncio.run(run())
    return {op: _stats_us(ns) for op, ns in out.items()}


def _remove_middle(waiters: deque[Any], item: Any) -> None:
    # The bench's own bookkeeping, outside the timed section.
    i = len(waiters) // 2
    waiters.rotate(-i)
    assert waiters[0] is item
    waiters.popleft()
    waiters.rotate(i)


def core_costs(n: int, ops: int) -> dict[str, dict[str, float]]:
    """The same four operations on the pure core, ``Admission``."""
    from extproc.pool.core.admission import Admission
    from extproc.pool.core.values import Verdict

    clock = time.perf_counter_ns
    core = Admission({"held": (1, n + 10)})
    now = 0.0
    held = Entry(bucket="held", timeout_s=300.0)
    running = core.enqueue(held, now).ticket.id
    waiting: deque[int] = deque(core.enqueue(held, now).ticket.id for _ in range(n))
    out: dict[str, list[int]] = defaultdict(list)
    for _ in range(ops):
        now += 0.001
        t0 = clock()
        admitted = core.release(running, now)
        t1 = clock()
        assert [t.id for t in admitted] == [waiting.popleft()]
        running = admitted[0].id
        t2 = clock()
        d = core.enqueue(held, now)
        t3 = clock()
        assert d.verdict is Verdict.QUEUED
        waiting.append(d.ticket.id)
        out["admit"].append(t1 - t0)
        out["enter"].append(t3 - t2)
        if n >= 2:
            i = len(waiting) // 2
            mid = waiting[i]
            t0 = clock()
            core.cancel(mid, now)
            t1 = clock()
            waiting.rotate(-i)
            waiting.popleft()
            waiting.rotate(i)
            waiting.append(core.enqueue(held, now).ticket.id)
            out["cancel"].append(t1 - t0)
        d = core.enqueue(Entry(bucket="held", timeout_s=0.0005), now)
        t0 = clock()
        evicted = core.expire(now + 0.0005)
        t1 = clock()
        assert [t.id for t in evicted] == [d.ticket.id]
        out["evict"].append(t1 - t0)
    return {op: _stats_us(ns) for op, ns in out.items()}


def admission_costs(ops: int) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """Both levels at every queue length: {"gate"|"core": {length: {op: figures}}}."""
    return {
        "gate": {str(n): gate_costs(n, ops) for n in QUEUE_LENGTHS},
        "core": {str(n): core_costs(n, ops) for n in QUEUE_LENGTHS},
    }


def format_costs(title: str, costs: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    """One level's figures ({length: {op: figures}}) as a table under a title line."""
    ops = list(next(iter(costs.values())).keys())
    rows = [
        [
            f"{int(n):,}",
            *(
                f"{r[op]['p50_us']:.2f} / {r[op]['p99_us']:.2f} / {r[op]['max_us']:.1f}"
                for op in ops
            ),
        ]
        for n, r in costs.items()
    ]
    return [
        f"admission cost against queue length, {title}: us per op, p50 / p99 / max",
        format_table(["queued", *ops], rows),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.micro.admission_cost", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--ops", type=int, default=2000, help="operations per queue length")
    costs = admission_costs(parser.parse_args(argv).ops)
    for level, title in LEVELS.items():
        print("\n".join(format_costs(title, costs[level])) + "\n")


if __name__ == "__main__":
    main()
