"""testing.clock: timers fire in order, at their exact loop times, without waiting for them."""

from __future__ import annotations

import asyncio
import threading

import pytest

from testing.clock import run_virtual


def test_a_long_sleep_returns_at_once_at_its_exact_time() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(3600)
        return loop.time()

    assert run_virtual(main()) == 3600


def test_timers_fire_in_deadline_order_at_their_times() -> None:
    async def main() -> list[tuple[float, str]]:
        loop = asyncio.get_running_loop()
        fired: list[tuple[float, str]] = []
        done = loop.create_future()
        loop.call_later(2.0, lambda: fired.append((loop.time(), "late")))
        loop.call_later(0.5, lambda: fired.append((loop.time(), "early")))
        loop.call_at(3.0, done.set_result, None)
        await done
        return fired

    assert run_virtual(main()) == [(0.5, "early"), (2.0, "late")]


def test_a_timeout_fires_at_its_deadline_and_work_that_fits_finishes() -> None:
    async def main() -> tuple[float, str]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[str] = asyncio.Queue()

        async def producer() -> None:
            await asyncio.sleep(1.0)
            await queue.put("in time")

        task = asyncio.ensure_future(producer())
        got = await asyncio.wait_for(queue.get(), 1.5)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(queue.get(), 1.5)
        await task
        return loop.time(), got

    assert run_virtual(main()) == (2.5, "in time")


def test_a_thread_still_wakes_a_loop_that_has_no_timer() -> None:
    async def main() -> str:
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[str] = loop.create_future()
        threading.Thread(target=lambda: loop.call_soon_threadsafe(answer.set_result, "hi")).start()
        return await answer

    assert run_virtual(main()) == "hi"
