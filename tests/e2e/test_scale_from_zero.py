"""Tier 3: what the gateway answers while the backend is scaled to zero (docs/autoscaling.md).

A vLLM Deployment at zero replicas leaves Envoy's backend cluster without an endpoint: Istio's
gateway gets an empty EDS assignment for the Service, and the sidecar's `backend.metrics` name
lists no pod to scrape. Here Envoy's `backend` cluster reads its endpoints from a watched file
(file-based EDS, as Istio's would come over xDS), first empty, then with the backend in it:
the replica that became ready. The adaptive pool's metrics URL has nobody listening.

What the first test pins, by default: the sidecar does not know that there is no backend (a failed
scrape is no data, and the limit never drops to 0: extproc/pool/control/adaptive.py), so it admits
every request at once, and Envoy answers each with 503 `backend_unavailable`
(`no_healthy_upstream`), with no Retry-After; nothing is ever queued, so a queue-based
activation cannot see the demand, while `llm_extproc_requests_total` does. Once the endpoint
is there, requests are served. The second test turns on `pool.adaptive.queue_while_no_backend`:
then the requests queue to their deadline and get 429 with Retry-After, never a 5xx.
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from testing.clients import chat, post
from testing.envoy import cluster_named
from testing.harness import debug_queues, outcomes, running_stack, scrape
from testing.stack import Stack, free_port
from testing.wait import until, until_async

ASSIGNMENT = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


def write_endpoints(directory: Path, ports: list[int]) -> None:
    """The backend cluster's endpoints, replaced atomically in the watched directory."""
    assignment = {
        "@type": ASSIGNMENT,
        "cluster_name": "backend",
        "endpoints": [
            {
                "lb_endpoints": [
                    {
                        "endpoint": {
                            "address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}
                        }
                    }
                    for p in ports
                ]
            }
        ]
        if ports
        else [],
    }
    tmp = directory / ".eds.tmp"
    tmp.write_text(json.dumps({"resources": [assignment]}))
    tmp.replace(directory / "eds.json")


def file_eds(directory: Path) -> Any:
    """An envoy_patch: the backend cluster's endpoints from ``directory``/eds.json."""

    def patch(cfg: dict[str, Any]) -> None:
        cfg["node"] = {"id": "gateway", "cluster": "llm"}  # xDS from a file needs both
        backend = cluster_named(cfg, "backend")
        del backend["load_assignment"]
        backend["type"] = "EDS"
        backend["eds_cluster_config"] = {
            "eds_config": {
                "resource_api_version": "V3",
                "path_config_source": {
                    "path": str(directory / "eds.json"),
                    "watched_directory": {"path": str(directory)},
                },
            }
        }

    return patch


def pool_series(stack: Stack) -> dict[str, float]:
    return {
        name: v
        for (name, labels), v in scrape(stack).items()
        if name in ("llm_extproc_pool_queued", "llm_extproc_pool_in_flight") and not labels
    }


def test_no_backend_endpoint_answers_503_at_once_and_queues_nothing(tmp_path: Path) -> None:
    eds = tmp_path / "eds"
    eds.mkdir()
    write_endpoints(eds, [])  # zero replicas
    policy = f"""
pool:
  max_concurrency: 4
  adaptive: {{min: 1, max: 16, initial: 4, interval: 100ms, window: 1s, stale_after: 500ms,
             fallback_after: 1s}}
backend: {{metrics: ["http://127.0.0.1:{free_port()}/metrics"]}}
buckets:
  - {{name: all, queue_timeout: 3s, max_queue: 50}}
"""
    with running_stack(tmp_path / "stack", policy, envoy_patch=file_eds(eds)) as stack:
        url = f"{stack.url}/v1/chat/completions"
        assert stack.envoy_stat("cluster.backend.membership_total") == 0

        async def burst(n: int) -> list[Any]:
            async with aiohttp.ClientSession() as s:
                return list(await asyncio.gather(*(post(s, url, chat()) for _ in range(n))))

        cold = asyncio.run(burst(8))
        # Every one is Envoy's 503, at once: none waited for a backend, none got a 429.
        assert [r.status for r in cold] == [503] * 8, [(r.status, r.body) for r in cold]
        for r in cold:
            err = r.json()["error"]
            assert (err["type"], err["code"]) == ("server_error", "backend_unavailable")
            assert "retry-after" not in {k.lower() for k in r.headers}
            assert r.elapsed < 2.5, r.elapsed  # well before the bucket's 3 s deadline
        # The sidecar admitted them all (it cannot tell that no backend exists): the demand
        # shows in the requests counter, never in the queue.
        assert outcomes(stack) == {("all", "admitted"): 8}
        assert pool_series(stack) == {
            "llm_extproc_pool_queued": 0,
            "llm_extproc_pool_in_flight": 0,
        }
        adaptive = debug_queues(stack)["/pool"]["adaptive"]
        assert adaptive["signals"]["endpoints_ok"] == 0
        assert debug_queues(stack)["/pool"]["limit"] >= 1  # never 0: nothing is held back

        # A replica becomes ready: its endpoint is published, and requests are served.
        write_endpoints(eds, [stack.backend_port])
        until(
            lambda: stack.envoy_stat("cluster.backend.membership_healthy") == 1,
            "the backend's endpoint in Envoy's cluster",
        )
        warm = asyncio.run(burst(4))
        assert [r.status for r in warm] == [200] * 4
        assert outcomes(stack) == {("all", "admitted"): 12}


def test_with_queue_while_no_backend_requests_wait_and_get_429_never_5xx(tmp_path: Path) -> None:
    """The opt-in: `backend.metrics` names a host with no address (``.invalid`` never has
    one, RFC 6761; a headless Service with no ready pod answers NXDOMAIN the same way), so the
    limit is 0: each request waits to its deadline and gets 429 with Retry-After, and the queue
    shows the demand. (The way back, a backend's page read and the limit at ``initial``, is
    pinned with a fake resolver: tests/unit/test_adaptive.py, test_backend_scrape.py.)"""
    host = "vllm-headless.llm.invalid"
    with pytest.raises(socket.gaierror) as info:
        socket.getaddrinfo(host, 8000)
    assert info.value.errno == socket.EAI_NONAME, f"this machine's DNS: {info.value}"
    eds = tmp_path / "eds"
    eds.mkdir()
    write_endpoints(eds, [])
    policy = f"""
pool:
  max_concurrency: 4
  adaptive: {{min: 1, max: 16, initial: 4, interval: 100ms, window: 1s, stale_after: 500ms,
             fallback_after: 1s, queue_while_no_backend: true}}
backend: {{metrics: ["http://{host}:8000/metrics"]}}
buckets:
  - {{name: all, queue_timeout: 1s, max_queue: 50}}
"""
    with running_stack(tmp_path / "stack", policy, envoy_patch=file_eds(eds)) as stack:
        url = f"{stack.url}/v1/chat/completions"
        until(
            lambda: debug_queues(stack)["/pool"]["adaptive"]["state"] == "no_backend",
            "the limit at 0: no backend",
        )
        assert debug_queues(stack)["/pool"]["limit"] == 0

        async def burst(n: int) -> list[Any]:
            async with aiohttp.ClientSession() as s:
                sent = [asyncio.ensure_future(post(s, url, chat())) for _ in range(n)]
                await until_async(
                    lambda: pool_series(stack)["llm_extproc_pool_queued"] == n, "all queued"
                )
                return list(await asyncio.gather(*sent))

        cold = asyncio.run(burst(6))
        assert [r.status for r in cold] == [429] * 6, [(r.status, r.body) for r in cold]
        for r in cold:
            assert r.json()["error"]["code"] == "queue_timeout"
            assert int(r.headers["retry-after"]) >= 1
        assert outcomes(stack) == {("all", "evicted_timeout"): 6}
        assert stack.envoy_stat("cluster.backend.upstream_rq_total") == 0
