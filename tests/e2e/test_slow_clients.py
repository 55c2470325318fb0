"""Tier 3: clients that send their bodies slowly hold nothing of the sidecar's.

Every request the sidecar holds is one ext_proc stream, and Envoy's circuit breakers on the
``llm_extproc`` cluster cap those streams (``extproc_streams(policy)``, 6,646 by default).
Before the buffer filter, Envoy opened the stream and sent request_headers as soon as the
headers were in, then waited for the body: 6,646 clients sending their bodies at 1 byte/s
filled the breakers, and every other LLM request got 500. envoy/envoy.yaml now puts Envoy's
buffer filter before ext_proc, so ext_proc's stream opens only once the whole body is in.

Pinned here with the real Envoy, the sidecar and the test backend, with the breakers scaled
down to 100 so that 300 slow clients would fill them three times over:
- while the slow clients are mid-body, ext_proc has opened no stream (Envoy's
  ``http.llm.ext_proc.streams_started``, and the sidecar counts nothing);
- meanwhile every honest request succeeds (its p99 latency: ``python -m bench.bounds``,
  ``slow_uploads_bystanders``, against ``HONEST_P99_S``);
- afterwards nothing is held: no bucket has anything in flight or queued, and Envoy's
  ``cluster.llm_extproc.upstream_rq_active`` is back to 0.
Run against the config as it was before the buffer filter, the honest requests get 500
(``sidecar_unavailable``: the breakers are full).

The timeouts that bound how long a slow client may hold Envoy's buffer (request_headers_timeout,
request_timeout) are pinned with shortened values in tests/e2e/test_envoy_answers.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testing.clients import HonestAnswer, SlowClient, honest_load
from testing.envoy import SHIPPED_ENVOY, cluster_named
from testing.harness import outcomes, running_stack, wait_idle
from testing.stack import Stack
from testing.wait import until

POLICY = """
buckets:
  - {name: all, max_concurrency: 16, queue_timeout: 5s, max_queue: 50}
"""
BREAKER = 100  # the llm_extproc cluster's circuit breakers, scaled down from 1,090 for POLICY
SLOW_CLIENTS = 300
SLOW_BODY_BYTES = 1000  # announced in content-length; at 1 byte/s, never complete here
TRICKLE_S = 8.0  # how long the honest load runs while the slow clients trickle
HONEST_WORKERS = 8
HONEST_PACE_S = 0.05  # between one worker's requests: about 130 req/s in all, not a saturation
HONEST_P99_S = 1.0  # bench.bounds' target: an admitted request costs milliseconds
# The config under test. (The check against the config from before the buffer filter ran this
# module with SHIPPED_ENVOY replaced by that file.)
ENVOY_SOURCE = SHIPPED_ENVOY
HONEST = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()


def scale_down_breakers(cfg: dict[str, Any]) -> None:
    cluster_named(cfg, "llm_extproc")["circuit_breakers"] = {
        "thresholds": [
            {"max_connections": 1024, "max_pending_requests": BREAKER, "max_requests": BREAKER}
        ]
    }


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    with running_stack(
        tmp_path, POLICY, envoy_patch=scale_down_breakers, envoy_source=ENVOY_SOURCE
    ) as s:
        yield s


def test_slow_bodies_hold_no_ext_proc_stream_and_block_nobody(stack: Stack) -> None:
    url = f"{stack.url}/v1/chat/completions"
    slow = [SlowClient(SLOW_BODY_BYTES) for _ in range(SLOW_CLIENTS)]
    seen: dict[str, int] = {}

    async def main() -> list[HonestAnswer]:
        stop_slow, stop_honest = asyncio.Event(), asyncio.Event()
        slow_tasks = [asyncio.ensure_future(c.run(stack.listener_port, stop_slow)) for c in slow]
        # Every slow client connected and a few bytes into its body.
        await asyncio.wait_for(asyncio.gather(*(c.trickling.wait() for c in slow)), 15)
        seen["streams_mid_body"] = stack.envoy_stat("http.llm.ext_proc.streams_started")
        seen["active_mid_body"] = stack.envoy_stat("cluster.llm_extproc.upstream_rq_active")
        honest = asyncio.ensure_future(
            honest_load(url, HONEST, stop_honest, workers=HONEST_WORKERS, pace_s=HONEST_PACE_S)
        )
        await asyncio.sleep(TRICKLE_S)  # the subject: honest load while the slow ones trickle
        stop_honest.set()
        results = await honest
        seen["min_sent"] = min(c.sent for c in slow)
        stop_slow.set()
        await asyncio.gather(*slow_tasks)
        return results

    results = asyncio.run(asyncio.wait_for(main(), 60))
    failed = [r for r in results if r.status != 200]
    assert not failed, f"{len(failed)}/{len(results)} honest requests failed: {failed[:5]}"
    assert len(results) >= 100, len(results)
    # The buffer filter held every slow request before ext_proc: while they were mid-body,
    # Envoy had opened no ext_proc stream for them (the honest load had not started yet).
    assert seen["streams_mid_body"] == 0 and seen["active_mid_body"] == 0, seen
    assert seen["min_sent"] >= TRICKLE_S - 1, seen  # they really were trickling throughout
    assert all(not c.answer for c in slow), "a slow client was answered before its body ended"
    # Afterwards: nothing in flight or queued, no stream open, and the slow clients that left
    # were never seen by the sidecar (no cancelled_before_body), only the honest requests.
    wait_idle(stack)
    active = "cluster.llm_extproc.upstream_rq_active"
    until(lambda: stack.envoy_stat(active) == 0, f"Envoy's {active} back to 0")
    assert stack.envoy_stat("http.llm.ext_proc.streams_started") == len(results)
    with contextlib.suppress(AssertionError):  # the assert below shows the difference
        until(lambda: outcomes(stack) == {("all", "admitted"): len(results)}, "all counted")
    assert outcomes(stack) == {("all", "admitted"): len(results)}


def test_a_slow_body_that_completes_is_admitted_then(stack: Stack) -> None:
    """The buffer filter only delays ext_proc: once the last byte is in, the request opens its
    stream, is admitted and reaches the backend whole."""
    import socket

    body = json.dumps({"messages": [{"role": "user", "content": "slow"}], "max_tokens": 3})
    with socket.create_connection(("127.0.0.1", stack.listener_port), timeout=10) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
        )
        for i, byte in enumerate(body.encode()):
            s.sendall(bytes([byte]))
            if i < 10:
                time.sleep(0.1)  # the subject: a body that arrives slowly
                assert stack.envoy_stat("http.llm.ext_proc.streams_started") == 0
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200"), data[:300]
    echo = json.loads(data.partition(b"\r\n\r\n")[2])["echo"]
    assert json.loads(echo["body"]) == json.loads(body)
    assert stack.envoy_stat("http.llm.ext_proc.streams_started") == 1
