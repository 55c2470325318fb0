"""Tier 3: what clients see when the sidecar is not there, for both failure modes.

Pinned on Envoy 1.40 (ENVOY_NOTES.md): with ``failure_mode_allow: false`` (our default) an LLM
request gets 500 with an empty body; with ``true`` it reaches the backend unfiltered, bypassing
admission and length limits. Routes with ext_proc disabled are unaffected either way.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.stack import Stack
from tests.harness import running_stack, start_stack

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
    yield from start_stack(tmp_path, None, start_sidecar=False,
                           failure_mode_allow=request.param)


def test_sidecar_down(stack: Stack) -> None:
    status, body = post(f"{stack.url}/v1/chat/completions")
    if stack.failure_mode_allow:
        assert status == 200
        # Unfiltered: max_tokens was not clamped.
        assert json.loads(json.loads(body)["echo"]["body"])["max_tokens"] == 99999
    else:
        assert (status, body) == (500, b"")
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
