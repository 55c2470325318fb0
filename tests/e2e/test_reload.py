"""Tier 3: tuning policy live, from Envoy's routes (file-based RDS + route metadata) and from
the sidecar's own policy file, while traffic flows. Nothing may fail across the reloads."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from testing.envoy import with_route_metadata
from testing.harness import gauge, scrape, start_stack, wait_gauge, wait_idle
from testing.stack import Stack
from testing.wait import until

POLICY = """
limits: {max_prompt_tokens: 1000, default_max_tokens: 20, max_output_tokens: 50}
buckets:
  - {name: b, max_concurrency: 4, queue_timeout: 5s, max_queue: 100}
"""


@pytest.fixture(scope="module")
def stack(module_tmp: Path) -> Iterator[Stack]:
    for stack in start_stack(module_tmp, POLICY, rds=True):
        # The generated routes, kept to derive every later version from.
        BASE_ROUTES[stack] = yaml.safe_load(stack.routes_path.read_text())
        yield stack


BASE_ROUTES: dict[Stack, dict[str, Any]] = {}


def post(stack: Stack, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": False})
    req = urllib.request.Request(
        stack.url + "/v1/chat/completions",
        data=body.encode(),
        headers={"content-type": "application/json", **(headers or {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def routes_with(stack: Stack, override: dict[str, Any] | None) -> dict[str, Any]:
    """The generated routes with `override` as llm_extproc metadata on the plain chat route."""
    return with_route_metadata(BASE_ROUTES[stack], "/v1/chat/completions", override)


def rds_stat(stack: Stack, name: str) -> int:
    return stack.envoy_stat(f"http.llm.rds.llm.{name}")


def apply_routes(stack: Stack, routes: dict[str, Any] | str, stat: str = "update_success") -> None:
    before = rds_stat(stack, stat)
    stack.write_routes(routes)
    until(lambda: rds_stat(stack, stat) > before, f"Envoy's RDS {stat} counted")


class Load:
    """A few client threads sending requests back to back until stopped; collects statuses."""

    def __init__(self, stack: Stack, clients: int = 3, delay_ms: int = 50) -> None:
        self.statuses: list[int] = []
        self._stop = threading.Event()
        headers = {"x-test-delay-ms": str(delay_ms)}

        def loop() -> None:
            deadline = time.monotonic() + 120  # bounded, whatever happens
            while not self._stop.is_set() and time.monotonic() < deadline:
                self.statuses.append(post(stack, headers)[0])

        self._threads = [threading.Thread(target=loop, daemon=True) for _ in range(clients)]
        for t in self._threads:
            t.start()

    def served(self, n: int = 1) -> None:
        """Wait until ``n`` more requests have been answered."""
        before = len(self.statuses)
        until(lambda: len(self.statuses) >= before + n, f"{n} more requests answered")

    def stop(self) -> list[int]:
        self._stop.set()
        for t in self._threads:
            t.join(60)
        return self.statuses


def route_shares(stack: Stack) -> dict[str, dict[str, Any]]:
    """The sidecar's live route shares, from /debug/queues."""
    url = stack.metrics_url.removesuffix("/metrics") + "/debug/queues"
    with urllib.request.urlopen(url, timeout=5) as r:
        queues: dict[str, dict[str, Any]] = json.loads(r.read())
    return {k: v for k, v in queues.items() if v.get("route_share")}


def completions(stack: Stack) -> tuple[int, float]:
    """A request on another route (no metadata) into the same bucket, timed."""
    req = urllib.request.Request(
        stack.url + "/v1/completions",
        data=json.dumps({"prompt": "hi"}).encode(),
        headers={"content-type": "application/json"},
        method="POST",
    )
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, time.monotonic() - t0


def test_route_metadata_sets_the_routes_share_and_request_limits(stack: Stack) -> None:
    """A route's max_concurrency limits that route's own share of its bucket; the bucket and
    the other routes in it are untouched."""
    apply_routes(
        stack,
        routes_with(
            stack,
            {
                "bucket": "b",
                "max_concurrency": 1,
                "queue_timeout": "400ms",
                "max_output_tokens": 7,
            },
        ),
    )
    status, body = post(stack)
    assert status == 200
    assert json.loads(body["echo"]["body"])["max_tokens"] == 7  # default 20, route cap 7
    assert gauge(stack, "llm_extproc_capacity", "b") == 4  # the file's: the route changes it not
    # A share of one and a 400ms deadline: the route's second request is evicted while its
    # first runs, and a request on another route finds the bucket's free slots at once.
    results: list[tuple[int, float]] = []

    def timed() -> None:
        t0 = time.monotonic()
        results.append((post(stack, {"x-test-delay-ms": "1500"})[0], time.monotonic() - t0))

    holder = threading.Thread(target=timed)
    holder.start()
    wait_gauge(stack, "llm_extproc_in_flight", "b", 1)  # the holder has the route's one
    t0 = time.monotonic()
    status, body = post(stack)
    # Evicted at its deadline, not before, while the holder runs (how soon after: bench.bounds,
    # route_share_eviction); the other route was not queued behind the holder either.
    assert status == 429 and body["error"]["code"] == "queue_timeout"
    assert time.monotonic() - t0 > 0.3
    other_status, _ = completions(stack)
    assert other_status == 200 and holder.is_alive()
    holder.join(10)
    assert results[0][0] == 200

    # Raise the route's concurrency and deadline: the next requests follow at once.
    apply_routes(
        stack,
        routes_with(
            stack,
            {
                "bucket": "b",
                "max_concurrency": 3,
                "queue_timeout": "3s",
            },
        ),
    )
    holder = threading.Thread(target=timed)
    holder.start()
    wait_gauge(stack, "llm_extproc_in_flight", "b", 1)
    status, body = post(stack)
    assert status == 200 and holder.is_alive()  # a free slot: not queued behind the holder
    assert json.loads(body["echo"]["body"])["max_tokens"] == 20  # the file's default again
    assert gauge(stack, "llm_extproc_capacity", "b") == 4
    holder.join(10)
    wait_idle(stack)


def test_twenty_route_reloads_under_load_fail_nothing(stack: Stack) -> None:
    load = Load(stack)
    try:
        for i in range(20):
            apply_routes(
                stack,
                routes_with(
                    stack,
                    {
                        "bucket": "b",
                        "max_concurrency": 2 + i % 3,
                        "queue_timeout": f"{2 + i % 2}s",
                    },
                ),
            )
            load.served()  # traffic between any two reloads
    finally:
        statuses = load.stop()
    assert len(statuses) > 40
    assert set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
    wait_idle(stack)


def test_broken_route_file_is_rejected_and_traffic_continues(stack: Stack) -> None:
    apply_routes(stack, routes_with(stack, {"bucket": "b", "max_concurrency": 2}))
    load = Load(stack)
    try:
        bad = routes_with(stack, {"bucket": "b", "max_concurrency": 5})
        bad["resources"][0]["virtual_hosts"][0]["routes"][0]["route"]["timeout"] = "soon"
        apply_routes(stack, bad, stat="update_failure")
        apply_routes(stack, "resources: [", stat="update_failure")
        load.served(3)
        assert post(stack)[0] == 200
    finally:
        statuses = load.stop()
    assert set(statuses) == {200}
    # The last good routes stayed: the route's share is the one of 2, none of 5 was made.
    capacities = {q["capacity"] for q in route_shares(stack).values()}
    assert 2 in capacities and 5 not in capacities
    wait_idle(stack)


def test_unknown_route_fields_are_accepted_with_a_warning(stack: Stack) -> None:
    """Pinned Envoy 1.40 behaviour: in dynamic (RDS) config an unknown field is ignored with a
    warning, not rejected (unless Envoy runs with --reject-unknown-dynamic-fields)."""
    typo = routes_with(stack, {"bucket": "b", "max_concurrency": 2})
    typo["resources"][0]["virtual_hosts"][0]["routes"][0]["route"]["no_such_field"] = 1
    apply_routes(stack, typo, stat="update_success")
    # (protobuf varies the spacing of its messages on purpose)
    assert re.search(r"no\s+such\s+field:\s+'no_such_field'", stack.procs["envoy"].log_text())
    assert post(stack)[0] == 200


def test_twenty_sidecar_policy_reloads_under_load_fail_nothing(stack: Stack) -> None:
    apply_routes(stack, routes_with(stack, None))  # the policy file alone decides
    path = stack.policy_path
    assert path is not None

    def reloads(result: str) -> float:
        return scrape(stack).get(("llm_extproc_policy_reloads_total", (("result", result),)), 0)

    load = Load(stack)
    try:
        for i in range(20):
            before = reloads("ok")
            tmp = path.with_suffix(".tmp")
            tmp.write_text(POLICY.replace("max_concurrency: 4", f"max_concurrency: {2 + i % 3}"))
            tmp.replace(path)
            stack.procs["sidecar"].popen.send_signal(signal.SIGHUP)
            until(lambda before=before: reloads("ok") > before, "the reload applied")  # type: ignore[misc]
            assert gauge(stack, "llm_extproc_capacity", "b") == 2 + i % 3
            load.served()
        before = reloads("error")
        path.write_text("buckets: [{name: b, max_concurrency: -1}]")
        stack.procs["sidecar"].popen.send_signal(signal.SIGHUP)
        until(lambda: reloads("error") > before, "the broken policy refused")
        assert post(stack)[0] == 200
    finally:
        statuses = load.stop()
        path.write_text(POLICY)
    assert len(statuses) > 40
    assert set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
    wait_idle(stack)
