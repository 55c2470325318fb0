"""Tenants through the real Envoy and the real sidecar: the fair order, a tenant's own
queue bound answered 429 ``tenant_queue_full``, and the Authorization header as the key,
never shown. The pool has one slot, so the order of admission is the order of release."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from testing.clients import chat, post, slow_stream
from testing.harness import (
    holder_and_queue,
    outcomes,
    scrape,
    start_stack,
    until_queued,
    wait_idle,
)
from testing.stack import Stack
from tests.e2e.test_e2e import run
from tests.e2e.test_pool_through_envoy import admitted_at

POLICY = """
pool: {max_concurrency: 1}
buckets:
  - name: shared
    queue_timeout: 10s
    max_queue: 20
    order: fair
    tenant: {authorization: true, max_queue: 3, export_top: 2}
"""
# Each answer takes 150 ms at the backend, so admissions are that far apart.
HEAVY = {"authorization": "Bearer sk-heavy-0123456789", "x-test-delay-ms": "150"}
LIGHT = {"authorization": "Bearer sk-light-0123456789", "x-test-delay-ms": "150"}


@pytest.fixture(scope="module")
def stack(module_tmp: Path) -> Iterator[Stack]:
    yield from start_stack(module_tmp / "tenants", POLICY)


def test_a_light_tenant_goes_ahead_of_a_heavy_tenants_queue(stack: Stack) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            url = f"{stack.url}/v1/chat/completions"
            holder, heavy = await holder_and_queue(
                stack, s, url, bucket="shared", hold=slow_stream(3, 200), queue=3, headers=HEAVY
            )
            over = await post(s, url, chat(), HEAVY)  # a fourth waiting: over its own bound
            light = asyncio.ensure_future(post(s, url, chat(), LIGHT))
            await until_queued(stack, "shared", 4)
            series = await asyncio.to_thread(scrape, stack)
            assert series[("llm_extproc_tenants", (("bucket", "shared"),))] == 2
            backlog = {
                dict(labels)["tenant"]: v
                for (name, labels), v in series.items()
                if name == "llm_extproc_tenant_backlog_tokens"
            }
            # Ahead of the virtual time: the heavy tenant by its three queued and the one
            # running, the light one by its one; the label is the key's hash, never the
            # credential.
            most, least = sorted(backlog.values(), reverse=True)
            assert most == 4 * least > 0
            assert all(t.startswith("h:") and "sk-" not in t for t in backlog)
            replies = [await r for r in (holder, *heavy, light)]
        assert [r.status for r in replies] == [200] * 5
        assert over.status == 429 and int(over.headers["retry-after"]) >= 1
        err = over.json()["error"]
        assert (err["code"], err["type"]) == ("tenant_queue_full", "rate_limit_error")
        # The heavy tenant's queue was first; the light tenant's one request went ahead of it.
        at = [admitted_at(r) for r in replies[1:]]
        assert at[3] < at[0] < at[1] < at[2], at
        assert outcomes(stack)[("shared", "rejected_tenant_queue_full")] == 1

    run(main())
    wait_idle(stack)


def test_the_credential_is_never_logged(stack: Stack) -> None:
    logs = "".join(p.read_text(errors="replace") for p in stack.log_dir.glob("**/*.log"))
    assert logs and "sk-heavy" not in logs and "sk-light" not in logs
