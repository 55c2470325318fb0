"""Tier 3: Envoy behaviour the design rests on, pinned on the real Envoy 1.40 binary.

Why the sidecar keeps ``request_header_mode: SEND`` (one more gRPC message per request, the
largest cost left on the request path): with the headers message skipped, Envoy does not hold
the request while the body is with the ext_proc server. It sends the headers upstream at once,
so the backend starts before admission has decided (a backend that answers without reading
the body answers before it), and header mutations in the body answer come too late. Checked
here: the backend has the request's headers while the ext_proc server still sits on the body
message.

And why the sidecar cannot see how an answer ended (``extproc.pool.ends``): Envoy resets the
ext_proc stream at the end of every HTTP stream, whether the client read the answer to its end,
left in the middle, or the upstream reset; and why it does not time the first token itself:
once the response body streams to it, an answer to a chunk cannot stop the chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.request import respond as wire
from extproc.transport import h2
from testing.envoy import envoy_binary, render_envoy_config, with_ext_proc
from testing.stack import Proc, free_port, wait_http
from testing.wait import until_async

HOLD_S = 0.5  # below the shipped message_timeout (1 s)


@contextlib.asynccontextmanager
async def _through_envoy(
    tmp: Path,
    process: Callable[[h2.Call], Awaitable[None]],
    backend: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    **ext_proc: Any,
) -> AsyncIterator[int]:
    """The real Envoy (the shipped config, ``ext_proc`` fields merged into its filter) between
    a client and ``backend``, with ``process`` as its ext_proc server; yields the listener's
    port and stops all three after."""
    server = h2.H2Server(
        {
            "/envoy.service.ext_proc.v3.ExternalProcessor/Process": h2.Method(
                process, pb.ProcessingRequest.FromString, wire.serialize
            )
        },
        max_message=1 << 20,
    )
    extproc_port = await server.listen("127.0.0.1", 0)
    backend_server = await asyncio.start_server(backend, "127.0.0.1", 0)
    listener, admin = free_port(), free_port()
    text = render_envoy_config(
        listener_port=listener,
        backend_port=backend_server.sockets[0].getsockname()[1],
        extproc_port=extproc_port,
        admin_port=admin,
    )
    if ext_proc:
        text = with_ext_proc(text, **ext_proc)
    path = tmp / "envoy.yaml"
    path.write_text(text)
    envoy = Proc("envoy", [envoy_binary(), "-c", str(path), "--concurrency", "1"], tmp)
    try:
        await asyncio.to_thread(wait_http, f"http://127.0.0.1:{admin}/ready", 30, envoy)
        yield listener
    finally:
        envoy.stop()
        backend_server.close()
        await server.stop(0)


async def _post(
    listener: int, body: bytes, headers: bytes = b""
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """An HTTP/1.1 chat request through the listener; the connection, to read the answer."""
    r, w = await asyncio.open_connection("127.0.0.1", listener)
    w.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        b"content-type: application/json\r\n%s"
        b"content-length: %d\r\n\r\n%s" % (headers, len(body), body)
    )
    await w.drain()
    return r, w


async def _run(tmp: Path) -> dict[str, Any]:
    seen: dict[str, Any] = {"kinds": []}

    async def process(call: h2.Call) -> None:
        while (msg := await call.read()) is not h2.EOF:
            kind = msg.WhichOneof("request")
            seen["kinds"].append(kind)
            if kind == "request_body":
                seen["attributes"] = {
                    k: v.string_value
                    for k, v in msg.attributes["envoy.filters.http.ext_proc"].fields.items()
                }
                seen["body_at"] = time.monotonic()
                await asyncio.sleep(HOLD_S)  # the subject: admission "deciding" for a while
                seen["answered_at"] = time.monotonic()
                await call.write(pb.ProcessingResponse(request_body=pb.BodyResponse()))
            else:
                await call.write(pb.ProcessingResponse(request_headers=pb.HeadersResponse()))

    async def backend(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        head = (await r.readuntil(b"\r\n\r\n")).lower()
        seen["backend_at"] = time.monotonic()
        # Then read the body, as a real backend would (it comes once ext_proc lets it go).
        if b"transfer-encoding: chunked" in head:
            await r.readuntil(b"0\r\n\r\n")
        else:
            length = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
            await r.readexactly(length)
        seen["backend_body_at"] = time.monotonic()
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await w.drain()
        w.close()

    ext_proc = {
        "processing_mode": {"request_header_mode": "SKIP"},
        "request_attributes": ["request.path", "request.id"],
    }
    async with _through_envoy(tmp, process, backend, **ext_proc) as listener:
        r, w = await _post(listener, b'{"messages": [{"role": "user", "content": "hi"}]}')
        seen["client_status"] = (await asyncio.wait_for(r.readline(), 10)).decode().strip()
        w.close()
    return seen


def test_skipping_request_headers_lets_the_request_through_before_the_answer() -> None:
    with tempfile.TemporaryDirectory() as d:
        seen = asyncio.run(asyncio.wait_for(_run(Path(d)), 60))
    assert seen["kinds"] == ["request_body"]  # no headers message, as configured
    # request_attributes still come, on the body message.
    assert seen["attributes"]["request.path"] == "/v1/chat/completions"
    assert seen["attributes"]["request.id"]
    assert seen["client_status"] == "HTTP/1.1 200 OK"
    # The backend had the request (its headers) while the ext_proc server still held the body
    # message; only the body waited for the answer.
    assert seen["backend_at"] < seen["answered_at"] - HOLD_S / 2
    assert seen["backend_body_at"] >= seen["answered_at"]


async def _ends(tmp: Path) -> dict[str, tuple[str, list[str]]]:
    """How the ext_proc stream of a streamed answer ends, with the shipped processing mode,
    when the answer completes, when the client leaves in the middle, and when the upstream
    resets in the middle."""
    ends: dict[str, tuple[str, list[str]]] = {}
    ended = asyncio.Event()

    async def process(call: h2.Call) -> None:
        kinds: list[str] = []
        case = "?"
        try:
            while (msg := await call.read()) is not h2.EOF:
                kind = msg.WhichOneof("request")
                kinds.append(kind)
                if kind == "request_headers":
                    for h in msg.request_headers.headers.headers:
                        if h.key == "x-case":
                            case = h.raw_value.decode()
                    await call.write(pb.ProcessingResponse(request_headers=pb.HeadersResponse()))
                else:
                    await call.write(pb.ProcessingResponse(request_body=pb.BodyResponse()))
            ends[case] = ("half-close", kinds)
        except asyncio.CancelledError:
            ends[case] = ("reset", kinds)
            raise
        finally:
            ended.set()

    async def backend(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        head = (await r.readuntil(b"\r\n\r\n")).lower()
        length = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
        await r.readexactly(length)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
        w.write(b"transfer-encoding: chunked\r\n\r\n")
        for i in range(3):
            data = b"data: %d\n\n" % i
            w.write(b"%x\r\n%s\r\n" % (len(data), data))
            await w.drain()
        if b"x-case: upstream-reset" in head:
            w.transport.abort()
            return
        if b"x-case: client-leaves" in head:
            await r.read()  # until Envoy closes: the client has gone
        w.write(b"0\r\n\r\n")
        await w.drain()
        w.close()

    async with _through_envoy(tmp, process, backend) as listener:
        for case in ("complete", "client-leaves", "upstream-reset"):
            ended.clear()
            r, w = await _post(
                listener,
                b'{"messages": [{"role": "user", "content": "hi"}], "stream": true}',
                b"x-case: %s\r\n" % case.encode(),
            )
            if case == "complete":
                await r.readuntil(b"0\r\n\r\n")  # the whole answer, the last chunk included
            else:
                await r.readuntil(b"data: 2")
            if case == "client-leaves":
                w.transport.abort()  # in the middle of the answer
            await ended.wait()
            w.close()
    return ends


def test_every_streamed_answer_ends_the_ext_proc_stream_the_same_way() -> None:
    """With the shipped processing mode (request headers SEND, body BUFFERED, the response
    path skipped) Envoy resets the ext_proc stream when the HTTP stream ends, however it
    ended: the sidecar cannot tell an answer its client read to the end from one its client
    left, or one the upstream cut. So it judges waste by the request's deadline instead
    (``extproc.pool.ends``). A later Envoy that half-closes on completion would give a
    signal for free: this test would say so."""
    with tempfile.TemporaryDirectory() as d:
        ends = asyncio.run(asyncio.wait_for(_ends(Path(d)), 60))
    only_request = ["request_headers", "request_body"]
    assert ends == {
        "complete": ("reset", only_request),
        "client-leaves": ("reset", only_request),
        "upstream-reset": ("reset", only_request),
    }


async def _first_byte(tmp: Path) -> list[str]:
    """The messages a server gets that asks for the response: its headers (SEND), then the
    body STREAMED (a ``mode_override`` in the headers answer) until the first chunk, whose
    answer asks for no more body (``mode_override`` NONE). The backend sends its headers at
    once and holds its first chunk until the server has them, as a server that streams an
    answer does before and after a prefill; then one chunk at a time, each once the server
    got the one before. A wait of the backend's that is not met (the headers held back for
    the body, a chunk not passed on) is the failure."""
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm

    seen: list[str] = []
    failed: list[AssertionError] = []
    done = asyncio.Event()

    async def process(call: h2.Call) -> None:
        try:
            while (msg := await call.read()) is not h2.EOF:
                kind = msg.WhichOneof("request")
                seen.append(kind)
                if kind == "request_headers":
                    await call.write(pb.ProcessingResponse(request_headers=pb.HeadersResponse()))
                elif kind == "request_body":
                    await call.write(pb.ProcessingResponse(request_body=pb.BodyResponse()))
                elif kind == "response_headers":
                    answer = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
                    answer.mode_override.response_body_mode = pm.ProcessingMode.STREAMED
                    await call.write(answer)
                else:
                    answer = pb.ProcessingResponse(response_body=pb.BodyResponse())
                    answer.mode_override.response_body_mode = pm.ProcessingMode.NONE
                    await call.write(answer)
        finally:
            done.set()

    async def backend(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        head = (await r.readuntil(b"\r\n\r\n")).lower()
        await r.readexactly(int(head.split(b"content-length:")[1].split(b"\r\n")[0]))
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
        w.write(b"transfer-encoding: chunked\r\n\r\n")
        await w.drain()
        try:
            await until_async(
                lambda: "response_headers" in seen,
                "the response headers at the ext_proc server before any chunk of the body",
            )
            for i in range(4):
                data = b"data: %d\n\n" % i
                w.write(b"%x\r\n%s\r\n" % (len(data), data))
                await w.drain()
                # Each chunk its own body message: the next one goes once this one is there.
                await until_async(
                    lambda n=i + 1: seen.count("response_body") >= n,
                    f"chunk {i} at the ext_proc server (after the answer asking for no more)",
                )
        except AssertionError as e:
            failed.append(e)
            w.transport.abort()  # the answer cut: the client's read ends
            return
        w.write(b"0\r\n\r\n")
        await w.drain()
        w.close()

    mode = {"response_header_mode": "SEND"}
    async with _through_envoy(tmp, process, backend, processing_mode=mode) as listener:
        r, w = await _post(
            listener, b'{"messages": [{"role": "user", "content": "hi"}], "stream": true}'
        )
        try:
            await r.readuntil(b"0\r\n\r\n")
        except asyncio.IncompleteReadError:
            if failed:
                raise failed[0] from None
            raise
        await done.wait()
        w.close()
    return seen


def test_a_body_answer_cannot_stop_the_body_once_it_streams() -> None:
    """Why the sidecar does not time the first token itself (issue 20 asked what Envoy
    allows): the response headers come when the backend sends them, before the first token
    (here the backend holds its first chunk until the server has them), so they say nothing
    of TTFT; and once the body streams to the server, a ``mode_override`` in a body answer is
    ignored (Envoy honours it only in an answer to headers): every chunk, one per token of an
    SSE answer, would be one more message each way for the rest of the stream."""
    with tempfile.TemporaryDirectory() as d:
        kinds = asyncio.run(asyncio.wait_for(_first_byte(Path(d)), 60))
    # The headers came before the backend sent any of the body (it waited for them there).
    assert kinds[:3] == ["request_headers", "request_body", "response_headers"]
    # Asked to stop after the first chunk: every chunk still came (4, and the last, empty).
    assert kinds.count("response_body") >= 4
