"""Prometheus metrics, recorded in one place: ``Metrics.finish`` when a request's stream ends.

Label values come from bounded sets only: bucket names from the policy (plus ``none``),
outcome labels from ``extproc.outcome.OUTCOMES``, max_tokens actions. Never anything a client sends.

Gauges of the queues (depth, in flight, capacity) are not updated on the request path at all:
a custom collector reads ``Gate.statistics()`` when Prometheus scrapes. Every server instance
has its own ``CollectorRegistry``, so tests can run several side by side.

The registry also holds ``llm_extproc_build_info`` (value 1; labels version, python, transport,
event_loop: what runs) and prometheus_client's process, platform and GC collectors
(``process_*``: CPU, resident memory, open files; ``python_info``; ``python_gc_*``), read at
scrape time like the gauges.

The metrics endpoint is a tiny asyncio HTTP server on the sidecar's own event loop, so a scrape
reads the admission state on the thread that changes it (no locks, no torn reads). It also
answers the probes: ``/healthz`` (liveness: 200 whenever the loop answers) and ``/readyz``
(readiness: 200 while the sidecar serves ext_proc with its policy loaded, 503 from the moment
it starts to stop, as its gRPC health service turns NOT_SERVING).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import platform
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from extproc import version
from extproc.config.policy import BucketPolicy
from extproc.loops import LOOPS
from extproc.outcome import OUTCOMES, Outcome
from extproc.pool.control.adaptive import AdaptiveSnapshot
from extproc.pool.control.overload import OverloadSnapshot
from extproc.pool.control.poller import BackendSnapshot
from extproc.pool.core.tenants import HEADER_MIN_REQUESTS, HEADER_WINDOW_S
from extproc.pool.core.values import BucketStats, PoolStats
from extproc.pool.shared.adapter import SharedSnapshot
from extproc.pool.view import gauges_of
from extproc.record import NO_BUCKET, RequestRecord

__all__ = ["Metrics", "serve_metrics"]

# The *_created series double the output and tell an operator nothing here.
disable_created_metrics()  # type: ignore[no-untyped-call]

_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_HOLD_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# How a relegated request ends (series created at zero); one whose client left is not counted.
_RELEGATED_ENDS = (Outcome.ADMITTED, Outcome.EVICTED_TIMEOUT, Outcome.EXPIRED_CLIENT_DEADLINE)
_TOKEN_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


# bucket -> its heaviest tenants and their backlog in weighted tokens (tenant.export_top).
Heaviest = Callable[[], dict[str, list[tuple[str | None, float]]]]


class _QueueCollector(Collector):
    def __init__(
        self, stats: Callable[[], dict[str, BucketStats]], heaviest: Heaviest | None = None
    ) -> None:
        self._stats = stats
        self._heaviest = heaviest

    def collect(self) -> Iterator[Metric]:
        families = {
            "queue_depth": GaugeMetricFamily(
                "llm_extproc_queue_depth", "Requests waiting for a slot.", labels=["bucket"]
            ),
            "in_flight": GaugeMetricFamily(
                "llm_extproc_in_flight", "Requests holding a slot.", labels=["bucket"]
            ),
            "capacity": GaugeMetricFamily(
                "llm_extproc_capacity",
                "Slots the bucket may hold now (its max_concurrency, or its cap in the pool).",
                labels=["bucket"],
            ),
            "max_queue": GaugeMetricFamily(
                "llm_extproc_queue_limit",
                "Longest queue (max_queue) of the bucket.",
                labels=["bucket"],
            ),
            "queued_bytes": GaugeMetricFamily(
                "llm_extproc_queued_bytes",
                "Bytes of request bodies held by the bucket's queued requests.",
                labels=["bucket"],
            ),
            "tenants": GaugeMetricFamily(
                "llm_extproc_tenants",
                "Tenants the bucket's fair order remembers (at most its tenant.max_tracked).",
                labels=["bucket"],
            ),
        }
        for name, s in self._stats().items():
            families["queue_depth"].add_metric([name], s.queued)
            families["in_flight"].add_metric([name], s.in_flight)
            families["capacity"].add_metric([name], s.capacity)
            families["max_queue"].add_metric([name], s.max_queue)
            families["queued_bytes"].add_metric([name], s.queued_bytes)
            families["tenants"].add_metric([name], s.tenants)
        yield from families.values()
        heaviest = self._heaviest() if self._heaviest is not None else None
        if heaviest:
            backlog = GaugeMetricFamily(
                "llm_extproc_tenant_backlog_tokens",
                "Weighted tokens the tenant has queued ahead of the bucket's virtual time, for "
                "the heaviest tenants only (opt-in: tenant.export_top; 'anonymous': no key).",
                labels=["bucket", "tenant"],
            )
            for bucket, tenants in heaviest.items():
                for tenant, tokens in tenants:
                    backlog.add_metric([bucket, tenant or "anonymous"], tokens)
            yield backlog


# The pool's gauges: name -> help, from the fields of the snapshots the pool controller renders
# at scrape time (``extproc.pool.control.wiring.PoolControl.gauges``; ``extproc.pool.view``).
# A name it does not report is left out.
POOL_GAUGES: dict[str, str] = {
    g.name: g.help
    for snapshot in (
        PoolStats,
        OverloadSnapshot,
        BackendSnapshot,
        AdaptiveSnapshot,
        SharedSnapshot,
    )
    for g in gauges_of(snapshot)
}


class _PoolCollector(Collector):
    def __init__(self, gauges: Callable[[], dict[str, float]]) -> None:
        self._gauges = gauges

    def collect(self) -> Iterator[Metric]:
        for name, value in self._gauges().items():
            g = GaugeMetricFamily(f"llm_extproc_{name}", POOL_GAUGES[name])
            g.add_metric([], value)
            yield g


class _Children(NamedTuple):
    requests: Counter
    queue_wait: Histogram
    slot_hold: Histogram
    prompt_tokens: Histogram
    max_tokens: Histogram


class Metrics:
    """Every metric of one sidecar, in its own registry. ``transport`` and ``event_loop`` are
    what ``llm_extproc_build_info`` says runs (``extproc.app.Sidecar`` names them)."""

    def __init__(
        self,
        stats: Callable[[], dict[str, BucketStats]],
        pool_gauges: Callable[[], dict[str, float]] | None = None,
        heaviest: Heaviest | None = None,
        *,
        transport: str = "",
        event_loop: str = "",
    ) -> None:
        r = self.registry = CollectorRegistry()
        # The process's own (process_*, python_info, python_gc_*): the collectors
        # prometheus_client puts in its global registry, which this project never uses.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.build_info = Gauge(
            "llm_extproc_build_info",
            "The sidecar that runs (always 1): its version, Python's, its gRPC transport "
            "(h2; grpc only in the tests' grpc.aio oracle) and event loop.",
            ["version", "python", "transport", "event_loop"],
            registry=r,
        )
        self.build_info.labels(version(), platform.python_version(), transport, event_loop).set(1)
        r.register(_QueueCollector(stats, heaviest))
        if pool_gauges is not None:
            r.register(_PoolCollector(pool_gauges))
        self.overload_transitions = Counter(
            "llm_extproc_overload_transitions",
            "Overload state changes of the shared pool, by the state entered.",
            ["state"],
            registry=r,
        )
        self.backend_scrape_errors = Counter(
            "llm_extproc_backend_scrape_errors",
            "Backend metrics endpoints that could not be scraped (one per endpoint and round).",
            registry=r,
        )
        self.adaptive_changes = Counter(
            "llm_extproc_adaptive_limit_changes",
            "Changes of the pool's adaptive limit, by reason.",
            ["reason"],
            registry=r,
        )
        self.shared_degraded = Counter(
            "llm_extproc_shared_degraded_transitions",
            "Times the shared pool went degraded (Redis unreachable: its leases, then none).",
            registry=r,
        )
        self.shared_redis_errors = Counter(
            "llm_extproc_shared_redis_errors",
            "Errors of the shared pool's Redis side, by call: acquire, return, renew (failed, "
            "timed out, or a reply refused), events (the subscription lost, or a message "
            "refused), demand (another replica's demand table refused, counted as none), policy "
            "(a renewal saw another policy's limits on this pool's key_prefix).",
            ["call"],
            registry=r,
        )
        self.loop_errors = Counter(
            "llm_extproc_loop_errors",
            "Rounds of a background loop that raised (the loop goes on), or a loop that ended, "
            "by loop.",
            ["loop"],
            registry=r,
        )
        for loop in LOOPS:
            self.loop_errors.labels(loop)
        # Set by the pool's controller on its tick (extproc.pool.control.headers), one series per
        # bucket whose tenant is a trusted header's value (none for the others).
        self.tenant_header_missing = Gauge(
            "llm_extproc_tenant_header_missing",
            "1 while a bucket whose tenant is a trusted header's value sees only requests "
            f"without it (at least {HEADER_MIN_REQUESTS} in {HEADER_WINDOW_S:.0f} s, none with "
            "it since): all one anonymous tenant. The filter that sets it runs before the "
            "strip of trusted_headers, or nothing sets it.",
            ["bucket"],
            registry=r,
        )
        self.requests = Counter(
            "llm_extproc_requests",
            "LLM requests finished, by bucket and outcome.",
            ["bucket", "outcome"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "llm_extproc_queue_wait_seconds",
            "Time from arrival of the body to admission or refusal, by bucket and outcome.",
            ["bucket", "outcome"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.slot_hold = Histogram(
            "llm_extproc_slot_hold_seconds",
            "Time an admitted request held its slot (until the last byte of the response).",
            ["bucket"],
            buckets=_HOLD_BUCKETS,
            registry=r,
        )
        self.abandoned = Counter(
            "llm_extproc_abandoned",
            "Admitted requests whose stream ended at or after their deadline (the client's "
            "stated timeout, or the route's): answers their client had given up on.",
            ["bucket"],
            registry=r,
        )
        self.prompt_tokens = Histogram(
            "llm_extproc_prompt_tokens",
            "Estimated prompt tokens of classified requests.",
            ["bucket"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.max_tokens = Histogram(
            "llm_extproc_max_tokens",
            "Effective max_tokens of classified requests.",
            ["bucket"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.max_tokens_adjusted = Counter(
            "llm_extproc_max_tokens_adjusted",
            "Requests whose max_tokens the sidecar set (defaulted) or lowered (clamped).",
            ["bucket", "action"],
            registry=r,
        )
        self.shadow = Counter(
            "llm_extproc_shadow_outcomes",
            "Shadow mode: what enforcement would have done to requests that were admitted.",
            ["bucket", "outcome"],
            registry=r,
        )
        self.policy_reloads = Counter(
            "llm_extproc_policy_reloads",
            "Policy file reloads, by result (ok, error).",
            ["result"],
            registry=r,
        )
        self._children: dict[tuple[str, str], _Children] = {}
        self.route_policy_errors = Counter(
            "llm_extproc_route_policy_errors",
            "Route metadata overrides refused (the file's policy applied instead).",
            registry=r,
        )
        self.relegated = Counter(
            "llm_extproc_relegated",
            "Requests that waited past their bucket's queue_timeout and were moved into the "
            "bucket it relegates to, by the bucket they left and how they ended there.",
            ["bucket", "outcome"],
            registry=r,
        )
        self.client_deadline_invalid = Counter(
            "llm_extproc_client_deadline_invalid",
            "Deadline headers ignored: not a number >= 0 (negative, NaN, text).",
            registry=r,
        )

    def declare(self, buckets: Iterable[BucketPolicy]) -> None:
        """Create the outcome, relegation, abandoned and reload series at zero, so that rates
        and increase() see the first eviction or reload error instead of a series that
        appears at 1."""
        for bucket in (*buckets, None):
            name = NO_BUCKET if bucket is None else bucket.name
            for info in OUTCOMES.values():
                self.requests.labels(name, info.label)
            if bucket is not None:
                self.abandoned.labels(name)
            if bucket is not None and bucket.relegate_to is not None:
                for outcome in _RELEGATED_ENDS:
                    self.relegated.labels(name, OUTCOMES[outcome].label)
        for result in ("ok", "error"):
            self.policy_reloads.labels(result)

    def finish(self, rec: RequestRecord) -> None:
        """Record one finished request. Called exactly once per request, by the server."""
        assert rec.outcome is not None
        bucket, outcome = rec.bucket, OUTCOMES[rec.outcome].label
        children = self._children.get((bucket, outcome))
        if children is None:  # resolve the labelled series once per (bucket, outcome)
            children = self._children[(bucket, outcome)] = _Children(
                self.requests.labels(bucket, outcome),
                self.queue_wait.labels(bucket, outcome),
                self.slot_hold.labels(bucket),
                self.prompt_tokens.labels(bucket),
                self.max_tokens.labels(bucket),
            )
        children.requests.inc()
        children.queue_wait.observe(rec.queue_s)
        hold = rec.hold_s
        if hold is not None:
            children.slot_hold.observe(hold)
        if rec.prompt_tokens is not None:
            children.prompt_tokens.observe(rec.prompt_tokens)
        if rec.max_tokens is not None:
            children.max_tokens.observe(rec.max_tokens)
        if rec.max_tokens_action in ("defaulted", "clamped"):
            self.max_tokens_adjusted.labels(bucket, rec.max_tokens_action).inc()
        if rec.shadow_outcome is not None:
            self.shadow.labels(bucket, OUTCOMES[rec.shadow_outcome].label).inc()
        if rec.relegated_to is not None:
            self.relegated.labels(bucket, outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def serve_metrics(
    host: str,
    port: int,
    metrics: Metrics,
    debug: Callable[[], object],
    ready: Callable[[], bool] = lambda: True,
) -> asyncio.Server:
    """``GET /metrics`` (Prometheus text), ``GET /debug/queues`` (JSON), ``GET /healthz`` and
    ``GET /readyz`` (200, or 503 while ``ready()`` is false) over HTTP/1.0."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
                parts = head.split(b" ", 2)
                path = parts[1].decode("latin-1") if len(parts) > 1 else ""
                path = path.split("?", 1)[0]
                if path == "/metrics":
                    status, ctype, body = "200 OK", CONTENT_TYPE_LATEST, metrics.render()
                elif path == "/debug/queues":
                    status, ctype = "200 OK", "application/json"
                    body = json.dumps(debug(), indent=1).encode()
                elif path == "/healthz":  # the loop answers: the process is alive
                    status, ctype, body = "200 OK", "text/plain", b"ok\n"
                elif path == "/readyz":
                    status, ctype, body = (
                        ("200 OK", "text/plain", b"ready\n")
                        if ready()
                        else ("503 Service Unavailable", "text/plain", b"not ready\n")
                    )
                else:
                    status, ctype, body = "404 Not Found", "text/plain", b"not found\n"
                writer.write(
                    f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
            finally:
                writer.close()

    return await asyncio.start_server(handle, host, port)
