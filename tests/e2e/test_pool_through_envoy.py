"""The shared pool through the real Envoy and the real sidecar: borrowing, priority across
buckets, the vLLM priority field, client deadlines, and an adaptive limit whose metrics are
unreachable (it falls back; traffic keeps flowing)."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from testing.clients import Reply, chat, post, slow_stream
from testing.harness import (
    debug_queues,
    outcomes,
    running_stack,
    scrape,
    start_stack,
    until_in_flight,
    until_queued,
    wait_idle,
)
from testing.stack import Stack, free_port
from testing.wait import until, until_async
from tests.e2e.test_e2e import INTERACTIVE, run

POLICY = """
pool: {max_concurrency: 2}
client_deadline: {headers: [x-envoy-expected-rq-timeout-ms, x-request-deadline-ms]}
buckets:
  - name: interactive-retry
    match: {headers: {x-llm-class: interactive}, retried: true}
    priority: 1
    queue_timeout: 3s
    max_queue: 10
  - name: interactive
    match: {headers: {x-llm-class: interactive}}
    priority: 0
    queue_timeout: 3s
    max_queue: 10
  - name: batch
    priority: 10
    vllm_priority: 5
    queue_timeout: 3s
    max_queue: 10
"""


@pytest.fixture(scope="module")
def stack(module_tmp: Path) -> Iterator[Stack]:
    yield from start_stack(module_tmp / "pool", POLICY)


@pytest.fixture(autouse=True)
def idle_after(stack: Stack) -> Iterator[None]:
    yield
    wait_idle(stack)


def admitted_at(r: Reply) -> float:
    """When the sidecar let ``r`` go (the client's clock): sent, plus its time in the queue."""
    headers = r.echo["headers"] if not r.body.startswith(b"data: ") else first_echo(r.body)
    return r.sent_at + int(headers["x-llm-queue-ms"]) / 1000


def first_echo(body: bytes) -> dict[str, str]:
    """The request headers the backend echoed in a stream's first chunk."""
    chunk = json.loads(body.split(b"\n\n")[0].removeprefix(b"data: "))
    return chunk["echo"]["headers"]  # type: ignore[no-any-return]


def test_idle_capacity_is_borrowed_and_the_pool_is_shown(stack: Stack) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            url = f"{stack.url}/v1/chat/completions"
            held = [
                asyncio.ensure_future(post(s, url, chat(stream=True), slow_stream(3, 200)))
                for _ in range(2)
            ]
            await until_in_flight(stack, "batch", 2)
            q = await asyncio.to_thread(debug_queues, stack)
            # Both slots went to batch: nobody else wanted them.
            assert q["batch"]["in_flight"] == 2 and q["batch"]["pool"] == "pool"
            assert q["/pool"]["limit"] == 2 and q["/pool"]["in_flight"] == 2
            assert [(await h).status for h in held] == [200, 200]

    run(main())


async def hold_both_slots(
    stack: Stack, s: aiohttp.ClientSession, url: str
) -> tuple[asyncio.Future[Any], asyncio.Future[Any]]:
    """Two streamed requests that hold the pool's two slots, ~0.6 s and ~1.2 s (once both
    are admitted)."""
    first = asyncio.ensure_future(post(s, url, chat(stream=True), slow_stream(3, 200)))
    second = asyncio.ensure_future(post(s, url, chat(stream=True), slow_stream(6, 200)))
    await until_in_flight(stack, "batch", 2)
    return first, second


def test_a_freed_slot_goes_to_the_more_urgent_bucket_first(stack: Stack) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            url = f"{stack.url}/v1/chat/completions"
            first, second = await hold_both_slots(stack, s, url)
            batch = asyncio.ensure_future(post(s, url, chat()))  # waits first ...
            await until_queued(stack, "batch", 1)
            urgent = asyncio.ensure_future(  # ... then this one, which holds its slot ~0.6 s
                post(s, url, chat(stream=True), {**INTERACTIVE, **slow_stream(3, 200)})
            )
            u, b = await urgent, await batch
            assert (u.status, b.status) == (200, 200)
            # The first holder ends at ~0.6 s: its slot goes to the interactive request, which
            # came later; batch waits for the second holder (~1.2 s).
            assert b.sent_at < u.sent_at and admitted_at(u) < admitted_at(b), (u.body, b.body)
            assert [(await first).status, (await second).status] == [200, 200]

    run(main())


def test_a_retry_waits_behind_first_attempts_in_its_own_band(stack: Stack) -> None:
    """The SDK's x-stainless-retry-count reaches the sidecar through Envoy: a retry goes to the
    `retried: true` bucket, and a first attempt that came after it gets the freed slot first."""

    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            url = f"{stack.url}/v1/chat/completions"
            first, second = await hold_both_slots(stack, s, url)
            retried = {**INTERACTIVE, "x-stainless-retry-count": "1", **slow_stream(3, 200)}
            retry = asyncio.ensure_future(post(s, url, chat(stream=True), retried))
            await until_queued(stack, "interactive-retry", 1)
            fresh_headers = {**INTERACTIVE, "x-stainless-retry-count": "0", **slow_stream(3, 200)}
            fresh = asyncio.ensure_future(post(s, url, chat(stream=True), fresh_headers))
            f, r = await fresh, await retry
            assert (f.status, r.status) == (200, 200)
            fe, re_ = first_echo(f.body), first_echo(r.body)
            assert (fe["x-llm-bucket"], re_["x-llm-bucket"]) == ("interactive", "interactive-retry")
            # The first attempt came later and got the first freed slot; the retry the next.
            assert r.sent_at < f.sent_at and admitted_at(f) < admitted_at(r), (fe, re_)
            assert [(await first).status, (await second).status] == [200, 200]

    run(main())


def test_the_bucket_priority_is_written_for_vllm(stack: Stack) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            url = f"{stack.url}/v1/chat/completions"
            b = await post(s, url, chat(max_tokens=10, priority=-3))
            i = await post(s, url, chat(max_tokens=10), INTERACTIVE)
            sent = json.loads(b.echo["body"])
            assert sent["priority"] == 5  # the bucket's, not the client's -3
            assert int(b.echo["headers"]["content-length"]) == len(b.echo["body"].encode())
            assert "priority" not in json.loads(i.echo["body"])  # interactive sets none

    run(main())


async def fill_the_pool(
    stack: Stack, s: aiohttp.ClientSession, url: str, stream: dict[str, str]
) -> list[asyncio.Task[Reply]]:
    """Two batch requests streamed as ``stream`` says, once both hold the pool's slots."""
    held = [asyncio.ensure_future(post(s, url, chat(stream=True), stream)) for _ in range(2)]
    await until_in_flight(stack, "batch", 2)
    return held


async def while_the_pool_is_full(stack: Stack, *headers: dict[str, str]) -> list[Reply]:
    """With the pool's two slots held for ~1.5 s, one batch request per ``headers``, all at
    once: their replies."""
    async with aiohttp.ClientSession() as s:
        url = f"{stack.url}/v1/chat/completions"
        held = await fill_the_pool(stack, s, url, slow_stream(5, 300))
        replies = await asyncio.gather(*(post(s, url, chat(), h) for h in headers))
        assert [(await h).status for h in held] == [200, 200]
        return list(replies)


async def deadline_429(stack: Stack, header: str, value: str) -> tuple[int, float, str]:
    """With the pool full for ~1.5 s, a request stating ``header: value``: its status, time
    taken, and the error message (empty when admitted)."""
    (r,) = await while_the_pool_is_full(stack, {header: value})
    message = r.json()["error"]["message"] if r.status != 200 else ""
    return r.status, r.elapsed, message


def delta(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]) -> Any:
    """The outcome counts that moved between two ``outcomes`` readings."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def limit_in(message: str) -> float:
    m = re.search(r"\(limit ([\d.]+)s\)", message)
    assert m, message
    return float(m.group(1))


def test_a_stated_client_deadline_caps_the_queue_wait(stack: Stack) -> None:
    """A deadline header the policy names, 1.2 s less the 0.5 s margin: evicted after ~0.7 s
    instead of the bucket's 3 s (not before: how soon after, bench.bounds client_deadline).
    An unreadable value is ignored."""
    before = outcomes(stack)
    status, elapsed, message = run(deadline_429(stack, "x-request-deadline-ms", "1200"))
    assert status == 429 and elapsed > 0.5, (status, elapsed)
    assert limit_in(message) == pytest.approx(0.7, abs=0.05)
    # The client's own deadline, sooner than the bucket's: it expired, it was not evicted.
    assert "as long as the request's own deadline allowed" in message
    expired = ("batch", "expired_client_deadline")
    moved = until(lambda: (m := delta(before, outcomes(stack))).get(expired) and m, "counted")
    assert moved[expired] == 1 and ("batch", "evicted_timeout") not in moved
    assert run(deadline_429(stack, "x-request-deadline-ms", "soon"))[0] == 200


def invalid_deadlines(stack: Stack) -> float:
    return scrape(stack).get(("llm_extproc_client_deadline_invalid_total", ()), 0.0)


def test_a_deadline_header_of_0_is_none_and_a_bad_one_is_ignored_and_counted(
    stack: Stack,
) -> None:
    """0 means no deadline (as a route's timeout: 0s, and as Envoy means 0), so the request
    waits its bucket's queue_timeout, like one with a negative value (ignored, counted) or a
    huge one (a deadline the queue timeout caps): all three are served once a slot frees."""
    invalid = invalid_deadlines(stack)
    replies = run(
        while_the_pool_is_full(
            stack,
            {"x-request-deadline-ms": "0"},
            {"x-request-deadline-ms": "-5"},
            {"x-request-deadline-ms": "1e400"},
        )
    )
    assert [r.status for r in replies] == [200, 200, 200], [r.body for r in replies]
    assert all(int(r.echo["headers"]["x-llm-queue-ms"]) > 500 for r in replies)
    assert invalid_deadlines(stack) == invalid + 1  # the negative one only


def test_envoy_strips_a_client_sent_expected_timeout_header(stack: Stack) -> None:
    """Envoy sanitizes x-envoy-expected-rq-timeout-ms on requests from external clients
    (127.0.0.1 is not internal unless internal_address_config says so): the sidecar never
    sees a client's own value, and the request waits as long as its bucket allows."""
    status, elapsed, _ = run(deadline_429(stack, "x-envoy-expected-rq-timeout-ms", "1200"))
    assert status == 200 and elapsed > 1.2


def test_client_deadlines_that_pass_in_a_protected_band_do_not_cut_the_others(
    module_tmp: Path,
) -> None:
    """Interactive requests (a protected band) whose own deadline (100 ms, less than the
    bucket's 3 s) passes while batch holds the pool expire with 429 ``client_deadline``: 25 of
    them, then 20 served. They are not evictions, so the overload monitor sees 0 evictions
    among 20 and more decisions and keeps batch's capacity (counted as evictions, 25 of 45
    would cut batch to its guaranteed share: ``overloaded``). Without ``fail_fast``, so that
    every one of them waits (a predicted wait over 100 ms would refuse it at once)."""
    policy = POLICY.replace(
        "pool: {max_concurrency: 2}", "pool: {max_concurrency: 2, fail_fast: false}"
    )
    with running_stack(module_tmp / "deadlines", policy) as stack:
        short_deadlines_do_not_cut(stack)


def short_deadlines_do_not_cut(stack: Stack) -> None:
    short = {**INTERACTIVE, "x-request-deadline-ms": "600"}  # 100 ms after the 500 ms margin

    def overload() -> dict[str, Any]:
        return debug_queues(stack)["/pool"]["overload"]  # type: ignore[no-any-return]

    async def main() -> list[int]:
        # The monitor's first tick takes the totals it counts from: wait for it.
        await until_async(lambda: overload()["reason"], "the first tick", blocking=True)
        async with aiohttp.ClientSession() as s:
            url = f"{stack.url}/v1/chat/completions"
            held = await fill_the_pool(stack, s, url, slow_stream(10, 300))
            statuses: list[int] = []
            for wave in (10, 10, 5):  # the interactive queue holds 10
                replies = await asyncio.gather(*(post(s, url, chat(), short) for _ in range(wave)))
                statuses += [r.status for r in replies]
                assert {r.json()["error"]["code"] for r in replies} == {"client_deadline"}
            assert [(await h).status for h in held] == [200, 200]
            for _ in range(20):
                statuses.append((await post(s, url, chat(), INTERACTIVE)).status)
            # Once a tick has seen 20 decisions of the protected bands (every second).
            await until_async(
                lambda: overload()["eviction_rate"] is not None, "a rate", blocking=True
            )
            return statuses

    before = outcomes(stack)
    assert run(main()) == [429] * 25 + [200] * 20
    o = overload()
    assert (o["state"], o["factor"], o["eviction_rate"]) == ("normal", 1.0, 0.0), o
    expired = ("interactive", "expired_client_deadline")
    moved = until(lambda: (m := delta(before, outcomes(stack))).get(expired) == 25 and m, "25")
    assert ("interactive", "evicted_timeout") not in moved


def trust_localhost(cfg: dict[str, Any]) -> None:
    """The Envoy in front is trusted: requests from 127.0.0.1 are internal. And two more chat
    routes, chosen by ``x-test-route``: one with ``timeout: 0s`` (none), one with no
    ``timeout`` (Envoy's default, 15 s)."""
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    hcm["typed_config"]["use_remote_address"] = True
    hcm["typed_config"]["internal_address_config"] = {
        "cidr_ranges": [{"address_prefix": "127.0.0.1", "prefix_len": 32}]
    }
    routes = hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    for name, route in (("no-timeout", {"timeout": "0s"}), ("default-timeout", {})):
        match = {"name": "x-test-route", "string_match": {"exact": name}}
        routes.insert(
            0,
            {
                "match": {"path": "/v1/chat/completions", "headers": [match]},
                "route": {"cluster": "backend", **route},
            },
        )


@pytest.fixture(scope="module")
def trusted(module_tmp: Path) -> Iterator[Stack]:
    yield from start_stack(module_tmp / "trusted", POLICY, envoy_patch=trust_localhost)


def test_an_expected_timeout_from_a_trusted_envoy_caps_the_queue_wait(trusted: Stack) -> None:
    status, elapsed, message = run(deadline_429(trusted, "x-envoy-expected-rq-timeout-ms", "1200"))
    assert status == 429 and elapsed > 0.5, (status, elapsed)
    assert limit_in(message) == pytest.approx(0.7, abs=0.05)


def test_envoy_never_sends_an_expected_timeout_of_0(trusted: Stack) -> None:
    """What Envoy's router writes into x-envoy-expected-rq-timeout-ms upstream (what a sidecar
    behind this Envoy would read): the route's timeout in ms, Envoy's default 15 s for a route
    without one, and no header at all for a route with ``timeout: 0s`` (none). So a 0 in the
    header never comes from an Envoy: the sidecar reads it as Envoy reads a 0 timeout, none.
    """

    async def main() -> dict[str, str | None]:
        async with aiohttp.ClientSession() as s:
            url = f"{trusted.url}/v1/chat/completions"
            seen: dict[str, str | None] = {}
            for route in ("shipped", "no-timeout", "default-timeout"):
                r = await post(s, url, chat(), {"x-test-route": route})
                assert r.status == 200, r.body
                seen[route] = r.echo["headers"].get("x-envoy-expected-rq-timeout-ms")
            return seen

    assert run(main()) == {"shipped": "600000", "no-timeout": None, "default-timeout": "15000"}


def test_an_expected_timeout_of_0_from_a_trusted_envoy_is_no_deadline(trusted: Stack) -> None:
    (r,) = run(while_the_pool_is_full(trusted, {"x-envoy-expected-rq-timeout-ms": "0"}))
    assert r.status == 200 and int(r.echo["headers"]["x-llm-queue-ms"]) > 500, r.body


def test_unreachable_backend_metrics_fall_back_and_never_stop_traffic(
    module_tmp: Path,
) -> None:
    """Adaptive limit with a metrics URL nobody listens on: the limit holds, then falls back
    to pool.max_concurrency; requests are served throughout."""
    policy = f"""
pool:
  max_concurrency: 3
  adaptive: {{min: 1, max: 64, initial: 8, interval: 100ms, window: 1s, stale_after: 500ms,
             fallback_after: 1s, slo: {{ttft: 1s}}}}
backend: {{metrics: ["http://127.0.0.1:{free_port()}/metrics"]}}
buckets:
  - {{name: all, queue_timeout: 2s, max_queue: 50}}
"""
    with running_stack(module_tmp / "fallback", policy) as stack:

        def state() -> str:
            return str(debug_queues(stack)["/pool"]["adaptive"]["state"])

        async def main() -> None:
            async with aiohttp.ClientSession() as s:
                url = f"{stack.url}/v1/chat/completions"
                statuses = []
                # Requests one after another until the limit has fallen back (after 1 s),
                # bounded: served throughout.
                deadline = time.monotonic() + 20
                while len(statuses) <= 5 or await asyncio.to_thread(state) != "fallback":
                    assert time.monotonic() < deadline, ("no fallback", state(), statuses)
                    statuses.append((await post(s, url, chat())).status)
                assert set(statuses) == {200} and len(statuses) > 5

        run(main())
        q = debug_queues(stack)["/pool"]
        assert (q["limit"], q["adaptive"]["state"]) == (3, "fallback")
        assert q["adaptive"]["signals"]["endpoints_failed"] == 1
        text = urllib.request.urlopen(stack.metrics_url, timeout=5).read().decode()
        assert "llm_extproc_adaptive_state 2.0" in text
        assert "llm_extproc_backend_up 0.0" in text
        assert outcomes(stack).get(("all", "admitted"), 0) > 5


def test_the_limit_follows_the_simulator(module_tmp: Path) -> None:
    """Against the vLLM-like simulator with room to spare: demand and met objectives raise
    the limit from its initial 2."""
    policy_dir = module_tmp / "adaptive"
    policy_dir.mkdir(parents=True, exist_ok=True)
    backend = [sys.executable, "-m", "bench.sim", "--port", "{port}", "--speedup", "20"]
    stack = Stack(backend_argv=backend, log_dir=policy_dir)
    path = policy_dir / "policy.yaml"
    path.write_text(
        f"""
pool:
  adaptive: {{min: 1, max: 32, initial: 2, interval: 100ms, window: 2s,
             slo: {{ttft: 2s, inter_token: 1s}}}}
backend: {{metrics: ["{stack.backend_url}/metrics"]}}
buckets:
  - {{name: all, queue_timeout: 5s, max_queue: 500}}
"""
    )
    stack.policy_path = path
    with stack:

        async def main() -> list[int]:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
                url = f"{stack.url}/v1/chat/completions"
                tasks = [
                    asyncio.ensure_future(post(s, url, chat(max_tokens=64), limit_s=30))
                    for _ in range(200)
                ]
                return [(await t).status for t in tasks]

        statuses = run(main())
        assert statuses.count(200) >= 190, statuses
        q = debug_queues(stack)["/pool"]
        assert q["limit"] > 2 and q["adaptive"]["state"] == "tracking", q
        assert q["adaptive"]["signals"]["endpoints_ok"] == 1


def test_a_wait_that_cannot_fit_the_deadline_is_refused_at_once(stack: Stack) -> None:
    """Ten requests holding ~0.3 s teach the pool how fast it frees slots (2 / 0.3 s); with
    the pool then held and eight requests queued, one that may wait only 0.5 s (1 s deadline
    less the margin) would need about 1.3 s: 429 queue_wait_too_long at once, with
    Retry-After. (Eight queued: the bucket's queue holds ten.)"""

    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            url = f"{stack.url}/v1/chat/completions"
            for _ in range(5):  # ten releases after ~0.3 s holds: about 6.7 slots/s
                pair = [post(s, url, chat(stream=True), slow_stream(1, 300)) for _ in range(2)]
                assert [r.status for r in await asyncio.gather(*pair)] == [200, 200]
            held = [
                asyncio.ensure_future(post(s, url, chat(stream=True), slow_stream(5, 300)))
                for _ in range(2)
            ]
            await until_in_flight(stack, "batch", 2)
            waiting = [asyncio.ensure_future(post(s, url, chat())) for _ in range(8)]
            await until_queued(stack, "batch", 8)
            r = await post(s, url, chat(), {"x-request-deadline-ms": "1000"})
            # Refused by the prediction before anything ahead of it moved, not by its deadline
            # (how fast: bench.bounds, wait_too_long_refusal).
            assert r.status == 429, (r.status, r.elapsed, r.body)
            assert not any(h.done() for h in held) and not any(w.done() for w in waiting)
            err = r.json()["error"]
            assert (err["code"], err["type"]) == ("queue_wait_too_long", "rate_limit_error")
            assert int(r.headers["retry-after"]) >= 1
            assert [(await h).status for h in held] == [200, 200]
            done = [await w for w in waiting]
            assert [q.status for q in done] == [200] * 8, [q.body for q in done]

    run(main())
    assert outcomes(stack)[("batch", "rejected_wait_too_long")] >= 1


def short_llm_routes(cfg: dict[str, Any]) -> None:
    """The LLM routes time out after 2 s (envoy.yaml: 600 s)."""
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    for vh in hcm["typed_config"]["route_config"]["virtual_hosts"]:
        for route in vh["routes"]:
            if route.get("route", {}).get("timeout") == "600s":
                route["route"]["timeout"] = "2s"


def test_the_route_timeout_does_not_count_the_queue_wait(module_tmp: Path) -> None:
    """Envoy 1.40 starts a route's timeout when the router gets the request, after the sidecar
    let it go: a request that waits 1.4 s in the queue and then streams for 1.5 s (2.9 s in
    all) completes on a route with a 2 s timeout, while a 6 s stream alone is cut. So a
    route timeout below a queue timeout is no problem (extproc.config.envoy.deadline_problems
    does not report one)."""
    policy = "pool: {max_concurrency: 1}\nbuckets: [{name: all, queue_timeout: 5s, max_queue: 5}]"
    with running_stack(module_tmp / "route", policy, envoy_patch=short_llm_routes) as stack:

        async def main() -> None:
            async with aiohttp.ClientSession() as s:
                url = f"{stack.url}/v1/chat/completions"
                holder = asyncio.ensure_future(post(s, url, chat(stream=True), slow_stream(7, 200)))
                await until_in_flight(stack, "all", 1)
                waited = await post(s, url, chat(stream=True), slow_stream(5, 300))
                assert (await holder).status == 200
                assert waited.status == 200 and waited.elapsed > 2.3, waited.elapsed
                assert waited.body.endswith(b"data: [DONE]\n\n")  # the whole stream
                t0 = time.monotonic()
                with pytest.raises(aiohttp.ClientPayloadError):  # Envoy cut the stream
                    await post(s, url, chat(stream=True), slow_stream(20, 300))
                # Not before the timeout; in fact about a second after it: a response already
                # streaming is reset later than a request still waiting for its answer gets its
                # 504 (3.0 s for a 2 s timeout, 2.0 s for 1 s; Envoy 1.40; bench.bounds,
                # route_timeout_cut).
                assert time.monotonic() - t0 > 1.9, time.monotonic() - t0

        run(main())
