"""Selective relegation through the real Envoy and the real sidecar: an interactive request
that misses its bucket's queue deadline moves into the bucket it relegates to and is served
from there when a slot frees; one that misses that deadline too gets 429 as before."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from testing.clients import chat, post, slow_stream
from testing.harness import outcomes, scrape, start_stack, until_in_flight, until_queued, wait_idle
from testing.stack import Stack
from testing.wait import until
from tests.e2e.test_e2e import INTERACTIVE, run
from tests.e2e.test_pool_through_envoy import delta, limit_in

# One slot. An interactive waiter is relegated after 1 s and waits 2 s more in `late`; the
# longest wait is then 3 s, as long as batch's, so Envoy's max_message_timeout (render-envoy:
# the longest wait + 1 s) covers it only if the sidecar's own override counts the 2 s too.
POLICY = """
pool: {max_concurrency: 1}
buckets:
  - {name: interactive, match: {headers: {x-llm-class: interactive}}, queue_timeout: 1s,
     max_queue: 10, relegate_to: late}
  - {name: late, match: {headers: {x-llm-class: late}}, priority: 1, queue_timeout: 2s,
     max_queue: 10}
  - {name: batch, priority: 10, queue_timeout: 3s, max_queue: 10}
"""


@pytest.fixture(scope="module")
def stack(module_tmp: Path) -> Iterator[Stack]:
    yield from start_stack(module_tmp / "relegation", POLICY)


@pytest.fixture(autouse=True)
def idle_after(stack: Stack) -> Iterator[None]:
    yield
    wait_idle(stack)


def relegated(stack: Stack) -> dict[str, float]:
    """{outcome: count} of requests relegated from `interactive`."""
    return {
        dict(labels)["outcome"]: v
        for (name, labels), v in scrape(stack).items()
        if name == "llm_extproc_relegated_total" and dict(labels)["bucket"] == "interactive"
    }


def test_a_request_past_its_deadline_is_relegated_and_served_late(stack: Stack) -> None:
    before, counted = outcomes(stack), relegated(stack)
    assert set(counted) == {"admitted", "evicted_timeout", "expired_client_deadline"}  # at 0

    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            url = f"{stack.url}/v1/chat/completions"
            # Holds the slot ~10 s unless its client leaves first.
            holder = asyncio.ensure_future(post(s, url, chat(stream=True), slow_stream(20, 500)))
            await until_in_flight(stack, "batch", 1)
            late = asyncio.ensure_future(post(s, url, chat(), INTERACTIVE))
            await until_queued(stack, "interactive", 1)
            await until_queued(stack, "late", 1)  # its first deadline passed: relegated
            holder.cancel()  # the client leaves: its slot frees
            r = await late
            assert r.status == 200, r.body
            assert r.echo["headers"]["x-llm-bucket"] == "interactive"
            assert int(r.echo["headers"]["x-llm-queue-ms"]) >= 1000

    run(main())
    key = ("interactive", "admitted")
    moved = until(lambda: (m := delta(before, outcomes(stack))).get(key) and m, "counted")
    assert moved[key] == 1 and ("interactive", "evicted_timeout") not in moved
    assert relegated(stack)["admitted"] == counted["admitted"] + 1


def test_a_request_past_both_deadlines_gets_429(stack: Stack) -> None:
    before, counted = outcomes(stack), relegated(stack)

    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            url = f"{stack.url}/v1/chat/completions"
            holder = asyncio.ensure_future(post(s, url, chat(stream=True), slow_stream(20, 500)))
            await until_in_flight(stack, "batch", 1)
            r = await post(s, url, chat(), INTERACTIVE)
            # The sidecar's own answer at 1 s + 2 s, not Envoy's 504 at a shorter timeout.
            assert r.status == 429, r.body
            assert r.json()["error"]["code"] == "queue_timeout"
            assert r.headers.get("retry-after")
            message = r.json()["error"]["message"]
            assert "in the late queue" in message and limit_in(message) == 3.0
            holder.cancel()

    run(main())
    key = ("interactive", "evicted_timeout")
    moved = until(lambda: (m := delta(before, outcomes(stack))).get(key) and m, "counted")
    assert moved[key] == 1 and ("interactive", "admitted") not in moved
    after = relegated(stack)
    assert after["evicted_timeout"] == counted["evicted_timeout"] + 1
    assert after["admitted"] == counted["admitted"]
    # Its log line says where it waited last.
    lines = stack.procs["sidecar"].log_text().splitlines()
    assert any('"outcome":"evicted_timeout"' in x and '"relegated_to":"late"' in x for x in lines)
