"""Tier 3: what clients see when the sidecar is not there, for both failure modes.

Pinned here on Envoy 1.40: with ``failure_mode_allow: false`` (our default) an LLM
request gets 500 (an empty body, which envoy.yaml's local_reply_config turns into JSON with the
code ``sidecar_unavailable``); with
``true`` it reaches the backend unfiltered, bypassing admission and length limits. Routes with
ext_proc disabled are unaffected either way.
"""

from __future__ import annotations

import json
import signal
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from testing.harness import running_stack, start_stack, wait_gauge
from testing.stack import Stack

BODY = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 99999}).encode()


def post(url: str) -> tuple[int, bytes]:
    req = urllib.request.Request(
        url, data=BODY, headers={"content-type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(params=[False, True], ids=["fail-closed", "fail-open"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stack]:
    yield from start_stack(tmp_path, None, start_sidecar=False, failure_mode_allow=request.param)


def test_sidecar_down(stack: Stack) -> None:
    status, body = post(f"{stack.url}/v1/chat/completions")
    if stack.failure_mode_allow:
        assert status == 200
        # Unfiltered: max_tokens was not clamped.
        assert json.loads(json.loads(body)["echo"]["body"])["max_tokens"] == 99999
    else:
        # Envoy's own 500 (the sidecar is unreachable), given a JSON body with a stable code
        # by envoy.yaml's local_reply_config; Envoy's detail string stays in the access log.
        assert status == 500
        err = json.loads(body)["error"]
        assert err == {
            "type": "server_error",
            "code": "sidecar_unavailable",
            "message": "The admission service is unavailable.",
            "param": None,
        }
    with urllib.request.urlopen(f"{stack.url}/v1/models", timeout=10) as r:
        assert r.status == 200  # ext_proc is disabled on this route


def test_sidecar_comes_back(tmp_path: Path) -> None:
    """Fail closed while it is down; once it starts, requests are admitted again."""
    with running_stack(tmp_path, None, start_sidecar=False, failure_mode_allow=False) as stack:
        assert post(f"{stack.url}/v1/chat/completions")[0] == 500
        stack.start_sidecar_proc()
        status, body = 0, b""
        for _ in range(40):  # Envoy reconnects on the next request; allow a few tries
            status, body = post(f"{stack.url}/v1/chat/completions")
            if status == 200:
                break
        assert status == 200
        assert json.loads(json.loads(body)["echo"]["body"])["max_tokens"] == 1024


SHUTDOWN_POLICY = """
buckets:
  - {name: one, max_concurrency: 1, queue_timeout: 10s, max_queue: 5}
"""


Answer = tuple[int, dict[str, str], bytes]


def send(url: str, headers: dict[str, str], out: list[Answer]) -> None:
    req = urllib.request.Request(
        url,
        data=json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(),
        headers={"content-type": "application/json", **headers},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            out.append((r.status, dict(r.headers), r.read()))
    except urllib.error.HTTPError as e:
        out.append((e.code, dict(e.headers), e.read()))


def test_sigterm_drains_admitted_and_refuses_queued_with_503(tmp_path: Path) -> None:
    with running_stack(tmp_path, SHUTDOWN_POLICY) as stack:
        url = f"{stack.url}/v1/chat/completions"
        held: list[Answer] = []
        queued: list[Answer] = []
        holder = threading.Thread(target=send, args=(url, {"x-test-delay-ms": "1500"}, held))
        holder.start()
        wait_gauge(stack, "llm_extproc_in_flight", "one", 1)
        waiter = threading.Thread(target=send, args=(url, {}, queued))
        waiter.start()
        wait_gauge(stack, "llm_extproc_queue_depth", "one", 1)
        sidecar = stack.procs["sidecar"]
        sidecar.popen.send_signal(signal.SIGTERM)
        waiter.join(5)
        # Refused while the admitted request still runs (how soon after the signal:
        # bench.bounds, sigterm_refuses_queued).
        status, headers, body = queued[0]
        assert status == 503 and holder.is_alive()
        assert json.loads(body)["error"]["code"] == "shutting_down"
        assert int({k.lower(): v for k, v in headers.items()}["retry-after"]) >= 1
        late: list[Answer] = []
        send(url, {}, late)
        assert late[0][0] == 503  # newcomers while draining
        holder.join(10)
        assert held[0][0] == 200  # the admitted request finished
        assert sidecar.popen.wait(10) == 0
