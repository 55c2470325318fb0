"""Tier 3: the answer Envoy gives itself when the sidecar is up but does not answer.

A sidecar that has stopped answering (here: its process is stopped with SIGSTOP, so the kernel
still holds its connections and nothing replies) leaves Envoy waiting on the request_headers
message. After ``message_timeout`` (1 s in envoy/envoy.yaml) Envoy gives up and, with
``failure_mode_allow: false``, answers 504 itself, which envoy.yaml's local_reply_config turns
into a JSON error. docs/envoy.md lists this with the other answers of Envoy's own (500 sidecar
down: tests/e2e/test_failure.py; 503 backend down: tests/e2e/test_faults.py).
"""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

from testing.harness import running_stack

BODY = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()


def post(url: str) -> tuple[int, bytes, float]:
    req = urllib.request.Request(
        url, data=BODY, headers={"content-type": "application/json"}, method="POST"
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
        # Envoy waited its message_timeout (1 s), not the client's 10 s.
        assert 0.9 <= seconds < 5.0, seconds
        err = json.loads(body)["error"]
        assert err["type"] == "server_error"
        assert err["code"] == "ext_proc_error_per-message_timeout_exceeded"
        # Resumed, the sidecar answers again.
        assert post(url)[0] == 200
