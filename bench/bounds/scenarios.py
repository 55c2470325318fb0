"""The scenarios ``bench.bounds`` times, one group of the end-to-end or shared-pool tests
each: each takes its running stack (or, for a group without a stack, a folder) and returns the
figures, in seconds, of the bounds its group holds (``bench.bounds.BOUNDS``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.common.stats import percentile
from extproc.transport.h2.frames import PREFACE
from testing.clients import Reply, SlowClient, chat, honest_load, post, slow_stream
from testing.envoy import cluster_named, hcm_config, render_envoy_config, with_route_metadata
from testing.harness import (
    gauge,
    holder_and_queue,
    until_in_flight,
    until_queued,
)
from testing.leases import leases_in_redis, replica
from testing.redis import RedisServer
from testing.stack import Stack, free_port, running_envoy
from testing.wait import until_async

Figures = dict[str, float]
Held = tuple[asyncio.Future[Reply], list[asyncio.Future[Reply]]]  # holder_and_queue's
INTERACTIVE = {"x-llm-class": "interactive"}
CHAT = "/v1/chat/completions"


def _status(r: Reply, want: int, what: str) -> None:
    if r.status != want:
        raise RuntimeError(f"{what}: {r.status} instead of {want}: {r.body[:200]!r}")


# --- queue: one interactive slot, a queue of two (tests/e2e/test_e2e.py) -----------------------

QUEUE_POLICY = """
limits: {max_prompt_tokens: 500, default_max_tokens: 50, max_output_tokens: 100}
buckets:
  - {name: interactive, match: {headers: {x-llm-class: interactive}}, max_concurrency: 1,
     queue_timeout: 1500ms, max_queue: 2}
  - {name: batch, max_concurrency: 4, queue_timeout: 3s, max_queue: 300}
"""


async def queue_group(stack: Stack) -> Figures:
    out: Figures = {}
    url = stack.url + CHAT
    async with aiohttp.ClientSession() as s:

        def hold_slot(hold: dict[str, str], queue: int = 0) -> Awaitable[Held]:
            return holder_and_queue(
                stack, s, url, bucket="interactive", hold=hold, queue=queue, headers=INTERACTIVE
            )

        headers = {"content-type": "application/json", **INTERACTIVE, **slow_stream(4, 250)}
        async with s.post(url, data=chat(stream=True), headers=headers) as resp:
            await resp.read()
        ended = time.monotonic()
        await until_in_flight(stack, "interactive", 0)
        out["slot_freed_after_stream"] = time.monotonic() - ended

        holder, _ = await hold_slot(slow_stream(6, 500))
        r = await post(s, url, chat(), INTERACTIVE)
        _status(r, 429, "queue timeout")
        out["queue_timeout_eviction"] = r.elapsed
        await holder

        holder, waiting = await hold_slot(slow_stream(3, 300), queue=2)
        r = await post(s, url, chat(), INTERACTIVE)
        _status(r, 429, "queue full")
        out["queue_full_refusal"] = r.elapsed
        await asyncio.gather(holder, *waiting)

        holder, (leaver, stayer) = await hold_slot(slow_stream(4, 250), queue=2)
        leaver.cancel()
        left = time.monotonic()
        await until_queued(stack, "interactive", 1)
        out["leaver_dropped"] = time.monotonic() - left
        await holder
        r = await stayer
        _status(r, 200, "stayer")
        out["stayer_moves_up"] = int(r.echo["headers"]["x-llm-queue-ms"]) / 1000
    return out


# --- pool: two slots shared by three buckets (tests/e2e/test_pool_through_envoy.py) -------------

POOL_POLICY = """
pool: {max_concurrency: 2}
client_deadline: {headers: [x-envoy-expected-rq-timeout-ms, x-request-deadline-ms]}
buckets:
  - {name: interactive, match: {headers: {x-llm-class: interactive}}, priority: 0,
     queue_timeout: 3s, max_queue: 10}
  - {name: batch, priority: 10, vllm_priority: 5, queue_timeout: 3s, max_queue: 10}
"""


async def pool_group(stack: Stack) -> Figures:
    out: Figures = {}
    url = stack.url + CHAT
    async with aiohttp.ClientSession() as s:

        def hold_both() -> list[asyncio.Future[Any]]:
            hold = slow_stream(5, 300)
            return [asyncio.ensure_future(post(s, url, chat(stream=True), hold)) for _ in "12"]

        held = hold_both()
        await until_in_flight(stack, "batch", 2)
        r = await post(s, url, chat(), {"x-request-deadline-ms": "1200"})
        _status(r, 429, "client deadline")
        out["client_deadline"] = r.elapsed
        await asyncio.gather(*held)

        for _ in range(5):  # ten releases after ~0.3 s holds teach the pool its drain rate
            await asyncio.gather(
                *(post(s, url, chat(stream=True), slow_stream(1, 300)) for _ in "12")
            )
        held = hold_both()
        await until_in_flight(stack, "batch", 2)
        waiting = [asyncio.ensure_future(post(s, url, chat())) for _ in range(8)]
        await until_queued(stack, "batch", 8)
        r = await post(s, url, chat(), {"x-request-deadline-ms": "1000"})
        _status(r, 429, "wait too long")
        out["wait_too_long_refusal"] = r.elapsed
        await asyncio.gather(*held, *waiting)
    return out


# --- reload: route metadata over file-based RDS (tests/e2e/test_reload.py) -----------------------

RELOAD_POLICY = """
limits: {max_prompt_tokens: 1000, default_max_tokens: 20, max_output_tokens: 50}
buckets: [{name: b, max_concurrency: 4, queue_timeout: 5s, max_queue: 100}]
"""


async def reload_group(stack: Stack) -> Figures:
    out: Figures = {}
    base = yaml.safe_load(stack.routes_path.read_text())
    stat = "http.llm.rds.llm.update_success"

    async def share(override: dict[str, Any]) -> None:
        before = stack.envoy_stat(stat)
        stack.write_routes(with_route_metadata(base, CHAT, {"bucket": "b", **override}))
        await until_async(lambda: stack.envoy_stat(stat) > before, "routes applied", blocking=True)

    async with aiohttp.ClientSession() as s:
        url, delay = stack.url + CHAT, {"x-test-delay-ms": "1500"}
        await share({"max_concurrency": 1, "queue_timeout": "400ms"})
        holder = asyncio.ensure_future(post(s, url, chat(), delay))
        await until_in_flight(stack, "b", 1)
        r = await post(s, url, chat())
        _status(r, 429, "route share eviction")
        out["route_share_eviction"] = r.elapsed
        r = await post(s, stack.url + "/v1/completions", json.dumps({"prompt": "hi"}).encode())
        out["other_route_during_share"] = r.elapsed
        await holder
        await share({"max_concurrency": 3, "queue_timeout": "3s"})
        holder = asyncio.ensure_future(post(s, url, chat(), delay))
        await until_in_flight(stack, "b", 1)
        out["free_share_slot"] = (await post(s, url, chat())).elapsed
        await holder
    return out


# --- shutdown, restart: the sidecar signalled, killed (test_failure.py, test_faults.py) ---------

ONE_SLOT = "buckets: [{name: one, max_concurrency: 1, queue_timeout: 10s, max_queue: 5}]"
FAULTS_POLICY = """
buckets:
  - {name: interactive, match: {headers: {x-llm-class: interactive}}, max_concurrency: 4,
     queue_timeout: 500ms, max_queue: 20}
  - {name: batch, max_concurrency: 8, queue_timeout: 2s, max_queue: 200}
"""


async def shutdown_group(stack: Stack) -> Figures:
    sidecar = stack.procs["sidecar"]
    async with aiohttp.ClientSession() as s:
        url = stack.url + CHAT
        holder = asyncio.ensure_future(post(s, url, chat(), {"x-test-delay-ms": "1500"}))
        await until_in_flight(stack, "one", 1)
        waiter = asyncio.ensure_future(post(s, url, chat()))
        await until_queued(stack, "one", 1)
        signalled = time.monotonic()
        sidecar.popen.send_signal(signal.SIGTERM)
        r = await waiter
        _status(r, 503, "queued at SIGTERM")
        refused = r.sent_at + r.elapsed - signalled
        await holder
        await asyncio.to_thread(sidecar.popen.wait, 10)
    return {"sigterm_refuses_queued": refused, "sigterm_exit": time.monotonic() - signalled}


async def restart_group(stack: Stack) -> Figures:
    statuses: list[int] = []
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as s:

        async def load() -> None:
            while not stop.is_set():
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    r = await post(s, stack.url + CHAT, chat(stream=True), slow_stream(3, 20))
                    statuses.append(r.status)

        workers = [asyncio.ensure_future(load()) for _ in range(3)]
        try:
            await until_async(lambda: statuses.count(200) >= 3, "the load served")
            stack.procs["sidecar"].kill(signal.SIGKILL)
            await asyncio.to_thread(stack.procs["sidecar"].popen.wait, 5)
            killed = len(statuses)
            await until_async(lambda: 500 in statuses[killed:], "a 500 while it is down")
            await asyncio.to_thread(stack.start_sidecar_proc)
            ready, down = time.monotonic(), len(statuses)
            await until_async(lambda: 200 in statuses[down:], "a 200 after the restart")
            return {"sidecar_restart_recovery": time.monotonic() - ready}
        finally:
            stop.set()
            await asyncio.gather(*workers)


# --- stall, timers: a body that never ends; Envoy's own timers (corpus, envoy_answers) ----------


async def raw(port: int, data: bytes) -> tuple[int, float]:
    """Raw bytes to Envoy's listener: the status it answers and the seconds it took."""
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        answer = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    return int(answer.split()[1]), time.monotonic() - t0


async def stall_group(stack: Stack) -> Figures:
    _, writer = await asyncio.open_connection("127.0.0.1", stack.listener_port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b'transfer-encoding: chunked\r\n\r\n5\r\n{"mes\r\n'
    )
    await writer.drain()
    try:
        async with aiohttp.ClientSession() as s:
            t0 = time.monotonic()
            for _ in range(5):
                body = b'{"prompt": "x", "max_tokens": 1}'
                _status(await post(s, stack.url + "/v1/completions", body), 200, "probe")
            return {"stalled_upload_bystanders": time.monotonic() - t0}
    finally:
        writer.close()


def timers(cfg: dict[str, Any]) -> None:
    """Envoy's timers cut to what a run can wait for: request 2 s, headers 1 s, LLM routes 2 s."""
    hcm = hcm_config(cfg)
    hcm["request_timeout"], hcm["request_headers_timeout"] = "2s", "1s"
    for vh in hcm["route_config"]["virtual_hosts"]:
        for route in vh["routes"]:
            if route["route"].get("timeout") == "600s":
                route["route"]["timeout"] = "2s"


async def timers_group(stack: Stack) -> Figures:
    out: Figures = {}
    url, port = stack.url + CHAT, stack.listener_port
    async with aiohttp.ClientSession() as s:
        stack.procs["sidecar"].kill(signal.SIGSTOP)
        try:
            r = await post(s, url, chat())
        finally:
            stack.procs["sidecar"].kill(signal.SIGCONT)
        _status(r, 504, "sidecar stopped")
        out["message_timeout_504"] = r.elapsed
        r = await post(s, url, chat(), {"x-test-delay-ms": "5000"})
        _status(r, 504, "backend too slow")
        out["backend_timeout_504"] = r.elapsed
        t0 = time.monotonic()
        with contextlib.suppress(aiohttp.ClientPayloadError):  # Envoy cuts the stream
            await post(s, url, chat(stream=True), slow_stream(20, 300))
        out["route_timeout_stream_cut"] = time.monotonic() - t0
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
    body_missing = head + b"content-type: application/json\r\ncontent-length: 100\r\n\r\n{"
    for name, data in (
        ("request_timeout_408", body_missing),
        ("request_headers_timeout_408", head),
    ):
        status, seconds = await raw(port, data)
        if status == 408:
            out[name] = seconds
    return out


# --- bodies, slow: large bodies; slow uploads (test_large_bodies.py, test_slow_clients.py) ------

BODIES_POLICY = "buckets: [{name: b, max_concurrency: 64, queue_timeout: 5s, max_queue: 100}]"
QUEUED_BYTES_POLICY = """
limits: {max_queued_bytes: 300000}
buckets: [{name: b, max_concurrency: 1, queue_timeout: 5s, max_queue: 100}]
"""
WORST = json.dumps(  # about 3.8 MB of tiny objects: half a second of CPU to parse
    {"messages": [{"role": "user", "content": "hi"}], "tools": [{"a": 1}] * 480_000},
    separators=(",", ":"),
).encode()
HONEST = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()


async def bodies_group(stack: Stack) -> Figures:
    url = stack.url + CHAT
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        for _ in range(20):
            await post(s, url, HONEST)  # warm: connections open, the interpreter warm
        _status(await post(s, url, chat("x" * 100_000)), 200, "warm-up")  # the body worker
        burst = [asyncio.ensure_future(post(s, url, WORST, limit_s=30)) for _ in range(10)]
        honest = []
        deadline = time.monotonic() + 30
        while not all(b.done() for b in burst) and time.monotonic() < deadline:
            honest.append((await post(s, url, HONEST)).elapsed)
            await asyncio.sleep(0.01)  # honest requests one after another, as in the test
        await asyncio.gather(*burst)
    p99 = percentile(honest, 99)
    return {} if p99 is None else {"worst_bodies_bystanders_p99": p99}


async def queued_bytes_group(stack: Stack) -> Figures:
    url, body = stack.url + CHAT, chat("x" * 100_000)
    async with aiohttp.ClientSession() as s:
        _status(await post(s, url, body), 200, "warm-up")  # the body worker started
        holder = asyncio.ensure_future(post(s, url, HONEST, {"x-test-delay-ms": "1500"}))
        await until_in_flight(stack, "b", 1)
        waiters: list[asyncio.Future[Any]] = []
        for i in range(1, 5):  # one after another: queued or refused, then the next
            waiters.append(asyncio.ensure_future(post(s, url, body)))
            await until_async(
                lambda i=i: (
                    gauge(stack, "llm_extproc_queue_depth", "b")  # type: ignore[misc]
                    + sum(w.done() for w in waiters)
                    == i
                ),
                f"waiter {i} queued or answered",
                blocking=True,
            )
        replies = await asyncio.gather(holder, *waiters)
    refused = [r.elapsed for r in replies if r.status == 429]
    return {"queued_bytes_refusal": max(refused)} if refused else {}


SLOW_POLICY = "buckets: [{name: all, max_concurrency: 16, queue_timeout: 5s, max_queue: 50}]"


def scale_down_breakers(cfg: dict[str, Any]) -> None:
    """The llm_extproc cluster's breakers at 100, so 300 slow clients would fill them."""
    limits = {"max_connections": 1024, "max_pending_requests": 100, "max_requests": 100}
    cluster_named(cfg, "llm_extproc")["circuit_breakers"] = {"thresholds": [limits]}


async def slow_group(stack: Stack) -> Figures:
    slow = [SlowClient(1000) for _ in range(300)]
    stop_slow, stop_honest = asyncio.Event(), asyncio.Event()
    tasks = [asyncio.ensure_future(c.run(stack.listener_port, stop_slow)) for c in slow]
    await asyncio.wait_for(asyncio.gather(*(c.trickling.wait() for c in slow)), 15)
    honest = asyncio.ensure_future(
        honest_load(stack.url + CHAT, HONEST, stop_honest, workers=8, pace_s=0.05)
    )
    await asyncio.sleep(8.0)  # the scenario: honest load while the slow ones trickle
    stop_honest.set()
    answers = await honest
    stop_slow.set()
    await asyncio.gather(*tasks)
    p99 = percentile([a.seconds for a in answers if a.status == 200], 99)
    return {} if p99 is None else {"slow_uploads_bystanders_p99": p99}


# --- leases: replicas of a shared pool on a real redis-server, no stack (test_leases.py) -------


async def leases_group(tmp: Path) -> Figures:
    """Leases of 1 s: a replica dies holding the whole pool (its leases left to expire, as a
    killed sidecar's are) while another waits; an adaptive pool's leader leaves."""
    out: Figures = {}
    for d in ("dead", "leader"):
        (tmp / d).mkdir(parents=True, exist_ok=True)
    with RedisServer(tmp / "dead") as server:
        (a, pa), (b, pb) = replica(server.url, "a", 3), replica(server.url, "b", 3)
        a.start()
        b.start()
        await until_async(lambda: a.ledger.connected and b.ledger.connected, "both reached Redis")
        pa.arrive(0, 3)
        await until_async(lambda: pa.running == 3, "a holds the pool")
        pb.arrive(0, 3)
        await a.close(give_back=False)
        died = time.monotonic()
        while pb.running < 3:  # bounded by run_group's wait_for
            if "dead_replica_leases_gone" not in out:
                _, leases = await leases_in_redis(server.url)
                if not any(lease.startswith("a:") for lease in leases):
                    out["dead_replica_leases_gone"] = time.monotonic() - died
            await asyncio.sleep(0.005)
        out["dead_replica_takeover"] = time.monotonic() - died
        await b.close()
    with RedisServer(tmp / "leader") as server:
        (x, _), (y, _) = (replica(server.url, n, 4, adaptive=True) for n in "xy")
        x.start()
        y.start()
        await until_async(
            lambda: x.ledger.leader == y.ledger.leader != "" and x.ledger.connected, "one leader"
        )
        leader, follower = (x, y) if x.ledger.is_leader else (y, x)
        await leader.close(give_back=False)
        left = time.monotonic()
        await until_async(lambda: follower.ledger.is_leader, "the other leads", every=0.005)
        out["leader_takeover"] = time.monotonic() - left
        await follower.close()
    return out


# --- lockout: 300 idle handshaken connections on the sidecar's port (test_idle_strangers.py) ---

LOCKOUT_POLICY = "buckets: [{name: all, max_concurrency: 4, queue_timeout: 2s, max_queue: 10}]"
EMPTY_SETTINGS, SETTINGS_ACK = (
    bytes.fromhex("000000040000000000"),
    bytes.fromhex("000000040100000000"),
)


def stranger(port: int) -> socket.socket:
    """A connection that completes the HTTP/2 handshake, then says nothing."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(PREFACE + EMPTY_SETTINGS + SETTINGS_ACK)
    got = b""
    with contextlib.suppress(OSError):  # closed at once: the server refused it
        while SETTINGS_ACK not in got and (chunk := sock.recv(4096)):  # the server's ACK
            got += chunk
    return sock


async def lockout_group(stack: Stack) -> Figures:
    """300 strangers held (the sidecar keeps 256), then a new connection's gRPC call (a
    health Check on a fresh grpc.aio channel), then a request through an Envoy started now."""
    out: Figures = {}
    strangers = [stranger(stack.extproc_port) for _ in range(300)]
    try:
        t0 = time.monotonic()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.extproc_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        out["new_call_beside_idle_strangers"] = time.monotonic() - t0
        port = free_port()
        text = render_envoy_config(
            listener_port=port,
            backend_port=stack.backend_port,
            extproc_port=stack.extproc_port,
            admin_port=free_port(),
        )
        with running_envoy(yaml.safe_load(text), stack.log_dir, port):
            async with aiohttp.ClientSession() as s:
                r = await post(s, f"http://127.0.0.1:{port}{CHAT}", chat())
        _status(r, 200, "through the Envoy started after the strangers")
        out["envoy_beside_idle_strangers"] = r.elapsed
    finally:
        for sock in strangers:
            sock.close()
    return out
