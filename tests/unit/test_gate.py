"""The asyncio shell: futures, the eviction timer and cancellation races.

Every test runs on a virtual clock (``testing.clock``): the gate's one timer and the queue
timeouts fire at their exact loop times without the test waiting for them, so a deadline is
asserted as the time it fired, not within a margin. A ``sleep(0)`` is one loop turn, where the
order of events within a turn is the point.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, fields, replace

import pytest

from extproc.config.policy import BucketPolicy, policy_from_mapping
from extproc.outcome import Outcome
from extproc.pool.core.values import Entry
from extproc.pool.gate import Gate, Refused, Slot, Waiter, retry_after_s
from testing.clock import run_virtual

POLICY = policy_from_mapping(
    {
        "retry_after": {"min": "1s", "max": "30s", "jitter": 0.0},
        "buckets": [{"name": "b", "max_concurrency": 1, "queue_timeout": "200ms", "max_queue": 2}],
    }
)


def run(coro: object) -> None:
    run_virtual(asyncio.wait_for(coro, 10))  # type: ignore[arg-type]


def stats(gate: Gate) -> tuple[int, int]:
    s = gate.statistics()["b"]
    return s.in_flight, s.queued


def test_retry_after_clamps_and_jitters() -> None:
    assert retry_after_s(0.1, 1, 60, 0.5, 0.0) == 1.0
    assert retry_after_s(10, 1, 60, 0.5, 0.0) == 10.0
    assert retry_after_s(10, 1, 60, 0.5, 0.999) == pytest.approx(14.995)
    assert retry_after_s(100, 1, 60, 0.5, 0.5) == 60.0


def test_eviction_fires_at_the_deadline_while_the_slot_stays_busy() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        gate = Gate(POLICY)
        holder = gate.enter(Entry(bucket="b", timeout_s=0.2))
        assert isinstance(holder, Slot)
        waiter = gate.enter(Entry(bucket="b", timeout_s=0.2))
        assert isinstance(waiter, Waiter)
        t0 = loop.time()
        with pytest.raises(Refused) as info:
            await waiter.admitted()
        assert info.value.outcome is Outcome.EVICTED_TIMEOUT
        # By the timer, at the deadline exactly, while the holder still runs.
        assert loop.time() - t0 == info.value.waited_s == pytest.approx(0.2, abs=1e-9)
        assert info.value.retry_after_s >= 1.0
        assert stats(gate) == (1, 0)
        holder.release()
        holder.release()  # idempotent
        assert stats(gate) == (0, 0)

    run(main())


def test_a_waiter_at_its_clients_own_deadline_expires_rather_than_being_evicted() -> None:
    async def main() -> None:
        gate = Gate(POLICY)
        holder = gate.enter(Entry(bucket="b", timeout_s=0.2))
        assert isinstance(holder, Slot)
        own = gate.enter(Entry(bucket="b", timeout_s=0.05, client_deadline=True))
        assert isinstance(own, Waiter)
        with pytest.raises(Refused) as info:
            await own.admitted()
        assert info.value.outcome is Outcome.EXPIRED_CLIENT_DEADLINE
        assert info.value.code == "client_deadline" and info.value.retry_after_s >= 1.0
        s = gate.statistics()["b"]
        assert (s.evicted_total, s.client_expired_total) == (0, 1)
        holder.release()
        assert stats(gate) == (0, 0)

    run(main())


def test_queue_full_is_refused_at_once() -> None:
    async def main() -> None:
        gate = Gate(POLICY)
        gate.enter(Entry(bucket="b", timeout_s=5))
        gate.enter(Entry(bucket="b", timeout_s=5))
        gate.enter(Entry(bucket="b", timeout_s=5))
        with pytest.raises(Refused) as info:
            gate.enter(Entry(bucket="b", timeout_s=5))
        assert info.value.outcome is Outcome.REJECTED_QUEUE_FULL
        assert info.value.queued == 2

    run(main())


def test_release_hands_slot_to_head_waiter() -> None:
    async def main() -> None:
        gate = Gate(POLICY)
        holder = gate.enter(Entry(bucket="b", timeout_s=5))
        assert isinstance(holder, Slot)
        w1, w2 = (
            gate.enter(Entry(bucket="b", timeout_s=5)),
            gate.enter(Entry(bucket="b", timeout_s=5)),
        )
        assert isinstance(w1, Waiter) and isinstance(w2, Waiter)
        holder.release()
        slot = await w1.admitted()
        assert slot.ticket == w1.ticket
        assert stats(gate) == (1, 1)
        slot.release()
        (await w2.admitted()).release()
        assert stats(gate) == (0, 0)

    run(main())


def test_cancelled_waiter_leaves_the_queue_at_once() -> None:
    async def main() -> None:
        gate = Gate(POLICY)
        holder = gate.enter(Entry(bucket="b", timeout_s=5))
        assert isinstance(holder, Slot)
        waiter = gate.enter(Entry(bucket="b", timeout_s=5))
        assert isinstance(waiter, Waiter)
        task = asyncio.ensure_future(waiter.admitted())
        await asyncio.sleep(0)  # one loop turn: the task now awaits its future
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert stats(gate) == (1, 0)
        holder.release()
        assert stats(gate) == (0, 0)

    run(main())


def test_cancel_after_wake_passes_the_slot_on() -> None:
    """The waiter is handed the slot, but its task is cancelled before it resumes."""

    async def main() -> None:
        gate = Gate(POLICY)
        holder = gate.enter(Entry(bucket="b", timeout_s=5))
        assert isinstance(holder, Slot)
        woken, nxt = (
            gate.enter(Entry(bucket="b", timeout_s=5)),
            gate.enter(Entry(bucket="b", timeout_s=5)),
        )
        assert isinstance(woken, Waiter) and isinstance(nxt, Waiter)
        task = asyncio.ensure_future(woken.admitted())
        await asyncio.sleep(0)  # one loop turn: the task now awaits its future
        holder.release()  # the future gets its result...
        task.cancel()  # ...and the task is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await task
        slot = await asyncio.wait_for(nxt.admitted(), 1)
        assert stats(gate) == (1, 0)
        slot.release()
        assert stats(gate) == (0, 0)

    run(main())


def test_cancel_before_awaiting() -> None:
    async def main() -> None:
        gate = Gate(POLICY)
        holder = gate.enter(Entry(bucket="b", timeout_s=5))
        assert isinstance(holder, Slot)
        w = gate.enter(Entry(bucket="b", timeout_s=5))
        assert isinstance(w, Waiter)
        w.cancel()
        assert stats(gate) == (1, 0)
        holder.release()
        assert stats(gate) == (0, 0)

    run(main())


def test_many_waiters_evicted_together_by_one_timer() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        policy = policy_from_mapping(
            {
                "buckets": [
                    {"name": "b", "max_concurrency": 1, "queue_timeout": "100ms", "max_queue": 1000}
                ]
            }
        )
        gate = Gate(policy)
        holder = gate.enter(Entry(bucket="b", timeout_s=0.1))
        waiters = [gate.enter(Entry(bucket="b", timeout_s=0.1)) for _ in range(500)]
        results = await asyncio.gather(
            *(w.admitted() for w in waiters if isinstance(w, Waiter)), return_exceptions=True
        )
        assert all(isinstance(r, Refused) for r in results)
        assert {r.waited_s for r in results if isinstance(r, Refused)} == {loop.time()}
        assert loop.time() == pytest.approx(0.1, abs=1e-9)  # all at the one deadline
        assert gate.statistics()["b"].queued == 0
        assert isinstance(holder, Slot)
        holder.release()

    run(main())


def test_close_refuses_waiters_and_newcomers_but_keeps_running_slots() -> None:
    async def main() -> None:
        gate = Gate(POLICY)
        holder = gate.enter(Entry(bucket="b", timeout_s=5))
        waiter = gate.enter(Entry(bucket="b", timeout_s=5))
        assert isinstance(holder, Slot) and isinstance(waiter, Waiter)
        gate.close()
        with pytest.raises(Refused) as info:
            await waiter.admitted()
        assert info.value.outcome is Outcome.REJECTED_SHUTTING_DOWN
        assert info.value.code == "shutting_down" and info.value.retry_after_s == 1.0
        with pytest.raises(Refused):
            gate.enter(Entry(bucket="b", timeout_s=5))
        assert stats(gate) == (1, 0)
        holder.release()
        assert stats(gate) == (0, 0)

    run(main())


def test_close_keeps_a_slot_handed_over_but_not_yet_taken() -> None:
    """A waiter handed a slot in the same loop turn as ``close`` (its task has not run yet)
    is admitted: it holds the slot to its end, like any running request. Found by the fault
    suite (shutdown_past_grace: 15 in flight on 12, the slot went back while it ran)."""

    async def main() -> None:
        gate = Gate(POLICY)
        holder = gate.enter(Entry(bucket="b", timeout_s=5))
        waiter = gate.enter(Entry(bucket="b", timeout_s=5))
        assert isinstance(holder, Slot) and isinstance(waiter, Waiter)
        holder.release()  # hands the slot to the waiter; its future is done, not yet awaited
        gate.close()
        assert stats(gate) == (1, 0)
        slot = await waiter.admitted()
        assert stats(gate) == (1, 0)
        slot.release()
        assert stats(gate) == (0, 0)
        await gate.drained()

    run(main())


def test_retry_after_is_capped_at_the_queue_timeout() -> None:
    """A long standing queue turns over within one queue timeout (everyone in it is admitted
    or evicted by then), so Retry-After never sends clients further away than that."""

    async def main() -> None:
        policy = policy_from_mapping(
            {
                "retry_after": {"min": "1s", "max": "60s", "jitter": 0.0},
                "buckets": [
                    {"name": "b", "max_concurrency": 1, "queue_timeout": "3s", "max_queue": 100}
                ],
            }
        )
        gate = Gate(policy)
        holder = gate.enter(Entry(bucket="b", timeout_s=3))
        waiters = [gate.enter(Entry(bucket="b", timeout_s=3)) for _ in range(100)]
        with pytest.raises(Refused) as info:
            gate.enter(Entry(bucket="b", timeout_s=3))
        # Uncapped: (100 + 1) x 3 s / 1 slot = 303 s, clamped to 60 s.
        assert info.value.retry_after_s == 3.0
        for w in waiters:
            assert isinstance(w, Waiter)
            w.cancel()
        assert isinstance(holder, Slot)
        holder.release()

    run(main())


def test_admitted_unless_leaves_the_queue_when_the_stream_ends_first() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        gate = Gate(POLICY)
        holder = gate.enter(Entry(bucket="b", timeout_s=5.0))
        waiter = gate.enter(Entry(bucket="b", timeout_s=5.0))
        assert isinstance(holder, Slot) and isinstance(waiter, Waiter)
        gone: asyncio.Future[None] = loop.create_future()
        loop.call_later(0.01, gone.set_result, None)
        assert await waiter.admitted_unless(gone) is None
        assert loop.time() == pytest.approx(0.01, abs=1e-9)  # when the stream ended
        assert stats(gate) == (1, 0)  # out of the queue at once, the holder untouched
        holder.release()
        assert stats(gate) == (0, 0)

    run(main())


def test_admitted_unless_returns_the_slot_and_keeps_the_stream_future() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        gate = Gate(POLICY)
        holder = gate.enter(Entry(bucket="b", timeout_s=5.0))
        waiter = gate.enter(Entry(bucket="b", timeout_s=5.0))
        assert isinstance(holder, Slot) and isinstance(waiter, Waiter)
        gone: asyncio.Future[None] = loop.create_future()
        loop.call_later(0.01, holder.release)
        slot = await waiter.admitted_unless(gone)
        assert isinstance(slot, Slot) and stats(gate) == (1, 0)
        gone.set_result(None)  # the stream ends later: no longer the waiter's business
        await asyncio.sleep(0)  # one loop turn: whatever waited on the stream has run
        assert stats(gate) == (1, 0)
        slot.release()
        assert stats(gate) == (0, 0)

    run(main())


def test_admitted_unless_is_evicted_like_admitted() -> None:
    async def main() -> None:
        gate = Gate(POLICY)
        holder = gate.enter(Entry(bucket="b", timeout_s=0.05))
        waiter = gate.enter(Entry(bucket="b", timeout_s=0.05))
        assert isinstance(holder, Slot) and isinstance(waiter, Waiter)
        gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with pytest.raises(Refused) as info:
            await waiter.admitted_unless(gone)
        assert info.value.outcome is Outcome.EVICTED_TIMEOUT and stats(gate) == (1, 0)
        assert info.value.waited_s == pytest.approx(0.05, abs=1e-9)
        holder.release()

    run(main())


def test_a_new_bucket_key_reaches_the_core_in_the_rule() -> None:
    """A bucket key is its ``BucketPolicy`` field and where it is used: the shell hands the
    core the bucket's policy itself (``BucketRule.policy``), so nothing between the policy and
    the core names the key. A toy ``weight`` key (on a subclass here; in the code, a field of
    ``BucketPolicy``) is there to read where the core would use it, after a reload too."""

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Weighted(BucketPolicy):
        weight: int = 1

    base = policy_from_mapping(
        {"pool": {"max_concurrency": 4}, "buckets": [{"name": "b", "queue_timeout": "1s"}]}
    )
    same = {f.name: getattr(base.buckets[0], f.name) for f in fields(BucketPolicy)}

    async def main() -> None:
        toy = Weighted(**same, weight=7)
        gate = Gate(replace(base, buckets=(toy,)))
        assert gate._core._buckets["b"].rule.policy is toy
        heavier = Weighted(**same, weight=9)
        gate.reconfigure(replace(base, buckets=(heavier,)))
        got = gate._core._buckets["b"].rule.policy
        assert isinstance(got, Weighted) and got.weight == 9
        gate.close()

    run(main())
