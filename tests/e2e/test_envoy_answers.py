"""Tier 3: the answers Envoy gives itself, and the stable codes envoy.yaml gives them.

A sidecar that has stopped answering (here: its process is stopped with SIGSTOP, so the kernel
still holds its connections and nothing replies) leaves Envoy waiting on the request_headers
message. After ``message_timeout`` (1 s in envoy/envoy.yaml) Envoy gives up and, with
``failure_mode_allow: false``, answers 504 itself, which envoy.yaml's local_reply_config turns
into a JSON error with the code ``sidecar_timeout``.

The rest of local_reply_config's table, with the shipped config's timeouts and circuit breakers
cut down so that each answer comes within seconds: the sidecar's breakers full (500
``sidecar_unavailable``), the backend's route timeout (504 ``backend_timeout``), its breakers
full or no endpoint (503 ``backend_unavailable``), a body or headers too slow (408
``request_timeout``), and anything else (``gateway_error``). Envoy's response code details, the
conditions the mappers test, are pinned by the access log's ``details``. docs/envoy.md lists
them all (500 sidecar down: tests/e2e/test_failure.py; 503 backend down:
tests/e2e/test_faults.py; 413: tests/e2e/test_corpus.py).
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from testing.envoy import cluster_named, hcm_config
from testing.harness import backend_stats, gauge, running_stack, wait_gauge
from testing.stack import Stack
from testing.wait import until

BODY = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()


def post(url: str) -> tuple[int, bytes, float]:
    return post_to(url, BODY, {})


def post_to(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes, float]:
    req = urllib.request.Request(
        url,
        data=body,
        headers={"content-type": "application/json", **headers},
        method="POST",
    )
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read(), time.monotonic() - t0
    except urllib.error.HTTPError as e:
        return e.code, e.read(), time.monotonic() - t0


def test_a_sidecar_that_stops_answering_gets_envoys_504(tmp_path: Path) -> None:
    with running_stack(tmp_path, None) as stack:
        url = f"{stack.url}/v1/chat/completions"
        assert post(url)[0] == 200  # connections to the sidecar are open and work
        sidecar = stack.procs["sidecar"]
        sidecar.kill(signal.SIGSTOP)
        try:
            status, body, seconds = post(url)
        finally:
            sidecar.kill(signal.SIGCONT)
        assert status == 504
        # Envoy's own answer, after its message_timeout (1 s), not before (how soon after:
        # bench.bounds, envoy_timers).
        assert seconds >= 0.9, seconds
        err = json.loads(body)["error"]
        assert err["type"] == "server_error" and err["code"] == "sidecar_timeout"
        # Resumed, the sidecar answers again.
        assert post(url)[0] == 200


def shortened(cfg: dict[str, Any]) -> None:
    """envoy.yaml with its timeouts and circuit breakers cut to what a test can wait for and
    fill, a route to a cluster without endpoints and one to a cluster that does not exist."""
    hcm = hcm_config(cfg)
    hcm["request_timeout"] = "2s"
    hcm["request_headers_timeout"] = "1s"
    hcm["route_config"]["validate_clusters"] = False
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    for route in routes:
        if route["match"].get("path") == "/v1/completions":
            route["route"]["timeout"] = "0.5s"
    catch_all = routes[-1]
    for path, route in (
        ("/v1/nowhere", {"cluster": "nowhere"}),
        ("/v1/empty", {"cluster": "empty"}),
        # The backend's completions handler (which honours x-test-delay-ms) without the
        # sidecar, to fill the backend's circuit breakers.
        ("/v1/direct", {"cluster": "backend", "prefix_rewrite": "/v1/completions"}),
    ):
        routes.insert(
            0,
            {
                "match": {"path": path},
                "route": route,
                "typed_per_filter_config": catch_all["typed_per_filter_config"],
            },
        )
    cfg["static_resources"]["clusters"].append(
        {
            "name": "empty",
            "type": "STATIC",
            "connect_timeout": "1s",
            "load_assignment": {"cluster_name": "empty", "endpoints": []},
        }
    )
    one = {"thresholds": [{"max_connections": 1, "max_requests": 1, "max_pending_requests": 1}]}
    cluster_named(cfg, "backend")["circuit_breakers"] = one
    cluster_named(cfg, "llm_extproc")["circuit_breakers"] = one


def raw(port: int, data: bytes, timeout: float = 10) -> tuple[int, bytes, float]:
    """Send raw bytes, read the answer until Envoy closes: (status, body, seconds)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body, time.monotonic() - t0


def test_envoys_own_answers_carry_stable_codes(tmp_path: Path) -> None:
    """Each of Envoy's own answers gets its fixed code and type, never Envoy's detail string
    (that goes to the access log)."""
    with running_stack(tmp_path, None, envoy_patch=shortened) as stack:
        port = stack.listener_port
        answers: dict[str, tuple[int, dict[str, Any]]] = {}

        def record(name: str, status: int, body: bytes) -> None:
            answers[name] = (status, json.loads(body)["error"])

        # In the background, as they touch neither the sidecar nor the backend: a body that
        # does not arrive within request_timeout (2 s here), headers that do not arrive within
        # request_headers_timeout (1 s here).
        timeouts: dict[str, tuple[int, bytes, float]] = {}
        slow_ones = [
            threading.Thread(
                target=lambda: timeouts.setdefault(
                    "request_timeout",
                    raw(
                        port,
                        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                        b"content-type: application/json\r\ncontent-length: 100\r\n\r\n{",
                    ),
                )
            ),
            threading.Thread(
                target=lambda: timeouts.setdefault(
                    "request_header_timeout",
                    raw(port, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"),
                )
            ),
        ]
        for t in slow_ones:
            t.start()
        # The ext_proc cluster's circuit breakers (1 stream here) are full: one request holds
        # its stream while the backend takes 1 s, the next one is refused.
        held: list[tuple[int, bytes, float]] = []
        holder = threading.Thread(
            target=lambda: held.append(
                post_to(f"{stack.url}/v1/chat/completions", BODY, {"x-test-delay-ms": "1000"})
            )
        )
        holder.start()
        until(lambda: backend_stats(stack)["running"] == 1, "the holder at the backend")
        record("sidecar_overflow", *post(f"{stack.url}/v1/chat/completions")[:2])
        holder.join(10)
        assert held[0][0] == 200
        # The backend does not answer within the route timeout (0.5 s here).
        status, body, seconds = post_to(
            f"{stack.url}/v1/completions",
            json.dumps({"prompt": "hi"}).encode(),
            {"x-test-delay-ms": "2000"},
        )
        assert seconds >= 0.4, seconds  # not before the timeout (how soon after: envoy_timers)
        record("backend_timeout", status, body)
        # The backend's circuit breakers (1 connection, 1 request, 1 pending here) overflow:
        # four requests at once, each held 0.5 s by the backend.
        direct: list[tuple[int, bytes, float]] = []
        threads = [
            threading.Thread(
                target=lambda: direct.append(
                    post_to(
                        f"{stack.url}/v1/direct",
                        json.dumps({"prompt": "hi"}).encode(),
                        {"x-test-delay-ms": "500"},
                    )
                )
            )
            for _ in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(direct) == 4
        overflowed = [a for a in direct if a[0] != 200]
        assert overflowed, [a[0] for a in direct]
        assert len({body for _, body, _ in overflowed}) == 1, overflowed
        record("backend_unavailable", *overflowed[0][:2])
        for t in slow_ones:
            t.join(10)
        for name, limit in (("request_timeout", 2.0), ("request_header_timeout", 1.0)):
            status, body, seconds = timeouts[name]
            assert seconds >= limit - 0.1, (name, seconds)
            record(name, status, body)
        # Anything else: a route to a cluster that does not exist (503 cluster_not_found),
        # a request Envoy's HTTP/1 codec refuses (400).
        record("no_healthy_upstream", *post_to(f"{stack.url}/v1/empty", b"{}", {})[:2])
        record("cluster_not_found", *post_to(f"{stack.url}/v1/nowhere", b"{}", {})[:2])
        record("codec_error", *raw(port, b"POST / HTTP/1.1\r\nhost: x\r\nno colon\r\n\r\n")[:2])

        assert {
            name: (status, err["type"], err["code"]) for name, (status, err) in answers.items()
        } == {
            "sidecar_overflow": (500, "server_error", "sidecar_unavailable"),
            "backend_timeout": (504, "server_error", "backend_timeout"),
            "no_healthy_upstream": (503, "server_error", "backend_unavailable"),
            "backend_unavailable": (503, "server_error", "backend_unavailable"),
            "request_timeout": (408, "invalid_request_error", "request_timeout"),
            "request_header_timeout": (408, "invalid_request_error", "request_timeout"),
            "cluster_not_found": (503, "server_error", "gateway_error"),
            "codec_error": (400, "invalid_request_error", "gateway_error"),
        }
        for _, err in answers.values():
            assert err["message"] and "%" not in err["message"] and err["param"] is None
        # The access log keeps Envoy's own words for each (it flushes every 100 ms here).
        with contextlib.suppress(AssertionError):  # the loop below names what is missing
            until(lambda: set(DETAILS) <= access_log_details(stack), "every detail logged")
        details = access_log_details(stack)
        for detail in DETAILS:
            assert detail in details, (detail, details)


# Envoy's response code details of those answers, as its access log writes them.
DETAILS = (
    "ext_proc_error_gRPC_error_14{upstream_connect_error_or_disconnect/reset_before"
    "_headers._reset_reason:_overflow{upstream_reset_before_response_started{overflow}}}",
    "response_timeout",
    "no_healthy_upstream",
    "upstream_reset_before_response_started{overflow}",
    "request_overall_timeout",
    "request_header_timeout",
    "cluster_not_found",
    "http1.codec_error",
)


def access_log_details(stack: Stack) -> set[str]:
    path = stack.access_log_path
    lines = path.read_text().splitlines() if path.exists() else []
    return {json.loads(line)["details"] for line in lines}


ONE_SLOT = """
buckets:
  - {name: one, max_concurrency: 1, queue_timeout: 10s, max_queue: 5}
"""


def test_request_timeout_ends_when_the_client_has_sent_everything(tmp_path: Path) -> None:
    """Why envoy.yaml's request_timeout need not exceed the longest queue_timeout: Envoy's docs
    say the timer runs until the request has been sent upstream, which would count the wait in
    the sidecar's queue; on Envoy 1.40 it stops once the client's last byte is in. Pinned with
    a 2 s request_timeout and a request that waits 3 s in the queue (the slow body that gets
    408 at 2 s is in test_envoys_own_answers_carry_stable_codes). If this fails, request_timeout
    must become the body budget + the longest queue_timeout + 1 s."""

    def two_seconds(cfg: dict[str, Any]) -> None:
        hcm_config(cfg)["request_timeout"] = "2s"

    with running_stack(tmp_path, ONE_SLOT, envoy_patch=two_seconds) as stack:
        url = f"{stack.url}/v1/chat/completions"
        held: list[tuple[int, bytes, float]] = []
        holder = threading.Thread(
            target=lambda: held.append(post_to(url, BODY, {"x-test-delay-ms": "3500"}))
        )
        holder.start()
        wait_gauge(stack, "llm_extproc_in_flight", "one", 1)  # the holder has the one slot
        status, _, seconds = post(url)  # queued behind it, its body complete at once
        holder.join(10)
        assert held[0][0] == 200
        assert status == 200 and seconds >= 2.5, (status, seconds)  # waited past 2 s, not cut
        assert gauge(stack, "llm_extproc_queue_depth", "one") == 0
