"""The door has no way around it (issue 31), through the shipped envoy/envoy.yaml, the real
Envoy, the real sidecar and the test backend: every spelling of an LLM path is either admitted
(counted, clamped, and the backend sees the normalised path) or refused by Envoy (400
``invalid_path``, 404 ``unknown_url``) without reaching the backend; the Responses API,
Anthropic's Messages and the pooling endpoints are admitted and bounded in their own keys; the
APIs the sidecar cannot bound (audio, ``/invocations``) are refused by it (404
``unsupported_endpoint``, counted); only the allowlist passes without the sidecar; and Envoy's
own 2xx/3xx local replies keep their bodies.

Requests go over a raw socket: an HTTP client library would normalise the paths itself.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from extproc.contract import LLM_PATHS
from extproc.record import NO_BUCKET
from testing.envoy import hcm_config
from testing.harness import backend_stats, outcomes, start_stack
from testing.stack import Stack
from testing.wait import until

POLICY = """
limits: {max_prompt_tokens: 500, default_max_tokens: 50, max_output_tokens: 100}
buckets:
  - name: all
    max_concurrency: 4
    queue_timeout: 3s
    max_queue: 100
"""
CAP = 100  # max_output_tokens above
ASKED = 3000  # what each probe asks for

CHAT = "/v1/chat/completions"
# (path as sent, what becomes of it): "admitted" (the backend sees CHAT, clamped), or the
# status and error code Envoy answers with.
SPELLINGS: list[tuple[str, str | tuple[int, str]]] = [
    (CHAT, "admitted"),
    (CHAT + "?stream=false", "admitted"),
    ("/v1/%63hat/completions", "admitted"),  # percent-encoded letter: decoded
    ("/v1/chat/%2e%2e/chat/completions", "admitted"),  # encoded dot segment
    ("//v1/chat/completions", "admitted"),  # slashes merged
    ("/v1//chat///completions", "admitted"),
    ("/v1/./chat/completions", "admitted"),  # dot segments resolved
    ("/v1/models/../chat/completions", "admitted"),
    ("/v1/chat%2Fcompletions", (400, "invalid_path")),  # escaped slashes refused
    ("/v1/chat%2fcompletions", (400, "invalid_path")),
    ("/v1%2Fchat%2Fcompletions", (400, "invalid_path")),
    ("/v1/chat%5Ccompletions", (400, "invalid_path")),  # an escaped backslash too
    ("/v1/chat/completions/", (404, "unknown_url")),  # no route: default deny
    ("/V1/chat/completions", (404, "unknown_url")),
    ("/v1/chat/completions;x=1", (404, "unknown_url")),
    ("/v1/chat/completions%3F", (404, "unknown_url")),
]


@pytest.fixture(scope="module")
def stack(module_tmp: Path) -> Iterator[Stack]:
    yield from start_stack(module_tmp / "door", POLICY, envoy_patch=with_local_replies)


def with_local_replies(cfg: dict[str, Any]) -> None:
    """Two routes Envoy answers itself, a 200 and a redirect, to see that the local-reply
    mappers leave Envoy's 2xx and 3xx answers alone."""
    routes = hcm_config(cfg)["route_config"]["virtual_hosts"][0]["routes"]
    routes.insert(
        0,
        {
            "match": {"path": "/ok"},
            "direct_response": {"status": 200, "body": {"inline_string": "fine"}},
        },
    )
    routes.insert(0, {"match": {"path": "/old"}, "redirect": {"path_redirect": "/new"}})


async def _raw(
    port: int, method: str, target: str, body: bytes = b""
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request with ``target`` exactly as given; the status, headers and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = (
            f"{method} {target} HTTP/1.1\r\nhost: door\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        writer.write(head.encode() + body)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    head_bytes, _, payload = raw.partition(b"\r\n\r\n")
    status_line, *lines = head_bytes.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    if headers.get("transfer-encoding") == "chunked":
        payload = _unchunk(payload)
    return int(status_line.split()[1]), headers, payload


def _unchunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out, data = out + data[:size], data[size + 2 :]
    return out


def send(
    stack: Stack, method: str, target: str, body: Any = None
) -> tuple[int, dict[str, str], Any]:
    raw = b"" if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    status, headers, payload = asyncio.run(_raw(stack.listener_port, method, target, raw))
    try:
        return status, headers, json.loads(payload)
    except ValueError:
        return status, headers, payload


def chat_body() -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": ASKED}


def admitted(stack: Stack) -> float:
    return sum(v for (_, outcome), v in outcomes(stack).items() if outcome == "admitted")


@pytest.mark.parametrize(("target", "expected"), SPELLINGS, ids=[s for s, _ in SPELLINGS])
def test_no_spelling_of_an_llm_path_reaches_the_backend_unadmitted(
    stack: Stack, target: str, expected: str | tuple[int, str]
) -> None:
    before_admitted, before_backend = admitted(stack), backend_stats(stack)["total"]
    status, headers, got = send(stack, "POST", target, chat_body())
    if expected == "admitted":
        assert status == 200, got
        echo = got["echo"]
        assert json.loads(echo["body"])["max_tokens"] == CAP  # clamped from 3000
        assert headers["x-llm-max-tokens"] == str(CAP)
        # Counted when its ext_proc stream ends, which may come just after the answer.
        until(lambda: admitted(stack) == before_admitted + 1, "the request counted admitted")
        assert backend_stats(stack)["total"] == before_backend + 1
    else:
        assert (status, got["error"]["code"]) == expected, got
        # Envoy refuses an escaped slash before it gives the request an id.
        assert status == 400 or headers["x-request-id"]
        assert admitted(stack) == before_admitted
        assert backend_stats(stack)["total"] == before_backend  # the backend saw nothing


def test_the_absolute_form_is_admitted(stack: Stack) -> None:
    before = admitted(stack)
    status, _, got = send(stack, "POST", f"http://door{CHAT}", chat_body())
    assert status == 200 and json.loads(got["echo"]["body"])["max_tokens"] == CAP
    until(lambda: admitted(stack) == before + 1, "the request counted admitted")


REFUSED = [path for path, api in LLM_PATHS.items() if api is None]


@pytest.mark.parametrize("path", REFUSED)
def test_every_other_api_where_vllm_computes_is_refused_by_the_sidecar(
    stack: Stack, path: str
) -> None:
    """Each reaches the sidecar (Envoy routes it there) and is refused, counted, never passed:
    the backend's pass-through handler, which would answer any path, sees none of them."""
    refused = (NO_BUCKET, "rejected_invalid")
    before = outcomes(stack).get(refused, 0)
    before_backend = backend_stats(stack)["total"]
    status, _, got = send(stack, "POST", path, {"model": "m", "input": "hi", "max_tokens": ASKED})
    assert (status, got["error"]["code"]) == (404, "unsupported_endpoint"), got
    assert path in got["error"]["message"]
    until(lambda: outcomes(stack).get(refused) == before + 1, "the refusal counted")
    assert backend_stats(stack)["total"] == before_backend


# The other APIs the sidecar admits: (path, body, the output bound's key or None for pooling)
APIS = [
    (
        "/v1/responses",
        {"model": "m", "input": "hi", "max_output_tokens": ASKED},
        "max_output_tokens",
    ),
    (
        "/v1/messages",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": ASKED},
        "max_tokens",
    ),
    ("/v1/embeddings", {"model": "e", "input": ["a", "b"]}, None),
    ("/v2/rerank", {"model": "r", "query": "q", "documents": ["d"]}, None),
]


@pytest.mark.parametrize(("path", "body", "key"), APIS, ids=[p for p, _, _ in APIS])
def test_the_other_apis_are_admitted_and_bounded(
    stack: Stack, path: str, body: dict[str, Any], key: str | None
) -> None:
    """Through the sidecar: counted, the output bound clamped in the API's own key (pooling:
    the body unchanged), and the backend sees it (its pass-through echo)."""
    before = admitted(stack)
    status, headers, got = send(stack, "POST", path, body)
    assert status == 200 and got["path"] == path, got
    reached = json.loads(got["body"])
    if key is None:
        assert reached == body
    else:
        assert reached[key] == CAP and headers["x-llm-max-tokens"] == str(CAP)
    assert got["headers"]["x-llm-bucket"] == "all"
    until(lambda: admitted(stack) == before + 1, "the request counted admitted")


def test_only_the_allowlist_passes_without_the_sidecar(stack: Stack) -> None:
    before = outcomes(stack)
    status, _, got = send(stack, "GET", "/v1/models")
    assert status == 200 and got["path"] == "/v1/models"  # the backend's pass-through echo
    status, _, got = send(stack, "POST", "/tokenize", b"{not json")
    assert status == 200 and got["body"] == "{not json"  # untouched: no sidecar, no buffer
    for method, target in (
        ("GET", "/metrics"),
        ("POST", "/v1/models"),
        ("GET", "/admin"),
        ("DELETE", "/v1/models/x"),
    ):
        status, _, got = send(stack, method, target)
        assert (status, got["error"]["code"]) == (404, "unknown_url"), (method, target, got)
    assert outcomes(stack) == before  # none of these counted


def test_envoys_own_2xx_and_3xx_answers_keep_their_bodies(stack: Stack) -> None:
    """The local-reply mappers rewrite Envoy's 4xx and 5xx answers only (on Istio they merge
    into every route of the gateway)."""
    status, _, got = send(stack, "GET", "/ok")
    assert (status, got) == (200, b"fine")
    status, headers, got = send(stack, "GET", "/old")
    assert status == 301 and headers["location"].endswith("/new") and not got


@pytest.mark.parametrize(
    ("body", "status", "kind", "code"),
    [
        ({"model": "m", "max_tokens": 5}, 400, "invalid_request_error", "missing_field"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x " * 2000}]},
            413,
            "request_too_large",
            "prompt_too_long",
        ),
    ],
)
def test_anthropic_clients_get_anthropics_error_shape(
    stack: Stack, body: dict[str, Any], status: int, kind: str, code: str
) -> None:
    """/v1/messages refusals in Anthropic's shape, ``{"type": "error", "error": {...}}``,
    keeping the stable code; other APIs keep OpenAI's."""
    got_status, _, got = send(stack, "POST", "/v1/messages", body)
    assert got_status == status and got["type"] == "error", got
    assert (got["error"]["type"], got["error"]["code"]) == (kind, code)
    assert got["error"]["message"]
