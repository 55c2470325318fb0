"""``bench.load``'s one client: the open-loop sender (order, concurrency, the stop and the hard
cap, failures), one attempt against an in-process server (error codes, giving up, streams),
and the presets of the demo, the storm and the soak (deterministic, the shares they promise)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
from aiohttp import web

from bench.load.client import Call, Reply, attempt, error_code, send_all, session
from bench.load.presets import demo_burst, soak_arrivals, storm_arrivals

T = TypeVar("T")


def run(factory: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        return await asyncio.wait_for(factory(), 20)

    return asyncio.run(main())


def test_send_all_keeps_to_the_schedule_and_the_concurrency() -> None:
    running = peak = 0

    async def send(item: int, at: float) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1
        return item * 10

    arrivals = [(i * 0.001, i) for i in range(20)]
    sent = run(lambda: send_all(arrivals, send, concurrency=3))
    assert sent.count == 20 and peak == 3 and not sent.unfinished
    assert sorted(sent.done) == [(i, 10 * i) for i in range(20)]
    # keep=False: only the count.
    sent = run(lambda: send_all(arrivals, send, keep=False))
    assert sent.count == 20 and sent.done == [] and sent.lag_max_s >= 0


def test_send_all_stops_sending_and_cuts_at_the_cap() -> None:
    async def slow(item: int, at: float) -> int:
        await asyncio.sleep(0.5 if item else 0.0)
        return item

    # One place: the second arrival's turn comes after the stop, so it and the rest are not sent.
    sent = run(lambda: send_all([(0.0, 1), (0.0, 2), (0.0, 3)], slow, concurrency=1,
                                stop_after_s=0.1))  # fmt: skip
    assert sent.count == 1 and [item for item, _ in sent.done] == [1]
    # The hard cap cancels what is still open; a send that raised is reported with its error.

    async def mixed(item: int, at: float) -> int:
        if item == 2:
            raise RuntimeError("boom")
        await asyncio.sleep(5.0 if item else 0.0)
        return item

    sent = run(lambda: send_all([(0.0, 0), (0.0, 1), (0.0, 2)], mixed, hard_cap_s=0.1))
    assert sent.count == 3 and sent.done == [(0, 0)]
    cut = {item: exc for item, _, exc in sent.unfinished}
    assert set(cut) == {1, 2} and cut[1] is None and isinstance(cut[2], RuntimeError)


def test_attempt_reads_codes_streams_and_gives_up() -> None:
    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        kind = body["kind"]
        if kind == "refuse":
            return web.json_response(
                {"error": {"code": "queue_full"}}, status=429, headers={"retry-after": "2"}
            )
        if kind == "slow":
            await asyncio.sleep(5)
        if kind == "stream":
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            for text in ("a", "b"):
                chunk = {"choices": [{"delta": {"content": text}}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp
        return web.json_response({"usage": {"completion_tokens": 7}})

    async def go() -> list[Reply]:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = next(a[1] for a in runner.addresses if isinstance(a, tuple))
        url = f"http://127.0.0.1:{port}"
        try:
            async with session() as http:
                return [
                    await attempt(http, url, Call(body=json.dumps({"kind": k}).encode(),
                                                  stream=k == "stream", give_up_s=0.3))
                    for k in ("ok", "refuse", "slow", "stream")
                ]  # fmt: skip
        finally:
            await runner.cleanup()

    ok, refused, slow, stream = run(go)
    assert (ok.outcome, ok.status, ok.tokens, ok.complete) == ("ok", 200, 7, True)
    assert (refused.outcome, refused.status, refused.code) == ("http_error", 429, "queue_full")
    assert refused.retry_after == "2"  # whatever case the answer's header had
    assert (slow.outcome, slow.status, slow.error) == ("timeout", None, "TimeoutError")
    assert 0.3 <= slow.seconds < 2
    assert (stream.outcome, stream.tokens) == ("ok", 2) and stream.first_token_at is not None
    assert error_code(b"not json") is None and error_code(b'{"error": {"code": 3}}') is None


def test_demo_burst() -> None:
    burst = demo_burst(250.0, 4.0, 60)
    assert burst == demo_burst(250.0, 4.0, 60)  # one seed, one burst
    kinds = [c.label for _, c in burst]
    assert (kinds.count("batch"), kinds.count("oversize"), kinds.count("interactive")) == (
        60,
        3,
        1000,
    )
    assert all(t == 0.0 for t, c in burst if c.label != "interactive")
    times = [t for t, c in burst if c.label == "interactive"]
    assert times[:2] == [0.0, 0.004] and times == sorted(times)
    interactive = next(c for _, c in burst if c.label == "interactive")
    assert interactive.headers == {"x-llm-class": "interactive"}
    assert json.loads(interactive.body)["max_tokens"] == 64


def test_storm_and_soak_arrivals() -> None:
    storm = storm_arrivals(2000, abort_share=0.5)
    assert storm == storm_arrivals(2000, abort_share=0.5)
    calls = [c for _, c in storm]
    aborts = [c for c in calls if c.aborts]
    assert 0.45 < len(aborts) / len(calls) < 0.55
    assert all(c.give_up_s is not None and c.give_up_s <= 0.3 for c in aborts)
    assert {c.give_up_s for c in calls if not c.aborts} == {60.0}
    assert 0.45 < sum(c.stream for c in calls) / len(calls) < 0.55
    assert {c.headers["x-test-delay-ms"] for c in calls} == {"0", "10", "50"}
    interactive = sum(c.headers.get("x-llm-class") == "interactive" for c in calls)
    assert 0.45 < interactive / len(calls) < 0.55

    soak = list(soak_arrivals(100.0, 20.0, backend_ms=100, abort_share=0.2))
    assert soak[0][0] == 0.0 and all(t < 20.0 for t, _ in soak)
    assert len(soak) == pytest.approx(2000, rel=0.1)  # Poisson at 100/s for 20 s
    share = sum(c.aborts for _, c in soak) / len(soak)
    assert share == pytest.approx(0.2, abs=0.04)
    assert all(c.give_up_s is not None and c.give_up_s <= 0.2 for _, c in soak if c.aborts)
    assert {c.headers["x-test-delay-ms"] for _, c in soak} == {"100"}
