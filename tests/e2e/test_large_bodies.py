"""Tier 3: large bodies of the worst shape cannot stall everyone else, and queued bodies are
bounded in bytes.

A 3.8 MB body of tiny ``tools`` objects costs about half a second of CPU to parse. On the event
loop, a burst of ten of them stalled every other request for seconds (Envoy answered 504).
Such bodies are now parsed in a worker process (``extproc/request/offload.py``), at most eight
at a time (then 429 ``busy``), so honest requests keep their latency (their p99 during the
burst: ``python -m bench.bounds --only bodies``, ``worst_bodies_bystanders_p99``).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from testing.harness import gauge, outcomes, running_stack, wait_gauge, wait_idle
from testing.stack import Stack
from testing.wait import until

POLICY = """
buckets:
  - {name: b, max_concurrency: 64, queue_timeout: 5s, max_queue: 100}
"""
# About 3.8 MB: under Envoy's 4 MiB buffer limit for the default token limits.
WORST = json.dumps(
    {"messages": [{"role": "user", "content": "hi"}], "tools": [{"a": 1}] * 480_000},
    separators=(",", ":"),
).encode()
HONEST = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
# Large enough for the worker process, and within every limit.
LARGE = json.dumps({"messages": [{"role": "user", "content": "x" * 100_000}]}).encode()


def post(stack: Stack, body: bytes, timeout: float = 30) -> tuple[int, bytes, float]:
    req = urllib.request.Request(
        stack.url + "/v1/chat/completions",
        data=body,
        headers={"content-type": "application/json"},
        method="POST",
    )
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read(), time.monotonic() - t0
    except urllib.error.HTTPError as e:
        return e.code, e.read(), time.monotonic() - t0


def test_a_burst_of_worst_shape_bodies_leaves_honest_requests_fast(tmp_path: Path) -> None:
    with running_stack(tmp_path, POLICY) as stack:
        for _ in range(20):
            post(stack, HONEST)  # warm: connections open, the interpreter warm
        assert post(stack, LARGE)[0] == 200  # and the body worker started (a process)
        big: list[tuple[int, bytes, float]] = []
        senders = [
            threading.Thread(target=lambda: big.append(post(stack, WORST))) for _ in range(10)
        ]
        for t in senders:
            t.start()
        honest: list[tuple[int, float]] = []
        deadline = time.monotonic() + 30  # bounded, whatever happens
        while any(t.is_alive() for t in senders) and time.monotonic() < deadline:
            status, _, seconds = post(stack, HONEST)
            honest.append((status, seconds))
            time.sleep(0.01)  # the subject: honest requests one after another, all along
        for t in senders:
            t.join(30)

        # Every large body was answered by the sidecar, none by Envoy's 504: 413 once parsed
        # (the estimate is ~960k tokens, over the limit), or 429 busy.
        codes = sorted(json.loads(body)["error"]["code"] for _, body, _ in big)
        assert len(codes) == 10 and set(codes) <= {"prompt_too_long", "busy"}, sorted(
            (json.loads(b)["error"]["code"], round(t, 2)) for _, b, t in big
        )
        # At least one was parsed in the worker; the others were refused at once (eight
        # pending) or when the worker could not reach them within their deadline.
        assert "prompt_too_long" in codes
        assert len(honest) >= 20 and {s for s, _ in honest} == {200}
        wait_idle(stack)
        counted = outcomes(stack)
        assert counted[("none", "rejected_too_large")] == codes.count("prompt_too_long")
        assert counted.get(("none", "rejected_busy"), 0) == codes.count("busy")


QUEUED_BYTES_POLICY = """
limits: {max_queued_bytes: 300000}
buckets:
  - {name: b, max_concurrency: 1, queue_timeout: 5s, max_queue: 100}
"""


def test_bytes_held_by_queued_requests_are_bounded(tmp_path: Path) -> None:
    body = LARGE
    with running_stack(tmp_path, QUEUED_BYTES_POLICY) as stack:
        # Bodies this large are parsed in the worker process: start it before the clock runs.
        assert post(stack, body)[0] == 200
        # One request holds the slot for 1.5 s (the test backend sleeps on x-test-delay-ms).
        req = urllib.request.Request(
            stack.url + "/v1/chat/completions",
            data=HONEST,
            headers={"content-type": "application/json", "x-test-delay-ms": "1500"},
            method="POST",
        )
        slow = threading.Thread(target=lambda: urllib.request.urlopen(req, timeout=30).read())
        slow.start()
        wait_gauge(stack, "llm_extproc_in_flight", "b", 1)
        results: list[tuple[int, bytes, float]] = []
        waiters = [
            threading.Thread(target=lambda: results.append(post(stack, body))) for _ in range(4)
        ]
        for i, t in enumerate(waiters, 1):  # one after another: queued or refused, then the next
            t.start()
            until(
                lambda i=i: gauge(stack, "llm_extproc_queue_depth", "b") + len(results) == i,  # type: ignore[misc]
                f"waiter {i} queued or answered",
            )
        # 300 kB hold two 100 kB bodies in the queue; the third and fourth are refused at once,
        # while the slot is still held (how fast: bench.bounds, queued_bytes_refusal).
        assert slow.is_alive() and sorted(s for s, _, _ in results) == [429, 429], results
        for t in waiters:
            t.join(30)
        slow.join(30)
        statuses = sorted(s for s, _, _ in results)
        assert statuses == [200, 200, 429, 429], statuses
        refused = [json.loads(b)["error"]["code"] for s, b, _ in results if s == 429]
        assert refused == ["queue_full", "queue_full"]
        wait_idle(stack)
