"""Several backends behind one Envoy, each with its own sidecar and policy (issue 31;
docs/deploy.md, "Several models"): `render-envoy --sidecar-cluster NAME --backend-cluster
NAME` renders a backend's routes with an ext_proc override that sends their calls to that
backend's own sidecar. Through the real Envoy: the shipped config's sidecar admits requests
for the default host, a second sidecar (a policy of its own) those for a second host, and each
counts only its own."""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from extproc.app import default_policy
from extproc.config.envoy import render
from extproc.config.policy import policy_from_yaml
from testing.envoy import hcm_config
from testing.harness import outcomes, start_stack
from testing.stack import Proc, Stack, free_port, wait_http, wait_tcp
from testing.wait import until

BIG = "big.example"
BIG_POLICY = """
limits: {max_output_tokens: 77}
buckets:
  - name: big-model
    max_concurrency: 2
    queue_timeout: 5s
"""


@pytest.fixture(scope="module")
def big_sidecar(module_tmp: Path) -> Iterator[tuple[int, int]]:
    """A second sidecar with a policy of its own: (gRPC port, metrics port)."""
    tmp = module_tmp / "big"
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "policy.yaml").write_text(BIG_POLICY)
    grpc, metrics = free_port(), free_port()
    argv = [sys.executable, "-m", "extproc", "serve", f"--listen=127.0.0.1:{grpc}"]
    argv += [f"--metrics=127.0.0.1:{metrics}", f"--policy={tmp / 'policy.yaml'}"]
    proc = Proc("big-sidecar", argv, tmp)
    try:
        wait_tcp(grpc, proc=proc)
        wait_http(f"http://127.0.0.1:{metrics}/metrics", proc=proc)
        yield grpc, metrics
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def stack(module_tmp: Path, big_sidecar: tuple[int, int]) -> Iterator[Stack]:
    grpc, _ = big_sidecar
    # The big backend is the same test backend here (its cluster a copy of `backend`); what
    # differs is the sidecar each host's routes call, and its policy.
    rendered = render(
        policy_from_yaml(BIG_POLICY),
        extproc_port=grpc,
        sidecar_cluster="llm_extproc_big",
        backend_cluster="backend_big",
    )

    def two_backends(cfg: dict[str, Any]) -> None:
        (vhost,) = hcm_config(cfg)["route_config"]["virtual_hosts"]
        big = {**rendered["virtual_host"], "name": "big", "domains": [BIG, f"{BIG}:*"]}
        big["routes"] = rendered["routes"]
        hcm_config(cfg)["route_config"]["virtual_hosts"] = [big, vhost]
        clusters = cfg["static_resources"]["clusters"]
        (backend,) = [c for c in clusters if c["name"] == "backend"]
        clusters.append({**json.loads(json.dumps(backend)), "name": "backend_big"})
        clusters[-1]["load_assignment"]["cluster_name"] = "backend_big"
        clusters.append(rendered["clusters"][0])

    yield from start_stack(module_tmp / "two", None, envoy_patch=two_backends)


def post(stack: Stack, host: str) -> tuple[dict[str, str], dict[str, Any]]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}
    req = urllib.request.Request(
        f"{stack.url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "host": host},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return dict(r.headers), json.loads(r.read())["echo"]


def big_admitted(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("llm_extproc_requests_total{") and 'outcome="admitted"' in line
    )


def test_each_hosts_routes_call_their_own_sidecar(
    stack: Stack, big_sidecar: tuple[int, int]
) -> None:
    _, big_metrics = big_sidecar
    default_cap = default_policy().limits.max_output_tokens
    headers, echo = post(stack, "llm.example")  # the shipped virtual host: its sidecar
    assert json.loads(echo["body"])["max_tokens"] == default_cap == int(headers["x-llm-max-tokens"])
    assert echo["headers"]["x-llm-bucket"] != "big-model"
    headers, echo = post(stack, BIG)  # the big host: the big sidecar and its policy
    assert json.loads(echo["body"])["max_tokens"] == 77 == int(headers["x-llm-max-tokens"])
    assert echo["headers"]["x-llm-bucket"] == "big-model"
    until(lambda: big_admitted(big_metrics) == 1, "the big sidecar counted its one request")
    until(
        lambda: sum(v for (_, o), v in outcomes(stack).items() if o == "admitted") == 1,
        "the shipped sidecar counted its one request",
    )
