"""Queue memory and bursts: requests held behind one slot.

The held-queue sidecar's one bucket has one slot, taken by a direct gRPC stream (``Holder``);
then N requests go through Envoy (h2c, h2load) and queue behind it, paced or all at once.
Sidecar and Envoy RSS at rest and with all N held, Envoy's ext_proc counters, then the time to
drain the queue once the slot is freed. (The naive server holding as many streams from a direct
grpc.aio client was measured here too, removed later: 302 MB for 10,000 in docs/performance.md,
"The reference run".)
"""

from __future__ import annotations

import queue
import re
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.overhead.h2load import h2load_args, parse_h2load, run_h2load
from bench.overhead.meters import log, proc_rss_mb
from bench.overhead.procs import Bench
from bench.overhead.ways import CHAT_PATH, CLASS_HEADER, HELD

__all__ = ["Holder", "held_queue"]


def _headers_message(headers: list[tuple[str, str]]) -> Any:
    """A ``request_headers`` ProcessingRequest, as Envoy sends it."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers]
            )
        )
    )


def _body_message(body: bytes) -> Any:
    """A ``request_body`` ProcessingRequest carrying the whole (buffered) body."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))


class Holder:
    """One request admitted over a direct gRPC stream to a sidecar; it keeps the slot until
    ``release()`` half-closes the stream (as Envoy does at the end of the HTTP stream)."""

    def __init__(self, port: int, body: bytes) -> None:
        import grpc
        from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

        self._channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = pb_grpc.ExternalProcessorStub(self._channel)
        self._requests: queue.Queue[Any] = queue.Queue()
        self._responses = stub.Process(iter(self._requests.get, None), timeout=600)
        self._requests.put(
            _headers_message(
                [
                    (":method", "POST"),
                    (":path", CHAT_PATH),
                    (":authority", "bench"),
                    ("content-type", "application/json"),
                    CLASS_HEADER,
                ]
            )
        )
        first = next(self._responses)
        self._requests.put(_body_message(body))
        second = next(self._responses)
        kinds = (first.WhichOneof("response"), second.WhichOneof("response"))
        if kinds != ("request_headers", "request_body"):
            raise RuntimeError(f"the holder was not admitted: {first} {second}")

    def release(self) -> None:
        self._requests.put(None)
        for _ in self._responses:
            pass

    def close(self) -> None:
        self._requests.put(None)
        self._channel.close()


def _queued(bench: Bench) -> int:
    return int(bench.scrape(HELD).get('llm_extproc_queue_depth{bucket="held"}', 0.0))


def _outcomes(bench: Bench) -> Counter[str]:
    """Finished requests of the held sidecar by outcome, all buckets together."""
    out: Counter[str] = Counter()
    for k, v in bench.scrape(HELD).items():
        m = re.match(r'llm_extproc_requests_total\{.*outcome="([^"]+)"', k)
        if m:
            out[m.group(1)] += int(v)
    return out


_HELD_ENVOY_STATS = (
    "http.held.ext_proc.message_timeouts",
    "http.held.ext_proc.streams_failed",
    "http.held.ext_proc.streams_started",
    "cluster.held_extproc.upstream_cx_active",
    "cluster.held_extproc.upstream_rq_active",
    "cluster.held_extproc.upstream_rq_pending_overflow",
    "cluster.held_extproc.upstream_cx_overflow",
)
# Of those, the gauges (reported as they are; the counters as increments).
_GAUGES = ("upstream_cx_active", "upstream_rq_active")


def _envoy_held_stats(bench: Bench) -> dict[str, int]:
    stats = {
        **bench.envoy_stats("http.held.ext_proc."),
        **bench.envoy_stats("cluster.held_extproc."),
    }
    return {k.split(".", 2)[2]: stats.get(k, 0) for k in _HELD_ENVOY_STATS}


def _hold(
    bench: Bench, body_file: Path, body: bytes, n: int, rate: float | None, log_dir: Path
) -> dict[str, Any]:
    """Hold the held sidecar's only slot with a direct gRPC stream; send ``n`` requests through
    Envoy (h2c, 10 connections), at ``rate`` req/s or all at once (``rate`` None); once the
    queue is full (or stops growing) read RSS and Envoy's counters, free the slot, and time the
    drain."""
    pid, envoy_pid = bench.pid(HELD), bench.pid("envoy")
    clients = max(1, min(10, n // 100))
    streams = -(-n // clients)
    args = ["-c", str(clients), "-m", str(streams), "-n", str(n)]
    if rate is not None:
        args += ["--rps", f"{rate / clients:g}"]
    out_path = log_dir / f"h2load-held-{'burst' if rate is None else 'paced'}.txt"
    stats0, outcomes0 = _envoy_held_stats(bench), _outcomes(bench)
    holder = Holder(bench.ports.grpc[HELD], body)
    t0 = time.monotonic()
    with open(out_path, "w") as out:
        load = subprocess.Popen(
            h2load_args(bench.url(HELD), body_file, [CLASS_HEADER], *args, log=None),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = t0 + (n / rate + 60 if rate else 90)
        queued, last_change, last = 0, t0, -1
        while time.monotonic() < deadline and load.poll() is None:
            queued = _queued(bench)
            now = time.monotonic()
            if queued != last:
                last, last_change = queued, now
            if queued >= n or (rate is None and queued and now - last_change > 3.0):
                break
            time.sleep(0.1)
        fill_s = (last_change if rate is None else time.monotonic()) - t0
        held = {
            "queued": queued,
            "fill_s": fill_s,
            "sidecar_rss_mb": proc_rss_mb(pid),
            "envoy_rss_mb": proc_rss_mb(envoy_pid),
        }
        stats1 = _envoy_held_stats(bench)
        t_release = time.monotonic()
        holder.release()
        load.wait(timeout=300)
        drain_s = time.monotonic() - t_release
    finally:
        if load.poll() is None:
            load.kill()
            load.wait()
        holder.close()
    result = parse_h2load(out_path.read_text(), time.monotonic() - t0, 0.0, None)
    outcomes = _outcomes(bench)
    outcomes.subtract(outcomes0)
    return {
        "n": n,
        "rate": rate,
        "h2load": " ".join(args),
        **held,
        "envoy_while_held": {k: (v if k in _GAUGES else v - stats0[k]) for k, v in stats1.items()},
        "drain_s": drain_s,
        "answered_2xx": result.status_2xx,
        "answered_other": result.requests - result.status_2xx,
        "sidecar_outcomes": {k: v for k, v in outcomes.items() if v},
        "after": {"sidecar_rss_mb": proc_rss_mb(pid), "envoy_rss_mb": proc_rss_mb(envoy_pid)},
    }


def held_queue(
    bench: Bench,
    body_file: Path,
    body: bytes,
    n: int,
    rate: float,
    burst: int,
    log_dir: Path,
) -> dict[str, Any]:
    """The held-queue figures: ``n`` requests paced at ``rate`` into one bucket behind a held
    slot, then ``burst`` requests sent all at once (0: skip)."""
    # Warm the path (Envoy's gRPC connections to the sidecar, the sidecar's code) first.
    warm = run_h2load(
        h2load_args(bench.url(HELD), body_file, [CLASS_HEADER], "-c", "1", "-n", "200", log=None),
        None,
        60,
    )
    if warm.status_2xx != 200:
        raise RuntimeError(f"held sidecar warm-up failed:\n{warm.output}")
    pid, envoy_pid = bench.pid(HELD), bench.pid("envoy")
    out: dict[str, Any] = {
        "n": n,
        "rest": {"sidecar_rss_mb": proc_rss_mb(pid), "envoy_rss_mb": proc_rss_mb(envoy_pid)},
    }
    log(f"held queue: {n} requests at {rate:g} req/s behind one held slot")
    out["paced"] = _hold(bench, body_file, body, n, rate, log_dir)
    if burst:
        log(f"held queue: {burst} requests at once behind one held slot")
        out["burst"] = _hold(bench, body_file, body, burst, None, log_dir)
    return out
