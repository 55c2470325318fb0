"""Tier 3: Envoy returns the request's x-request-id on every answer (HCM
``always_set_request_id_in_response`` in envoy/envoy.yaml), the sidecar's refusals included,
and the sidecar logs each refusal with that id, so the id a client reports finds the refusal
in the sidecar's log and Envoy's access log."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testing.harness import start_stack
from testing.stack import Stack
from testing.wait import until

POLICY = """
limits: {max_prompt_tokens: 100, max_output_tokens: 32}
buckets:
  - {name: all, max_concurrency: 2, queue_timeout: 1s, max_queue: 2}
"""


@pytest.fixture(scope="module")
def stack(module_tmp: Path) -> Iterator[Stack]:
    yield from start_stack(module_tmp, POLICY)


def post(stack: Stack, content: str) -> tuple[int, str]:
    """The status and the x-request-id header of one chat completion."""
    req = urllib.request.Request(
        stack.url + "/v1/chat/completions",
        data=json.dumps({"messages": [{"role": "user", "content": content}]}).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            r.read()
            return r.status, r.headers.get("x-request-id", "")
    except urllib.error.HTTPError as e:
        e.read()
        return e.code, e.headers.get("x-request-id", "")


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def sidecar_entry(stack: Stack, request_id: str) -> dict[str, Any]:
    """The sidecar's log line for the request ``request_id``, once it is written."""
    found = until(
        lambda: [
            e
            for e in json_lines(stack.procs["sidecar"].log_text())
            if e.get("request_id") == request_id
        ],
        f"the sidecar's log line of request {request_id}",
    )
    (entry,) = found
    return entry


def access_entry(stack: Stack, request_id: str) -> dict[str, Any]:
    def entries() -> list[dict[str, Any]]:
        path = stack.access_log_path
        text = path.read_text() if path.exists() else ""
        return [e for e in json_lines(text) if e.get("request_id") == request_id]

    (entry,) = until(entries, f"the access-log line of request {request_id}")
    return entry


def test_a_refusal_carries_the_request_id_the_sidecar_logged_it_with(stack: Stack) -> None:
    status, request_id = post(stack, "x" * 4000)  # about 1000 tokens: above max_prompt_tokens
    assert status == 413
    assert uuid.UUID(request_id), request_id  # Envoy's own id (a UUID4)
    entry = sidecar_entry(stack, request_id)
    assert (entry["logger"], entry["outcome"], entry["code"]) == (
        "extproc.requests",
        "rejected_too_large",
        "prompt_too_long",
    )
    assert access_entry(stack, request_id)["status"] == 413


def test_an_admitted_request_carries_its_request_id(stack: Stack) -> None:
    status, request_id = post(stack, "hi")
    assert status == 200
    assert uuid.UUID(request_id), request_id
    assert access_entry(stack, request_id)["status"] == 200
    # Two requests, two ids.
    assert post(stack, "hi")[1] not in ("", request_id)
