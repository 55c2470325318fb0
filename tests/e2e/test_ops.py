"""Tier 3, operating it: access-log fields, the trusted priority channel, shadow mode and
policy reload, through the real Envoy with the shipped envoy/envoy.yaml."""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testing.harness import (
    gauge,
    outcomes,
    running_stack,
    scrape,
    start_stack,
    wait_gauge,
    wait_idle,
)
from testing.stack import Stack
from testing.wait import until

PRIORITY_KEY = "change-me-priority-key"  # the example key in envoy/envoy.yaml


def post(
    stack: Stack,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    path: str = "/v1/chat/completions",
) -> tuple[int, dict[str, str], dict[str, Any]]:
    req = urllib.request.Request(
        stack.url + path,
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", **(headers or {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, json.loads(e.read())


def chat(content: str = "hi", **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], **fields}


def access_log(stack: Stack, n: int) -> list[dict[str, Any]]:
    """The last n access-log entries, once there are n (Envoy flushes its file log every
    100 ms here)."""

    def lines() -> list[str]:
        path = stack.access_log_path
        return path.read_text().splitlines() if path.exists() else []

    until(lambda: len(lines()) >= n, f"{n} access-log lines")
    return [json.loads(line) for line in lines()[-n:]]


# --- the shipped default policy ---------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(module_tmp: Path) -> Iterator[Stack]:
    yield from start_stack(module_tmp, None)  # the embedded default policy


def test_access_log_carries_the_sidecars_decision(stack: Stack) -> None:
    status, _, _ = post(stack, chat(max_tokens=5000), {"x-llm-class": "interactive"})
    assert status == 200
    status, _, _ = post(stack, chat("x" * 140_000))
    assert status == 413
    ok, too_large = access_log(stack, 2)
    assert ok["status"] == 200
    assert ok["llm_bucket"] == "batch"  # 1024 effective max_tokens > interactive's 128
    assert ok["llm_outcome"] == "admitted"
    assert ok["llm_max_tokens"] == 1024 and ok["llm_prompt_tokens"] == 4
    assert isinstance(ok["llm_queue_ms"], int)
    # Immediate responses carry their metadata too.
    assert too_large["status"] == 413
    assert too_large["llm_outcome"] == "rejected_too_large"
    assert too_large["llm_code"] == "prompt_too_long"
    assert too_large["llm_bucket"] == "none"


def test_priority_channel_cannot_be_spoofed(stack: Stack) -> None:
    # A client claiming the trusted tier header: Envoy strips it before the sidecar sees it.
    status, _, body = post(stack, chat(max_tokens=10), {"x-llm-tier": "priority"})
    assert status == 200
    seen = body["echo"]["headers"]
    assert seen["x-llm-bucket"] == "batch" and "x-llm-tier" not in seen
    # Same with the class hint and the tier header together.
    status, _, body = post(
        stack, chat(max_tokens=10), {"x-llm-tier": "priority", "x-llm-class": "interactive"}
    )
    assert body["echo"]["headers"]["x-llm-bucket"] == "interactive"
    # A wrong key does not open the channel either.
    status, _, body = post(stack, chat(max_tokens=10), {"x-llm-api-key": "guess"})
    assert body["echo"]["headers"]["x-llm-bucket"] == "batch"
    # The priority route (matched by Envoy on the key) selects the bucket by route metadata,
    # and the key is not forwarded to the backend.
    status, _, body = post(stack, chat(max_tokens=10), {"x-llm-api-key": PRIORITY_KEY})
    assert status == 200
    seen = body["echo"]["headers"]
    assert seen["x-llm-bucket"] == "priority" and "x-llm-api-key" not in seen
    assert outcomes(stack)[("priority", "admitted")] >= 1


def test_route_metadata_naming_an_unknown_bucket_falls_back_to_the_file(
    module_tmp: Path,
) -> None:
    """envoy.yaml's priority route names bucket `priority`; a policy without it must not fail
    requests: the override is refused, logged and counted, and the file's policy applies."""
    policy = "buckets: [{name: only, max_concurrency: 2, queue_timeout: 1s, max_queue: 5}]\n"
    with running_stack(module_tmp / "fallback", policy) as stack:
        for _ in range(3):
            status, _, body = post(stack, chat(max_tokens=10), {"x-llm-api-key": PRIORITY_KEY})
            assert status == 200
            assert body["echo"]["headers"]["x-llm-bucket"] == "only"
        assert scrape(stack)[("llm_extproc_route_policy_errors_total", ())] == 3.0
        log = stack.procs["sidecar"].log_text()
        assert log.count("route metadata") == 1  # logged once per route config, not per request
        assert "'priority' is not a bucket of the policy" in log


# --- shadow mode ------------------------------------------------------------------------------

SHADOW = """
mode: shadow
limits: {max_prompt_tokens: 100, default_max_tokens: 10, max_output_tokens: 20}
buckets:
  - {name: tiny, max_concurrency: 1, queue_timeout: 300ms, max_queue: 1}
"""


def test_shadow_mode_counts_but_lets_everything_through(module_tmp: Path) -> None:
    with running_stack(module_tmp / "shadow", SHADOW) as stack:
        # Would be 413 and a clamp: passes unchanged.
        status, headers, body = post(stack, chat("x" * 2000, max_tokens=500))
        assert status == 200
        assert json.loads(body["echo"]["body"])["max_tokens"] == 500
        assert "x-llm-bucket" not in body["echo"]["headers"]
        assert "x-llm-max-tokens" not in headers
        # Malformed: passes to the backend, which answers as it would without us.
        req = urllib.request.Request(
            stack.url + "/v1/chat/completions",
            data=b"{oops",
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.loads(r.read())["echo"]["body"] == "{oops"
        # Four at once into one slot with a queue of one and a 300ms deadline: all served.
        import concurrent.futures as cf

        slow = {"x-test-delay-ms": "800"}
        with cf.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda _: post(stack, chat(max_tokens=5), slow)[0], range(4)))
        assert results == [200, 200, 200, 200]
        wait_idle(stack)
        shadow = {
            dict(labels)["outcome"]: v
            for (name, labels), v in scrape(stack).items()
            if name == "llm_extproc_shadow_outcomes_total"
        }
        assert shadow["rejected_too_large"] == 1 and shadow["rejected_invalid"] == 1
        # 1 admitted, 1 queued then evicted at 300ms, 2 refused for a full queue.
        assert shadow["rejected_queue_full"] == 2 and shadow["evicted_timeout"] == 1
        assert all(o == "admitted" for (_, o) in outcomes(stack))
        assert '"shadow_outcome":"evicted_timeout"' in stack.procs["sidecar"].log_text()


# --- reload -----------------------------------------------------------------------------------

RELOAD = """
buckets:
  - {name: b, max_concurrency: %d, queue_timeout: 2s, max_queue: 10}
"""


def replace_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def test_policy_file_reload_is_atomic_and_refuses_broken_files(module_tmp: Path) -> None:
    with running_stack(module_tmp / "reload", RELOAD % 2) as stack:
        path = stack.policy_path
        assert path is not None
        assert gauge(stack, "llm_extproc_capacity", "b") == 2
        replace_atomically(path, RELOAD % 7)  # picked up by the file watcher
        wait_gauge(stack, "llm_extproc_capacity", "b", 7)
        replace_atomically(path, "buckets: [{name: b, max_concurrency: many}]")
        until(
            lambda: (
                scrape(stack).get(("llm_extproc_policy_reloads_total", (("result", "error"),)), 0)
                == 1
            ),
            "the broken policy refused",
        )
        assert gauge(stack, "llm_extproc_capacity", "b") == 7  # the old policy stays
        assert post(stack, chat())[0] == 200
        assert "policy reload refused" in stack.procs["sidecar"].log_text()
        # SIGHUP reloads too (the file watcher would also see this change; either is fine).
        path.write_text(RELOAD % 3)
        stack.procs["sidecar"].popen.send_signal(signal.SIGHUP)
        wait_gauge(stack, "llm_extproc_capacity", "b", 3)
        assert scrape(stack)[("llm_extproc_policy_reloads_total", (("result", "ok"),))] >= 2
