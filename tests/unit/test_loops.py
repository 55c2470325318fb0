"""Tier 1: the background loops' guard (``extproc.loops``), on a virtual clock
(``testing.clock``): a round that raises is logged with its traceback and counted, the next one
comes (after a backoff while they keep failing), and a loop that ends anyway is logged. Each
loop under its guard: the lease manager's, tests/shared/test_redis_input.py; the poller's,
tests/unit/test_adaptive.py; the overload tick's, tests/unit/test_control.py; the policy
watcher's, tests/service/test_policy_watch.py."""

from __future__ import annotations

import asyncio
import logging

import pytest

from extproc.loops import MAX_BACKOFF_S, Guard
from testing.clock import run_virtual

log = logging.getLogger("test.loops")


class Boom(BaseException):
    """Not an ``Exception``: what the guard lets through (a loop that ends)."""


def test_a_failed_round_is_logged_counted_and_the_loop_backs_off_then_recovers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Rounds every second; rounds 2 to 6 raise: the pauses after them double (1, 2, 4, then
    ``MAX_BACKOFF_S``), and the round that succeeds brings back the loop's own pause."""
    counted: list[str] = []
    times: list[float] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        guard = Guard("backend-poller", log, counted.append)
        done = asyncio.Event()

        async def round_() -> None:
            times.append(round(loop.time(), 9))
            if len(times) == 9:
                done.set()
            if 2 <= len(times) <= 6:
                raise RuntimeError(f"round {len(times)} broke")

        task = guard.start(round_, 1.0)
        await done.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert guard.failures == 0 and guard.errors == 5

    with caplog.at_level(logging.ERROR, logger="test.loops"):
        run_virtual(main())
    assert MAX_BACKOFF_S == 5.0
    # 0 ok, 1 fails (+1), 2 (+2), 4 (+4), 8 (+5), 13 (+5), 18 ok (+1), 19, 20.
    assert times == [0.0, 1.0, 2.0, 4.0, 8.0, 13.0, 18.0, 19.0, 20.0]
    assert counted == ["backend-poller"] * 5
    records = caplog.records
    assert [r.getMessage() for r in records][:2] == [
        "backend-poller: a round failed (1 in a row); the loop goes on in 1.00 s",
        "backend-poller: a round failed (2 in a row); the loop goes on in 2.00 s",
    ]
    assert all(r.exc_info is not None and "broke" in str(r.exc_info[1]) for r in records)
    assert len(records) == 5  # a cancelled loop is not an error


def test_a_loop_that_ends_anyway_is_logged_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    counted: list[str] = []

    async def main() -> None:
        guard = Guard("overload", log, counted.append)

        async def round_() -> None:
            raise Boom("not an Exception")

        task = guard.start(round_, 1.0)
        with pytest.raises(Boom):
            await task
        await asyncio.sleep(0)  # the done-callback runs on the next turn

    with caplog.at_level(logging.ERROR, logger="test.loops"):
        run_virtual(main())
    assert counted == ["overload"]
    (record,) = caplog.records
    assert (
        record.getMessage()
        == "overload: the loop ended (Boom('not an Exception')); it no longer runs"
    )
    assert record.exc_info is not None


def test_the_backoff_of_a_loop_failing_for_ever_stays_bounded() -> None:
    guard = Guard("policy-watch", log)
    backoffs = [guard.failed(0.05) for _ in range(2000)]  # (logs each: the caller's except)
    assert backoffs[:3] == [0.05, 0.1, 0.2] and max(backoffs) == MAX_BACKOFF_S
    assert Guard("x", log).failed(30.0) == 30.0  # never less than the loop's own pause
