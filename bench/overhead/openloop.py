"""Open loop at fixed rates: latency of each way at 100, 500, 1000 req/s (by default).

h2load's --rps sends in bursts (one timer tick per ~10 ms: 5 requests at once at 500 req/s)
and its timing script drifts (each delay is relative to the previous send), so neither gives
a fixed rate (both seen by hand; no command here measures them). The sender here is a small
asyncio HTTP/1.1 client: the schedule is fixed up front (request i at t0 + i/rate), each
request goes out on an idle keep-alive connection at its time whatever happened to earlier
ones (a new connection is opened if none is idle), and latency is measured from the moment the
request was written to the moment its last byte was read. Its lateness against the schedule
(asyncio wakes up with millisecond granularity) and its own CPU are reported with every run.

A way's server CPU is that of the processes ``ways.metered_of`` names (sidecar+redis: the
sidecar and the redis-server together); on sidecar+redis the redis-server's script calls are
counted over each run (``redis_calls_per_request``: how many requests made a round trip).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import resource
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.common.stats import percentile_scaled
from bench.overhead.meters import CpuMeter, log
from bench.overhead.procs import Bench
from bench.overhead.ways import REDIS, SIDECAR_REDIS, WAYS, metered_of

__all__ = ["OpenLoop", "Samples", "http_request", "open_loop", "open_loop_runs"]

_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:\s*(\d+)", re.IGNORECASE)


def http_request(
    host_port: str, path: str, body: bytes, headers: Sequence[tuple[str, str]]
) -> bytes:
    """One HTTP/1.1 POST with a JSON body, as bytes on the wire."""
    lines = [f"POST {path} HTTP/1.1", f"host: {host_port}", "content-type: application/json"]
    lines += [f"{k}: {v}" for k, v in headers]
    lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class _Conn(asyncio.Protocol):
    __slots__ = ("buf", "gen", "index", "transport")

    def __init__(self, gen: OpenLoop) -> None:
        self.gen = gen
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.index = -1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        buf = self.buf
        buf += data
        end = buf.find(b"\r\n\r\n")
        if end < 0 or self.index < 0:
            return
        m = _CONTENT_LENGTH.search(buf, 0, end + 2)
        length = int(m.group(1)) if m else 0
        if len(buf) < end + 4 + length:
            return
        status = int(buf[9:12])
        close = b"\r\nconnection: close" in bytes(buf[:end]).lower()
        del buf[: end + 4 + length]
        index, self.index = self.index, -1
        self.gen.finished(self, index, now, status, close)

    def connection_lost(self, exc: Exception | None) -> None:
        self.gen.lost(self)


class OpenLoop:
    """``count`` copies of ``request`` sent to 127.0.0.1:``port`` at ``rate`` req/s; per
    request: scheduled, sent and done times (monotonic) and the status (-1: connection lost,
    0: no answer within 30 s of the last send)."""

    def __init__(self, port: int, request: bytes, rate: float, count: int) -> None:
        self.port = port
        self.request = request
        self.rate = rate
        self.count = count
        self.sched = [0.0] * count
        self.sent = [0.0] * count
        self.done = [0.0] * count
        self.status = [0] * count
        self.idle: list[_Conn] = []
        self.busy: set[_Conn] = set()
        self.opened = 0
        self.max_busy = 0
        self.remaining = count
        self.all_done: asyncio.Future[None] | None = None

    async def _open(self) -> _Conn:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(lambda: _Conn(self), "127.0.0.1", self.port)
        self.opened += 1
        return conn

    def _send(self, conn: _Conn, index: int) -> None:
        assert conn.transport is not None
        conn.index = index
        self.busy.add(conn)
        self.max_busy = max(self.max_busy, len(self.busy))
        self.sent[index] = time.monotonic()
        conn.transport.write(self.request)

    def finished(self, conn: _Conn, index: int, now: float, status: int, close: bool) -> None:
        self.done[index] = now
        self.status[index] = status
        self.busy.discard(conn)
        if close and conn.transport is not None:
            conn.transport.close()
            conn.transport = None
        elif conn.transport is not None:
            self.idle.append(conn)
        self.remaining -= 1
        if self.remaining == 0 and self.all_done is not None and not self.all_done.done():
            self.all_done.set_result(None)

    def lost(self, conn: _Conn) -> None:
        conn.transport = None
        with contextlib.suppress(ValueError):
            self.idle.remove(conn)
        if conn in self.busy and conn.index >= 0:
            # The connection dropped with a request on it: that request failed (status -1).
            self.finished(conn, conn.index, time.monotonic(), -1, False)

    async def run(self, warm_connections: int = 16) -> None:
        loop = asyncio.get_running_loop()
        self.all_done = loop.create_future()
        self.idle = [await self._open() for _ in range(warm_connections)]
        t0 = loop.time() + 0.02
        period = 1.0 / self.rate
        for i in range(self.count):
            self.sched[i] = t0 + i * period
        i = 0
        while i < self.count:
            now = loop.time()
            # Send everything that is due (normally one request per wake-up).
            while i < self.count and self.sched[i] <= now:
                conn = self.idle.pop() if self.idle else await self._open()
                self._send(conn, i)
                i += 1
            if i < self.count:
                await asyncio.sleep(self.sched[i] - loop.time())
        # Requests still unanswered 30 s after the last send keep status 0 (reported as failed).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.all_done), 30.0)
        for conn in [*self.idle, *self.busy]:
            if conn.transport is not None:
                conn.transport.close()


@dataclass(slots=True)
class Samples:
    """Per-request figures of one way at one rate, pooled over rounds."""

    latency_s: list[float] = field(default_factory=list)
    lag_s: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    wall_s: float = 0.0
    requests: int = 0
    gen_cpu_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    max_connections: int = 0
    redis_calls: int | None = None  # script calls Redis served (sidecar+redis only)

    def add(
        self,
        gen: OpenLoop,
        wall: float,
        gen_cpu: float,
        meter: CpuMeter,
        redis_calls: int | None = None,
    ) -> None:
        """Pool one run: its requests, the generator's CPU, the metered processes' CPU and,
        where counted, Redis's script calls."""
        for i in range(gen.count):
            self.statuses[gen.status[i]] += 1
            if gen.status[i] == 200:
                self.latency_s.append(gen.done[i] - gen.sent[i])
            self.lag_s.append(gen.sent[i] - gen.sched[i])
        self.requests += gen.count
        self.wall_s += wall
        self.gen_cpu_s += gen_cpu
        self.max_connections = max(self.max_connections, gen.opened)
        for name, cpu in meter.delta.items():
            self.cpu_s[name] += cpu
        self.cpu_s["machine"] += meter.system_s
        if redis_calls is not None:
            self.redis_calls = (self.redis_calls or 0) + redis_calls


def open_loop(
    port: int, request: bytes, rate: float, seconds: float
) -> tuple[OpenLoop, float, float]:
    """One open-loop run; returns the generator, its wall time and its own CPU seconds."""
    gen = OpenLoop(port, request, rate, max(1, round(rate * seconds)))
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.monotonic()
    asyncio.run(gen.run())
    wall = time.monotonic() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return gen, wall, cpu


def summarise(way: str, s: Samples) -> dict[str, Any]:
    """The figures of one way at one rate, as reported."""
    metered = metered_of(way)
    server_cpu = sum(s.cpu_s[x] for x in metered)
    ok = len(s.latency_s)
    measured = sum(v for k, v in s.cpu_s.items() if k != "machine")
    others = s.cpu_s["machine"] - measured - s.gen_cpu_s
    return {
        "requests": s.requests,
        "ok": ok,
        "statuses": {str(k): v for k, v in s.statuses.items()},
        "achieved_rate": s.requests / s.wall_s if s.wall_s else 0.0,
        "p50_ms": percentile_scaled(s.latency_s, 50, 1e3),
        "p90_ms": percentile_scaled(s.latency_s, 90, 1e3),
        "p99_ms": percentile_scaled(s.latency_s, 99, 1e3),
        "max_ms": 1e3 * max(s.latency_s, default=float("nan")),
        "lag_p50_ms": percentile_scaled(s.lag_s, 50, 1e3),
        "lag_p99_ms": percentile_scaled(s.lag_s, 99, 1e3),
        "lag_max_ms": 1e3 * max(s.lag_s, default=float("nan")),
        "generator_cores": s.gen_cpu_s / s.wall_s if s.wall_s else 0.0,
        "connections": s.max_connections,
        "envoy_cpu_us": 1e6 * s.cpu_s["envoy"] / max(1, s.requests),
        "server_cpu_us": (1e6 * server_cpu / max(1, s.requests)) if metered else None,
        "server_cores": (server_cpu / s.wall_s) if metered else None,
        "redis_cpu_us": (1e6 * s.cpu_s[REDIS] / max(1, s.requests) if REDIS in metered else None),
        "redis_calls_per_request": (
            s.redis_calls / max(1, s.requests) if s.redis_calls is not None else None
        ),
        "other_cores": max(0.0, others) / s.wall_s if s.wall_s else 0.0,
    }


def open_loop_runs(
    bench: Bench,
    ports: dict[str, int],
    requests: dict[str, bytes],
    pids: dict[str, int],
    rates: Sequence[int],
    seconds: float,
    rounds: int,
    redis_calls: Callable[[], int] | None = None,
) -> dict[str, dict[str, Any]]:
    """Every way at every rate, ``seconds`` per way and rate split over ``rounds`` whose order
    of ways alternates; {rate: {way: figures}}. ``redis_calls``: Redis's script calls so far,
    read around each run of sidecar+redis."""
    out: dict[str, dict[str, Any]] = {}
    per_round = seconds / rounds
    for rate in rates:
        samples = {w: Samples() for w in WAYS}
        for k in range(rounds):
            order = WAYS if k % 2 == 0 else tuple(reversed(WAYS))
            for w in order:
                log(f"open loop: {rate} req/s, {w}, round {k + 1}/{rounds}")
                count = redis_calls if w == SIDECAR_REDIS else None
                calls0 = count() if count is not None else 0
                with CpuMeter(pids) as m:
                    gen, wall, gen_cpu = open_loop(ports[w], requests[w], rate, per_round)
                calls = count() - calls0 if count is not None else None
                bench.check_alive()
                samples[w].add(gen, wall, gen_cpu, m, calls)
                time.sleep(0.2)
        out[str(rate)] = {w: summarise(w, samples[w]) for w in WAYS}
    return out
