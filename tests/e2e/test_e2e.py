"""Tier 3: the real Envoy 1.40 binary, the real sidecar process, a test backend, all on
127.0.0.1 with free ports. These pin the Envoy behaviour the design relies on."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from testing.clients import Reply, chat, post, slow_stream
from testing.grpc_aio import TRANSPORTS
from testing.harness import (
    backend_stats,
    gauge,
    holder_and_queue,
    outcomes,
    scrape,
    start_stack,
    until_in_flight,
    until_queued,
    wait_idle,
)
from testing.stack import Stack

POLICY = """
limits: {max_prompt_tokens: 500, default_max_tokens: 50, max_output_tokens: 100}
retry_after: {min: 1s, max: 30s}
buckets:
  - name: interactive
    match: {headers: {x-llm-class: interactive}}
    max_concurrency: 1
    # Longer than Envoy's 1s message_timeout: a queued request must not get Envoy's 504.
    queue_timeout: 1500ms
    max_queue: 2
  - name: batch
    max_concurrency: 4
    queue_timeout: 3s
    max_queue: 300
"""

INTERACTIVE = {"x-llm-class": "interactive"}


@pytest.fixture(scope="module", params=TRANSPORTS)
def stack(module_tmp: Path, request: pytest.FixtureRequest) -> Iterator[Stack]:
    # Every test here runs on both gRPC transports, the product's (h2) and the grpc.aio oracle
    # (testing.grpc_aio), through the real Envoy.
    yield from start_stack(module_tmp / request.param, POLICY, transport=request.param)


@pytest.fixture(autouse=True)
def idle_after(stack: Stack) -> Iterator[None]:
    yield
    wait_idle(stack)  # every test leaves no slot held and no one queued


async def hold_slot(
    stack: Stack, s: aiohttp.ClientSession, hold: dict[str, str], queue: int = 0
) -> tuple[asyncio.Future[Reply], list[asyncio.Future[Reply]]]:
    """The interactive slot held (``hold``: for how long), then ``queue`` queued behind it."""
    url = f"{stack.url}/v1/chat/completions"
    return await holder_and_queue(
        stack, s, url, bucket="interactive", hold=hold, queue=queue, headers=INTERACTIVE
    )


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_other_paths_pass_through_untouched(stack: Stack) -> None:
    """The allowlist (tests/e2e/test_door.py has the rest of the door)."""
    before = outcomes(stack)

    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{stack.url}/v1/models") as r:
                assert r.status == 200
                assert (await r.json())["path"] == "/v1/models"
                assert "x-llm-max-tokens" not in r.headers
            # Not JSON and not an LLM path: it must reach the backend as sent.
            async with s.post(f"{stack.url}/tokenize", data=b"{not json") as r:
                got = await r.json()
                assert r.status == 200 and got["body"] == "{not json"
                assert "x-llm-bucket" not in got["headers"]

    run(main())
    assert outcomes(stack) == before  # nothing was counted or queued


def test_oversize_prompt_gets_413(stack: Stack) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            r = await post(s, f"{stack.url}/v1/chat/completions", chat("x" * 4000))
            assert r.status == 413
            assert r.headers["content-type"] == "application/json"
            err = r.json()["error"]
            assert err["code"] == "prompt_too_long"
            assert "1003 tokens" in err["message"] and "at most 500" in err["message"]

    run(main())


def test_clamped_body_reaches_backend_with_correct_length(stack: Stack) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            r = await post(
                s, f"{stack.url}/v1/chat/completions", chat(max_tokens=5000, temperature=0.5)
            )
            assert r.status == 200
            got = r.echo
            sent = json.loads(got["body"])
            assert sent == json.loads(chat(max_tokens=100, temperature=0.5))
            assert int(got["headers"]["content-length"]) == len(got["body"].encode())
            assert got["headers"]["x-llm-bucket"] == "batch"
            assert got["headers"]["x-llm-max-tokens"] == "100"
            assert got["headers"]["x-llm-prompt-tokens"] == "5"
            assert r.headers["x-llm-max-tokens"] == "100"  # the client sees the effective value

    run(main())


def test_missing_max_tokens_gets_default_and_completions_work(stack: Stack) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            r = await post(s, f"{stack.url}/v1/completions", json.dumps({"prompt": "hi"}).encode())
            assert r.status == 200
            assert json.loads(r.echo["body"]) == {"prompt": "hi", "max_tokens": 50}
            assert r.headers["x-llm-max-tokens"] == "50"
            # Within limits: forwarded byte for byte.
            raw = b'{"prompt":  "hi",   "max_tokens": 7}'
            r = await post(s, f"{stack.url}/v1/completions", raw)
            assert r.echo["body"] == raw.decode()
            assert r.headers["x-llm-max-tokens"] == "7"

    run(main())


@pytest.mark.parametrize(
    "body,headers,status,code",
    [
        (b"{bad json", {}, 400, "invalid_json"),
        (b"[]", {}, 400, "invalid_body"),
        (chat(max_tokens="many"), {}, 400, "invalid_type"),
        (chat(max_tokens=-1), {}, 400, "invalid_value"),
        (b"\x1f\x8b\x08\x00", {"content-encoding": "gzip"}, 415, "unsupported_content_encoding"),
        (b"hello", {"content-type": "text/plain"}, 415, "unsupported_media_type"),
        (b"", {}, 400, "empty_body"),
    ],
)
def test_bad_input_gets_precise_json_error(
    stack: Stack, body: bytes, headers: dict[str, str], status: int, code: str
) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            r = await post(s, f"{stack.url}/v1/chat/completions", body, headers)
            assert r.status == status, r.body
            assert r.headers["content-type"] == "application/json"
            assert r.json()["error"]["code"] == code

    run(main())


async def read_first_chunk(resp: aiohttp.ClientResponse) -> bytes:
    line = await resp.content.readuntil(b"\n\n")
    assert line.startswith(b"data: ")
    return line


def test_slot_is_held_through_sse_and_freed_at_its_end(stack: Stack) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            async with s.post(
                f"{stack.url}/v1/chat/completions",
                data=chat(stream=True),
                headers={"content-type": "application/json", **INTERACTIVE, **slow_stream(4, 250)},
            ) as resp:
                assert resp.status == 200
                await read_first_chunk(resp)
                # Mid-stream: the backend is still working, the slot is still held.
                held = await asyncio.to_thread(gauge, stack, "llm_extproc_in_flight", "interactive")
                assert held == 1.0
                rest = await resp.read()
                assert rest.endswith(b"data: [DONE]\n\n")
            # Freed once the stream ended (how soon: bench.bounds, slot_freed_after_stream).
            await until_in_flight(stack, "interactive", 0)

    run(main())


def abandoned(stack: Stack) -> float:
    return gauge(stack, "llm_extproc_abandoned_total", "interactive")


def test_an_answer_its_client_left_at_its_stated_timeout_counts_as_abandoned(
    stack: Stack,
) -> None:
    """The SDKs state their per-attempt timeout in seconds (``x-stainless-timeout``, read by
    default). A client that gives up at its timeout in the middle of a streamed answer leaves
    it abandoned (``llm_extproc_abandoned_total``, what ``slo.abandoned`` reads); one that
    reads its whole answer within its timeout does not. The slot is freed either way."""

    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            url = f"{stack.url}/v1/chat/completions"
            before = await asyncio.to_thread(abandoned, stack)
            in_time = {"x-stainless-timeout": "600", **INTERACTIVE, **slow_stream(2, 100)}
            r = await post(s, url, chat(stream=True), in_time)
            assert r.status == 200 and r.body.endswith(b"data: [DONE]\n\n")
            await until_in_flight(stack, "interactive", 0)
            assert await asyncio.to_thread(abandoned, stack) == before
            # 20 chunks 250 ms apart: far longer than the client waits.
            late = {"x-stainless-timeout": "1", **INTERACTIVE, **slow_stream(20, 250)}
            headers = {"content-type": "application/json", **late}
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(1.0):  # the SDK's own timeout, as it stated
                    async with s.post(url, data=chat(stream=True), headers=headers) as resp:
                        assert resp.status == 200
                        await resp.read()
            await until_in_flight(stack, "interactive", 0)
            assert await asyncio.to_thread(abandoned, stack) == before + 1

    run(main())


def test_queued_longer_than_envoy_message_timeout_is_admitted(stack: Stack) -> None:
    """Envoy's message_timeout is 1s; the override sent while queued must keep Envoy from
    answering 504 while the request waits 1.2s for the slot."""

    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            url = f"{stack.url}/v1/chat/completions"
            holder, _ = await hold_slot(stack, s, slow_stream(4, 300))
            r = await post(s, url, chat(), INTERACTIVE)
            assert r.status == 200, r.body
            queue_ms = int(r.echo["headers"]["x-llm-queue-ms"])
            assert 1000 <= queue_ms < 1500
            assert (await holder).status == 200

    run(main())


def test_queue_timeout_evicts_with_429_while_slot_still_busy(stack: Stack) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            url = f"{stack.url}/v1/chat/completions"
            holder, _ = await hold_slot(stack, s, slow_stream(6, 500))
            r = await post(s, url, chat(), INTERACTIVE)
            # Evicted by the timer at its 1.5s deadline (not before), while the 3s holder still
            # runs (how late after the deadline: bench.bounds, queue_timeout_eviction).
            assert r.status == 429
            assert r.elapsed >= 1.4
            assert not holder.done()
            assert r.headers["content-type"] == "application/json"
            assert int(r.headers["retry-after"]) >= 1
            assert int(r.headers["retry-after-ms"]) >= 1000
            err = r.json()["error"]
            assert (err["code"], err["type"]) == ("queue_timeout", "rate_limit_error")
            assert (await holder).status == 200

    run(main())


def test_full_queue_rejects_at_once(stack: Stack) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            url = f"{stack.url}/v1/chat/completions"
            holder, waiting = await hold_slot(stack, s, slow_stream(3, 300), queue=2)
            r = await post(s, url, chat(), INTERACTIVE)
            # Refused while the queue was full: nobody ahead had been answered yet (how fast:
            # bench.bounds, queue_full_refusal).
            assert r.status == 429 and not holder.done() and not any(w.done() for w in waiting)
            assert r.json()["error"]["code"] == "queue_full"
            assert int(r.headers["retry-after"]) >= 1
            statuses = sorted([(await w).status for w in waiting] + [(await holder).status])
            assert statuses[0] == 200  # the holder; the queued may be admitted or evicted

    run(main())


def test_client_leaving_the_queue_frees_its_place(stack: Stack) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            holder, (leaver, stayer) = await hold_slot(stack, s, slow_stream(4, 250), queue=2)
            before = outcomes(stack).get(("interactive", "cancelled_while_queued"), 0)
            leaver.cancel()  # the client closes its connection
            # Dropped from the queue (how soon: bench.bounds, leaver_dropped).
            await until_queued(stack, "interactive", 1)
            assert outcomes(stack)[("interactive", "cancelled_while_queued")] == before + 1
            assert (await holder).status == 200
            r = await stayer
            # The stayer moved up and got the slot when the holder finished, within its 1.5 s
            # queue timeout (how soon after: bench.bounds, stayer_moves_up).
            assert r.status == 200

    run(main())


def test_hundreds_of_mixed_requests_with_random_aborts_leave_nothing_behind(stack: Stack) -> None:
    rng = random.Random(7)
    n = 300
    before = outcomes(stack)
    statuses: list[int | str] = []

    async def one(s: aiohttp.ClientSession, i: int) -> None:
        await asyncio.sleep(rng.uniform(0, 2.0))  # the subject: arrivals spread over 2 s
        headers = dict(INTERACTIVE) if rng.random() < 0.4 else {}
        stream = rng.random() < 0.5
        headers.update(slow_stream(rng.randint(1, 4), rng.choice([0, 20, 80])))
        abort_after = rng.uniform(0.01, 0.5) if rng.random() < 0.3 else None
        path = "/v1/chat/completions" if rng.random() < 0.8 else "/v1/completions"
        body = (
            chat(stream=stream, max_tokens=rng.randint(1, 300))
            if "chat" in path
            else json.dumps({"prompt": "x" * rng.randint(0, 3000), "stream": stream}).encode()
        )
        try:
            r = await asyncio.wait_for(post(s, f"{stack.url}{path}", body, headers), abort_after)
            statuses.append(r.status)
        except (TimeoutError, aiohttp.ClientError):
            statuses.append("aborted")

    async def main() -> None:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as s:
            await asyncio.gather(*(one(s, i) for i in range(n)))

    run(main())
    wait_idle(stack)
    assert set(statuses) <= {200, 413, 429, "aborted"}, statuses
    assert statuses.count(200) > n // 3
    after = outcomes(stack)
    finished = sum(after.values()) - sum(before.values())
    answered = sum(1 for x in statuses if x != "aborted")
    # Every answered request was counted once; aborted ones at most once each.
    assert answered <= finished <= n
    # The backend is not working for anyone either.
    assert backend_stats(stack)["running"] == 0
    # No request is counted under a bucket that does not exist.
    assert {b for b, _ in after} <= {"interactive", "batch", "none"}
    assert scrape(stack)  # metrics still served
