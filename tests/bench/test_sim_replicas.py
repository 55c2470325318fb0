"""Several simulator replicas behind the real Envoy (``Stack(backends=2)``, plain Envoy): the
backend cluster has one endpoint per replica and requests reach all of them."""

from __future__ import annotations

import asyncio
import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from testing.stack import Stack

SIM = [sys.executable, "-m", "bench.sim", "--port", "{port}", "--speedup", "100"]
REQUESTS = 24


def sim_stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/sim/stats", timeout=5) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


async def send_all(url: str) -> list[int]:
    """REQUESTS concurrent completions through Envoy (each ~0.3 simulated s, 3 ms of wall)."""
    req = {"model": "m", "prompt": "abcd" * 25, "max_tokens": 50}
    timeout = aiohttp.ClientTimeout(total=20)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one() -> int:
            async with session.post(url + "/v1/completions", json=req) as resp:
                await resp.read()
                return resp.status

        return await asyncio.gather(*(one() for _ in range(REQUESTS)))


def test_requests_reach_every_replica(tmp_path: Path) -> None:
    with Stack(
        backend_argv=SIM, backends=2, start_sidecar=False, ext_proc=False, log_dir=tmp_path
    ) as stack:
        assert list(stack.procs) == ["backend", "backend-1", "envoy"]
        assert len(set(stack.backend_urls)) == 2 and stack.backend_urls[0] == stack.backend_url
        assert (tmp_path / "backend.log").exists() and (tmp_path / "backend-1.log").exists()
        (backend,) = [
            c
            for c in yaml.safe_load((tmp_path / "envoy.yaml").read_text())["static_resources"][
                "clusters"
            ]
            if c["name"] == "backend"
        ]
        assert backend["lb_policy"] == "LEAST_REQUEST"
        assert stack.envoy_stat("cluster.backend.membership_healthy") == 2

        statuses = asyncio.run(send_all(stack.url))
        assert statuses == [200] * REQUESTS
        finished = [sim_stats(url)["finished_requests"] for url in stack.backend_urls]
        assert sum(finished) == REQUESTS and min(finished) > 0, finished
