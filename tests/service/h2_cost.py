"""What the h2 transport costs per ext_proc call, in process: a repeatable measure for a change.

``python tests/service/h2_cost.py [-n CALLS] [--mode sidecar|echo] [--redis URL] [--loop KIND]``
pushes CALLS complete ext_proc calls through an ``H2Server``, as Envoy sends them: HEADERS and
a DATA frame with the request_headers message, then (answered) the request_body message,
then (answered) an empty DATA frame with END_STREAM, Envoy's half-close once the HTTP stream
is done; every step of every stream is its own ``data_received``, in waves of ``--wave``
concurrent streams. A fake transport stands in for the socket, and the protocol object comes
from the server's own ``listen`` (``loop.create_server`` is replaced to catch its factory),
so the script runs against any version of the transport that has ``H2Server``: run it from
another checkout with ``PYTHONPATH`` pointing there to compare. ``sidecar`` runs the whole
sidecar (``extproc.app.Sidecar``, two big buckets: every request admitted at once); ``echo``
an echo method, the transport alone; ``--redis`` shares the sidecar's pool through that Redis
(``SHARED_POLICY``). It prints the CPU time per call.

On a shared machine, CPU time is noisy; instruction counts are not. Two runs under callgrind
with different CALLS cancel the start-up (imports) out::

    for n in 200 1200; do PYTHONHASHSEED=0 valgrind --tool=callgrind \\
        --callgrind-out-file=/dev/null python tests/service/h2_cost.py -n $n --warm 100 \\
        --mode echo 2>&1 | grep Collected; done

(instructions per call = the difference / 1000). docs/transport.md has the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

import hpack
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

import extproc

PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
POLICY = """\
limits: {max_prompt_tokens: 32768, default_max_tokens: 256, max_output_tokens: 1024}
buckets:
  - {name: interactive, match: {headers: {x-llm-class: interactive}}, max_concurrency: 4096,
     queue_timeout: 5s, max_queue: 4096}
  - {name: batch, max_concurrency: 4096, queue_timeout: 120s, max_queue: 4096}
"""
# ``--redis URL``: the same two buckets as the bands of one static pool shared through Redis
# (one replica: after the first leases, a freed lease stays as a spare and is reused without a
# round trip, so this measures the shared pool's request path).
SHARED_POLICY = """\
limits: {max_prompt_tokens: 32768, default_max_tokens: 256, max_output_tokens: 1024}
pool: {max_concurrency: 8192, shared: {redis: "REDIS", key_prefix: h2cost}}
buckets:
  - {name: interactive, match: {headers: {x-llm-class: interactive}}, priority: 0,
     queue_timeout: 5s, max_queue: 4096}
  - {name: batch, priority: 10, queue_timeout: 120s, max_queue: 4096}
"""
CONTENT = "Can I move my flight from the 14th to the 16th without paying the fare again? " * 4
BODY = json.dumps(
    {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "messages": [{"role": "user", "content": CONTENT}],
        "max_tokens": 128,
    }
).encode()
HEADERS_IN = [
    (":path", "/v1/chat/completions"),
    (":method", "POST"),
    (":authority", "llm"),
    ("content-type", "application/json"),
    ("x-llm-class", "interactive"),
    ("x-request-id", "3f2a9c1e-7b4d-4e8a-9c2f-1d5e6a7b8c9d"),
]
DATA, HEADERS, SETTINGS, WINDOW_UPDATE = 0, 1, 4, 8
END_STREAM, END_HEADERS = 1, 4
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# The block Envoy sends for every ext_proc stream leaves the HPACK table alone.
BLOCK = bytes(
    hpack.Encoder().encode(
        [
            (":method", "POST", True),
            (":scheme", "http", True),
            (":path", PROCESS, True),
            (":authority", "ext_proc", True),
            ("content-type", "application/grpc", True),
            ("te", "trailers", True),
        ],
        huffman=False,
    )
)


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return struct.pack(">BHBBL", n >> 16, n & 0xFFFF, ftype, flags, sid) + payload


def grpc_msg(payload: bytes) -> bytes:
    return struct.pack(">BL", 0, len(payload)) + payload


def messages() -> tuple[bytes, bytes]:
    """The request_headers and request_body messages of one call, framed."""
    header_map = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=k, raw_value=v.encode())
            for k, v in [*HEADERS_IN, ("content-length", str(len(BODY)))]
        ]
    )
    headers = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=header_map))
    body = pb.ProcessingRequest(request_body=pb.HttpBody(body=BODY, end_of_stream=True))
    return grpc_msg(headers.SerializeToString()), grpc_msg(body.SerializeToString())


class FakeTransport:
    """The socket: keeps what the server writes."""

    def __init__(self) -> None:
        self.out = bytearray()

    def write(self, data: bytes) -> None:
        self.out += data

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0

    def set_write_buffer_limits(self, high: int = 0, low: int = 0) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default


class FakeServer:
    """What ``loop.create_server`` returns, as far as the h2 server reads it."""

    class _Socket:
        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", 1)

    sockets = (_Socket(),)

    def close(self) -> None:
        pass

    async def wait_closed(self) -> None:
        pass


class Answers:
    """Per stream, the DATA frames and whether the trailers came back."""

    def __init__(self, transport: FakeTransport) -> None:
        self.transport = transport
        self.pos = 0
        self.data: dict[int, int] = {}
        self.ended: set[int] = set()

    def poll(self) -> None:
        buf = self.transport.out
        pos, n = self.pos, len(buf)
        while n - pos >= 9:
            length = int.from_bytes(buf[pos : pos + 3], "big")
            if n - pos - 9 < length:
                break
            ftype, flags = buf[pos + 3], buf[pos + 4]
            sid = int.from_bytes(buf[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
            if ftype == DATA:
                self.data[sid] = self.data.get(sid, 0) + 1
            elif ftype == HEADERS and flags & END_STREAM:
                self.ended.add(sid)
            pos += 9 + length
        if pos > 1 << 20:
            del buf[:pos]
            pos = 0
        self.pos = pos


async def serve(mode: str, redis: str | None) -> Callable[[float], Awaitable[None]]:
    """Start the server (``listen`` caught); returns its stop."""
    if mode == "sidecar":
        from extproc.app import Sidecar
        from extproc.config.policy import policy_from_yaml

        text = POLICY if redis is None else SHARED_POLICY.replace("REDIS", redis)
        sidecar = Sidecar(policy_from_yaml(text), listen="127.0.0.1:0", metrics_listen=None)
        await sidecar.start()
        return sidecar.stop
    from extproc.transport import h2

    answer = b"\x12\x05" + b"x" * 5  # a small pre-encoded answer, as respond's are

    async def echo(call: Any) -> None:
        while (await call.read()) is not h2.EOF:
            await call.write(answer)

    server = h2.H2Server({PROCESS: h2.Method(echo, bytes, bytes)}, max_message=8 << 20)
    await server.listen("127.0.0.1", 0)
    return server.stop


async def main(calls: int, wave: int, warm: int, mode: str, redis: str | None) -> float:
    """CPU seconds per call, after ``warm`` calls."""
    loop = asyncio.get_running_loop()
    factories: list[Callable[[], asyncio.Protocol]] = []

    async def create_server(factory: Callable[[], asyncio.Protocol], *a: Any, **kw: Any) -> Any:
        factories.append(factory)
        return FakeServer()

    loop.create_server = create_server  # type: ignore[method-assign,assignment]
    stop = await serve(mode, redis)
    protocol = factories[0]()
    transport = FakeTransport()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    window = frame(WINDOW_UPDATE, 0, 0, struct.pack(">L", 2**31 - 1 - 65535))
    protocol.data_received(
        PREFACE + frame(SETTINGS, 0, 0, struct.pack(">HL", 4, 2**31 - 1)) + window
    )
    answers = Answers(transport)
    head, body = messages()
    next_id = [1]

    async def until(done: Callable[[], bool]) -> None:
        for _ in range(100_000):
            answers.poll()
            if done():
                return
            await asyncio.sleep(0)
        raise AssertionError("no answer")

    async def run(count: int) -> None:
        while count > 0:
            k = min(wave, count)
            count -= k
            sids = range(next_id[0], next_id[0] + 2 * k, 2)
            next_id[0] += 2 * k
            for s in sids:
                protocol.data_received(
                    frame(HEADERS, END_HEADERS, s, BLOCK) + frame(DATA, 0, s, head)
                )
            await until(lambda: all(answers.data.get(s, 0) >= 1 for s in sids))  # noqa: B023
            for s in sids:
                protocol.data_received(frame(DATA, 0, s, body))
            await until(lambda: all(answers.data.get(s, 0) >= 2 for s in sids))  # noqa: B023
            for s in sids:
                protocol.data_received(frame(DATA, END_STREAM, s))
            await until(lambda: all(s in answers.ended for s in sids))  # noqa: B023
            for s in sids:
                answers.data.pop(s, None)
                answers.ended.discard(s)

    await run(warm)
    start = time.process_time()
    await run(calls)
    spent = time.process_time() - start
    await stop(0)
    return spent / calls


def _loop(kind: str) -> asyncio.AbstractEventLoop:
    if kind == "asyncio":
        return asyncio.new_event_loop()
    import uvloop

    class Loop(uvloop.Loop):  # type: ignore[misc]  # a Python subclass: create_server can be replaced
        pass

    return Loop()  # type: ignore[no-any-return]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", type=int, default=3000, help="calls measured")
    parser.add_argument("--wave", type=int, default=32, help="streams open at once")
    parser.add_argument("--warm", type=int, default=500, help="calls before measuring")
    parser.add_argument("--mode", choices=["sidecar", "echo"], default="sidecar")
    parser.add_argument("--redis", help="sidecar mode: share the pool through this Redis URL")
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    args = parser.parse_args()
    loop = _loop(args.loop)
    asyncio.set_event_loop(loop)
    per_call = loop.run_until_complete(main(args.n, args.wave, args.warm, args.mode, args.redis))
    tree = extproc.__file__.rsplit("/extproc/", 1)[0]
    mode = args.mode if args.redis is None else f"{args.mode} (shared)"
    print(f"{tree}: {mode} on {args.loop}, {args.n} calls: {per_call * 1e6:.1f} us CPU/call")
