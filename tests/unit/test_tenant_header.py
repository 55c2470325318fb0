"""A tenant header that vanishes is noticed (``extproc.pool.core.tenants.watch_header``): a bucket
whose tenant is a trusted header's value and that sees only requests without it, under load,
is found missing; a keyed request clears it. The decision pure, with plain numbers; then
through a real Gate and PoolControl on a virtual clock (``testing.clock``), with the tick loop
that runs in the sidecar: the gauge ``llm_extproc_tenant_header_missing{bucket}`` and one log
line each way."""

from __future__ import annotations

import asyncio
import logging

import pytest

from extproc.config.policy import policy_from_yaml
from extproc.ops.metrics import Metrics
from extproc.pool.control.wiring import PoolControl
from extproc.pool.core.tenants import (
    HEADER_MIN_REQUESTS,
    HEADER_WINDOW_S,
    HeaderWatch,
    TenantCounts,
    TenantSeen,
    watch_header,
)
from extproc.pool.core.tenants import TenantBounds as Bounds
from extproc.pool.core.values import Entry
from extproc.pool.gate import Gate, Slot
from testing.clock import run_virtual

W, N = HEADER_WINDOW_S, HEADER_MIN_REQUESTS


def seen(joined: int, keyed: int = 0) -> TenantSeen:
    return TenantSeen(joined=joined, keyed=keyed)


def opened(since: float, joined: int, keyed: int = 0, missing: bool = False) -> HeaderWatch:
    return HeaderWatch(since=since, seen=seen(joined, keyed), missing=missing)


# (the watch before, the totals now, now, the watch after): one row per rule.
RULES = [
    # 1. The first look, or totals that went down (counts begun again): a window, not missing.
    (None, seen(500), 7.0, opened(7.0, 500)),
    (opened(0.0, 100, 3, missing=True), seen(40, 3), 90.0, opened(90.0, 40, 3)),
    (opened(0.0, 100, 3), seen(140, 0), 90.0, opened(90.0, 140, 0)),
    # 2. A keyed request since the window opened: there, a new window (missing or not before).
    (opened(0.0, 100, 3), seen(101, 4), 1.0, opened(1.0, 101, 4)),
    (opened(0.0, 100, 3, missing=True), seen(500, 4), 30.0, opened(30.0, 500, 4)),
    # 3. The window not over yet: nothing changes, however many anonymous requests came.
    (opened(0.0, 0), seen(10_000), W - 0.001, opened(0.0, 0)),
    (opened(0.0, 0, missing=True), seen(10_000), 1.0, opened(0.0, 0, missing=True)),
    # 4. The window over, no keyed request: missing at N anonymous requests, not at N - 1.
    (opened(0.0, 100, 3), seen(100 + N, 3), W, opened(W, 100 + N, 3, missing=True)),
    (opened(0.0, 100, 3), seen(100 + N - 1, 3), W, opened(W, 100 + N - 1, 3)),
    # ... and once missing, a quiet window does not clear it: only a keyed request does.
    (opened(0.0, 100, missing=True), seen(100), W + 5, opened(W + 5, 100, missing=True)),
]


@pytest.mark.parametrize(("before", "totals", "now", "after"), RULES)
def test_watch_header_rules(
    before: HeaderWatch | None, totals: TenantSeen, now: float, after: HeaderWatch
) -> None:
    assert watch_header(before, totals, now) == after


def test_a_load_that_begins_late_in_a_window_is_found_at_the_end_of_the_next() -> None:
    """One look a second, as the controller's tick. A load of one anonymous request a second
    that begins ``N / 2`` seconds before the first window ends is too little there and found
    at the end of the next: one to two windows after it begins."""
    watch: HeaderWatch | None = None
    joined = 0
    found_at = None
    for t in range(3 * int(W)):
        if t > W - N // 2:
            joined += 1
        watch = watch_header(watch, seen(joined), float(t))
        if watch.missing and found_at is None:
            found_at = t
    assert found_at == 2 * W


def test_the_counts_total_every_request_that_joins_and_those_with_a_key() -> None:
    """O(1) as each request joins; the totals stay when the requests leave, and a tenant
    refused by its bounds (it never joined) is not counted."""
    counts = TenantCounts(Bounds(max_queue=2))
    for tenant in ("a", None, None, "b"):
        counts.joined(tenant)
    counts.admitted("a")
    counts.released("a")
    counts.left(None)
    assert counts.seen() == seen(4, 2)
    assert counts.refusal("b", 10) is None and counts.refusal(None, 10) is None
    counts.joined(None)
    assert counts.refusal(None, 10) is not None  # the anonymous tenant's two: refused
    assert counts.seen() == seen(5, 2)


POLICY = """
trusted_headers: [x-tenant-id]
pool: {max_concurrency: 4}
buckets:
  - {name: chat, match: {headers: {x-llm-class: chat}}, queue_timeout: 2s, max_queue: 100%s}
  - {name: batch, priority: 10, queue_timeout: 2s, max_queue: 100}
"""
KEYED = POLICY % ", order: fair, tenant: {header: x-tenant-id}"


def missing(metrics: Metrics) -> dict[str, float]:
    """The gauge's series: bucket -> value."""
    text = metrics.render().decode()
    prefix = 'llm_extproc_tenant_header_missing{bucket="'
    return {
        line[len(prefix) :].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix)
    }


def test_only_anonymous_requests_raise_the_gauge_and_a_keyed_one_clears_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One anonymous request a second into a bucket keyed by ``x-tenant-id``, the controller's
    own tick loop looking once a second: found missing at the end of the first full window,
    one WARNING; cleared by the tick after one keyed request, one INFO; missing again a window
    later, one WARNING more however long it lasts. A reload that drops the bucket's tenant
    drops its series; a bucket without a tenant header never has one."""
    policy = policy_from_yaml(KEYED)
    seen_at: list[tuple[float, dict[str, float]]] = []

    async def main() -> None:
        gate = Gate(policy)

        def request(tenant: str | None) -> None:
            slot = gate.enter(Entry(bucket="chat", timeout_s=2.0, tenant=tenant))
            assert isinstance(slot, Slot)
            slot.release()

        metrics = Metrics(gate.statistics)
        control = PoolControl(gate, metrics)
        control.apply(policy)
        assert missing(metrics) == {"chat": 0.0}  # exported at 0 from the start; batch: none
        control.start()
        loop = asyncio.get_running_loop()
        await asyncio.sleep(0.5)
        for t in range(1, 200):  # requests at t - 0.5, the ticks at t
            request(None)
            if t == 62:
                await asyncio.sleep(0.25)
                request("acme")  # at 61.75: the tick at 62 sees it
                await asyncio.sleep(0.75)
            else:
                await asyncio.sleep(1.0)
            seen_at.append((round(loop.time() - 0.5), missing(metrics)))
        debug = control.debug()
        assert debug is not None
        assert debug["tenant_headers"] == {"chat": {"header": "x-tenant-id", "missing": True}}
        bounded = policy_from_yaml(POLICY % ", tenant: {header: x-tenant-id, max_queue: 5}")
        gate.reconfigure(bounded)
        control.apply(bounded)  # the same header: the watch and its series stay
        assert missing(metrics) == {"chat": 1.0}
        other = policy_from_yaml(POLICY % "")
        gate.reconfigure(other)
        control.apply(other)  # no tenant any more: no series
        assert missing(metrics) == {}
        assert "tenant_headers" not in (control.debug() or {})
        await control.stop()

    with caplog.at_level(logging.INFO, logger="extproc.control"):
        run_virtual(main())
    # The first look at 1 opens the window; it is over at 61 with 61 anonymous requests.
    values = {t: m["chat"] for t, m in seen_at}
    assert values[60] == 0.0 and values[61] == 1.0
    assert values[62] == 0.0  # the keyed request at 61.75
    # The window that opened at 62 is over at 122.
    assert values[121] == 0.0 and values[122] == 1.0 and values[199] == 1.0
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "extproc.control"]
    assert [level for level, _ in lines] == [logging.WARNING, logging.INFO, logging.WARNING]
    assert lines[0][1] == (
        "bucket chat: its 60 requests of the last 60 s all came without the tenant header "
        "x-tenant-id, so they are one anonymous tenant and fairness between tenants is off; "
        "the filter that sets it runs before the strip of trusted_headers, or it is not set"
    )
    assert lines[1][1] == "bucket chat: requests carry the tenant header x-tenant-id again"
