"""Tier 3: the hostile-input corpus (tests/e2e/corpus.py) through the real Envoy, as raw bytes.

Every case gets its documented status and an OpenAI-style JSON error (or reaches the backend
as it should); afterwards nothing is in flight or queued. Also: a chunked upload that stalls
does not hold up anyone else, and a client that gives up on it leaves nothing behind.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testing.harness import outcomes, start_stack, wait_idle
from testing.stack import Stack
from tests.e2e.corpus import CASES, CORPUS_POLICY, Case


@pytest.fixture(scope="module")
def stack(module_tmp: Path) -> Iterator[Stack]:
    yield from start_stack(module_tmp, CORPUS_POLICY)


def request_bytes(case: Case, port: int) -> list[bytes]:
    """The request as the pieces to write (more than one for chunked uploads)."""
    lines = [f"{case.method} {case.path} HTTP/1.1", f"host: 127.0.0.1:{port}", "connection: close"]
    lines += [f"{k}: {v}" for k, v in case.headers.items()]
    if case.chunked:
        lines.append("transfer-encoding: chunked")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode()
        half = len(case.body) // 2
        parts = [case.body[:half], case.body[half:]]
        return [head] + [b"%x\r\n%s\r\n" % (len(p), p) for p in parts] + [b"0\r\n\r\n"]
    if case.method != "GET" or case.body:
        lines.append(f"content-length: {len(case.body)}")
    return [("\r\n".join(lines) + "\r\n\r\n").encode() + case.body]


def exchange(
    port: int, pieces: list[bytes], timeout: float = 20
) -> tuple[int, dict[str, str], bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            for piece in pieces:
                s.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass  # Envoy may answer (413) and close before the whole body is sent
        data = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding") == "chunked":
        out, rest = b"", body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2 :]
        body = out
    return int(status_line.split()[1]), headers, body


def test_corpus_is_big_enough() -> None:
    assert len(CASES) >= 60
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case(stack: Stack, case: Case) -> None:
    status, headers, body = exchange(stack.listener_port, request_bytes(case, stack.listener_port))
    assert status == case.status, body[:300]
    if case.code is not None:
        assert headers["content-type"] == "application/json"
        err = json.loads(body)["error"]
        assert err["code"] == case.code
        assert err["message"] and err["type"] == "invalid_request_error"
    elif (
        case.path.startswith(("/v1/chat/completions", "/v1/completions")) and case.method == "POST"
    ):
        echo = json.loads(body)["echo"]
        sent = echo["body"]
        if "content-length" in echo["headers"]:  # a chunked upload stays chunked upstream
            assert int(echo["headers"]["content-length"]) == len(sent.encode("utf-8"))
        if case.max_tokens is not None:
            assert json.loads(sent.removeprefix("\ufeff"))["max_tokens"] == case.max_tokens
            assert headers["x-llm-max-tokens"] == str(case.max_tokens)
    else:
        assert "x-llm-bucket" not in json.loads(body).get("headers", {})


def test_nothing_left_behind_and_every_request_counted(stack: Stack) -> None:
    wait_idle(stack)
    counted = sum(outcomes(stack).values())
    # Requests the sidecar saw: POSTs to LLM paths that Envoy did not refuse itself.
    seen = [
        c
        for c in CASES
        if c.method == "POST"
        and c.path.startswith(("/v1/chat/completions", "/v1/completions"))
        and c.code != "body_too_large"
    ]
    assert counted >= len(seen)


def test_stalled_chunked_upload_blocks_nobody(stack: Stack) -> None:
    port = stack.listener_port
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
            b'5\r\n{"mes\r\n'
        )
        # While that body never finishes, others are served (how fast: bench.bounds,
        # stalled_upload_bystanders).
        for _ in range(5):
            case = Case(
                name="probe",
                body=b'{"prompt": "x", "max_tokens": 1}',
                status=200,
                path="/v1/completions",
            )
            status, _, _ = exchange(port, request_bytes(case, port))
            assert status == 200
    finally:
        s.close()  # the client gives up mid-body
    wait_idle(stack)


def test_slow_but_complete_chunked_upload_is_admitted(stack: Stack) -> None:
    port = stack.listener_port
    body = b'{"prompt": "hello", "max_tokens": 3}'
    result: list[tuple[int, dict[str, str], bytes]] = []

    def slow() -> None:
        head = (
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
            b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        pieces = [head] + [b"%x\r\n%s\r\n" % (1, body[i : i + 1]) for i in range(len(body))]
        with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
            for p in pieces:
                s.sendall(p)
                time.sleep(0.02)  # the subject: a client that uploads slowly
            s.sendall(b"0\r\n\r\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        result.append((int(data.split()[1]), {}, data))

    t = threading.Thread(target=slow)
    t.start()
    t.join(30)
    assert result and result[0][0] == 200
    assert b'"max_tokens\\": 3' in result[0][2] or b'"max_tokens": 3' in result[0][2]


@pytest.mark.parametrize(
    "body,status,code",
    [
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 999}', 200, None),
        (b"{oops", 400, "invalid_json"),
    ],
)
def test_http2_clients(stack: Stack, body: bytes, status: int, code: str | None) -> None:
    """HTTP/2 (prior knowledge, h2c) clients get the same answers; curl speaks it for us."""
    import subprocess

    out = subprocess.run(
        [
            "curl",
            "-sS",
            "--http2-prior-knowledge",
            "-o",
            "-",
            "-D",
            "/dev/stderr",
            "-H",
            "content-type: application/json",
            "--data-binary",
            "@-",
            f"{stack.url}/v1/chat/completions",
        ],
        input=body,
        capture_output=True,
        timeout=30,
        check=True,
    )
    head = out.stderr.decode()
    assert head.startswith(f"HTTP/2 {status}"), head
    if code is None:
        assert "x-llm-max-tokens: 100" in head
        assert json.loads(json.loads(out.stdout)["echo"]["body"])["max_tokens"] == 100
    else:
        assert json.loads(out.stdout)["error"]["code"] == code
