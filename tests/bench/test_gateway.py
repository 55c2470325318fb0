"""The priority gateway (bench.gateway): the pure pool with a fake clock, table-driven, then the
aiohttp proxy in front of a real simulator on 127.0.0.1 at a high speedup (short requests jump
the queue, a queue timeout is only noticed when the request is dequeued)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from bench.gateway.__main__ import config_from_args
from bench.gateway.core import Grants, PriorityPool, Ticket
from bench.gateway.server import GATEWAY_KEY, Gateway, GatewayConfig, create_app
from bench.sim.profiles import PROFILES, EngineConfig
from bench.sim.server import SimConfig, start_server
from testing.wait import until_async


def t(i: int, *, short: bool = False, deadline: float = 100.0) -> Ticket:
    return Ticket(id=i, short=short, deadline_s=deadline)


# ---------------------------------------------------------------------------------------------
# The pool, pure
# ---------------------------------------------------------------------------------------------


def test_free_worker_runs_at_once_then_queues() -> None:
    pool = PriorityPool(workers=2, max_queue=10)
    assert pool.enqueue(t(1), 0.0) == Grants(run=(1,))
    assert pool.enqueue(t(2), 0.0) == Grants(run=(2,))
    assert pool.enqueue(t(3), 0.0) == Grants()
    assert repr(pool) == "pool 2/2 +0 short +1 long queued"


@pytest.mark.parametrize(
    ("queued", "order"),
    [
        # (id, short) in arrival order -> the order in which released workers take them
        ([(2, False), (3, True), (4, False), (5, True)], [3, 5, 2, 4]),
        ([(2, False), (3, False)], [2, 3]),  # FIFO among equals
        ([(2, True), (3, True)], [2, 3]),
    ],
)
def test_short_requests_first_fifo_otherwise(
    queued: list[tuple[int, bool]], order: list[int]
) -> None:
    pool = PriorityPool(workers=1, max_queue=10)
    pool.enqueue(t(1), 0.0)
    for i, short in queued:
        assert pool.enqueue(t(i, short=short), 0.0) == Grants()
    got = [pool.release(1.0).run for _ in order]
    assert got == [(i,) for i in order]


def test_deadline_checked_only_at_dequeue() -> None:
    pool = PriorityPool(workers=1, max_queue=10)
    pool.enqueue(t(1), 0.0)
    pool.enqueue(t(2, deadline=1.0), 0.0)
    pool.enqueue(t(3, deadline=50.0), 0.0)
    # Nothing happens at the deadline itself: no timer. At the next release, 2 is found expired
    # and 3 takes the worker in the same call.
    assert pool.statistics().queued_long == 2
    assert pool.release(5.0) == Grants(run=(3,), expired=(2,))
    assert pool.running == 1


def test_full_queue_rejects_and_cancel_drops() -> None:
    pool = PriorityPool(workers=1, max_queue=2)
    pool.enqueue(t(1), 0.0)
    pool.enqueue(t(2), 0.0)
    pool.enqueue(t(3, short=True), 0.0)
    assert pool.enqueue(t(4), 0.0) == Grants(rejected=(4,))
    assert pool.cancel(3) and not pool.cancel(3) and not pool.cancel(1)
    assert pool.release(0.0) == Grants(run=(2,))
    assert pool.release(0.0) == Grants()
    with pytest.raises(RuntimeError):
        pool.release(0.0)


def test_cli() -> None:
    cfg, host, port = config_from_args(
        ["--upstream", "http://127.0.0.1:1/", "--workers", "8", "--port", "9",
         "--class-queue-timeout", "interactive=0.5", "--queue-timeout", "80"]
    )  # fmt: skip
    assert (host, port, cfg.upstreams, cfg.workers) == ("127.0.0.1", 9, ("http://127.0.0.1:1",), 8)
    assert cfg.class_queue_timeout_s == {"interactive": 0.5} and cfg.queue_timeout_s == 80


# ---------------------------------------------------------------------------------------------
# The proxy in front of a real simulator
# ---------------------------------------------------------------------------------------------

SPEEDUP = 20.0


@asynccontextmanager
async def gateway(workers: int = 1) -> AsyncIterator[tuple[str, Gateway]]:
    """The proxy's URL, and its Gateway (pool and counters, in this process) to wait on."""
    sim = await start_server(
        SimConfig(engine=EngineConfig(profile=PROFILES["a100"]), speedup=SPEEDUP)
    )
    app = create_app(
        GatewayConfig(
            upstreams=(sim.url,),
            workers=workers,
            short_prompt=100,
            short_output=50,
            queue_timeout_s=30.0,
            class_queue_timeout_s={"interactive": 0.05},
        )
    )
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = next(a[1] for a in runner.addresses if isinstance(a, tuple))
    try:
        yield f"http://127.0.0.1:{port}", app[GATEWAY_KEY]
    finally:
        await runner.cleanup()
        await sim.close()


def body(prompt_tokens: int, max_tokens: int, *, stream: bool = False) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "x" * (4 * prompt_tokens)}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


def run(coro_factory: Any, timeout: float = 20.0) -> Any:
    async def main() -> Any:
        return await asyncio.wait_for(coro_factory(), timeout)

    return asyncio.run(main())


def test_short_request_overtakes_queued_long_one() -> None:
    async def scenario() -> tuple[list[str], dict[str, Any]]:
        done: list[str] = []
        async with gateway() as (url, gw), aiohttp.ClientSession() as s:

            async def call(name: str, payload: dict[str, Any]) -> None:
                async with s.post(f"{url}/v1/chat/completions", json=payload) as r:
                    assert r.status == 200, await r.text()
                    data = await r.json()
                    assert data["usage"]["completion_tokens"] == payload["max_tokens"]
                done.append(name)

            pool = gw.pool.statistics
            # ~6 s simulated: holds the one worker while the other two queue behind it.
            calls = [asyncio.create_task(call("blocker", body(10, 400)))]
            await until_async(lambda: pool().running == 1, "the blocker holds the worker")
            calls.append(asyncio.create_task(call("long", body(500, 20))))
            await until_async(lambda: pool().queued_long == 1, "the long one queued")
            calls.append(asyncio.create_task(call("short", body(10, 20))))
            await asyncio.gather(*calls)
            async with s.get(f"{url}/gateway/stats") as r:
                stats = await r.json()
        return done, stats

    done, stats = run(scenario)
    assert done == ["blocker", "short", "long"]
    assert stats["admitted"] == 3 and stats["admitted_short"] == 1 and stats["running"] == 0


def test_queue_timeout_noticed_at_dequeue_and_streams_pass_through() -> None:
    async def scenario() -> tuple[float, float, int, str, bytes]:
        async with gateway() as (url, gw), aiohttp.ClientSession() as s:
            blocker = asyncio.create_task(
                s.post(f"{url}/v1/chat/completions", json=body(10, 400, stream=True))
            )
            await until_async(
                lambda: gw.pool.statistics().running == 1, "the blocker holds the worker"
            )
            t0 = time.monotonic()
            async with s.post(
                f"{url}/v1/chat/completions",
                json=body(10, 5),
                headers={"x-llm-class": "interactive"},  # 50 ms queue timeout
            ) as r:
                status, error = r.status, (await r.json())["error"]["code"]
            waited = time.monotonic() - t0
            resp = await blocker
            streamed = await resp.read()
            resp.release()
            blocker_wall = time.monotonic() - t0
        return waited, blocker_wall, status, error, streamed

    waited, blocker_wall, status, error, streamed = run(scenario)
    assert (status, error) == (503, "queue_timeout")
    # Answered when the blocker's stream ended and freed the worker, long after its 50 ms.
    assert waited > 0.1 and waited == pytest.approx(blocker_wall, abs=0.1)
    assert streamed.endswith(b"data: [DONE]\n\n") and streamed.count(b"data:") > 400


def test_client_leaving_while_queued_frees_its_place() -> None:
    async def scenario() -> dict[str, Any]:
        async with gateway() as (url, gw), aiohttp.ClientSession() as s:
            pool = gw.pool.statistics
            blocker = asyncio.create_task(s.post(f"{url}/v1/chat/completions", json=body(10, 300)))
            await until_async(lambda: pool().running == 1, "the blocker holds the worker")
            queued = asyncio.create_task(s.post(f"{url}/v1/chat/completions", json=body(10, 5)))
            await until_async(lambda: pool().queued_short == 1, "the second one queued")
            queued.cancel()  # its client leaves
            with pytest.raises(asyncio.CancelledError):
                await queued
            await until_async(
                lambda: gw.counters.cancelled_queued == 1, "the gateway saw the client leave"
            )
            resp = await blocker
            assert resp.status == 200
            resp.release()
            async with s.post(f"{url}/v1/chat/completions", json=body(10, 5)) as r:
                assert r.status == 200  # the worker was not leaked
            async with s.get(f"{url}/gateway/stats") as r:
                stats: dict[str, Any] = await r.json()
        return stats

    stats = run(scenario)
    assert stats["cancelled_queued"] == 1 and stats["admitted"] == 2
    assert stats["running"] == 0 and stats["queued_short"] == stats["queued_long"] == 0
