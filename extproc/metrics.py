"""Prometheus metrics, recorded in one place: ``Metrics.finish`` when a request's stream ends.

Gauges of the queues (depth, in flight, capacity) are not updated on the request path at all:
a custom collector reads ``Gate.statistics()`` when Prometheus scrapes. Every server instance
has its own ``CollectorRegistry``, so tests can run several side by side.

The metrics endpoint is a tiny asyncio HTTP server on the sidecar's own event loop, so a scrape
reads the admission state on the thread that changes it (no locks, no torn reads).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from extproc.admission import BucketStats
from extproc.errors import Outcome

__all__ = ["NO_BUCKET", "Metrics", "serve_metrics"]

# The *_created series double the output and tell an operator nothing here.
disable_created_metrics()  # type: ignore[no-untyped-call]

# Bucket label of requests refused before a bucket was chosen (bad input, prompt too long).
NO_BUCKET = "none"

_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOKEN_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class _QueueCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, BucketStats]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            "llm_extproc_queue_depth", "Requests waiting for a slot.", labels=["bucket"]
        )
        in_flight = GaugeMetricFamily(
            "llm_extproc_in_flight", "Requests holding a slot.", labels=["bucket"]
        )
        capacity = GaugeMetricFamily(
            "llm_extproc_capacity", "Slots (max_concurrency) of the bucket.", labels=["bucket"]
        )
        for name, s in self._stats().items():
            depth.add_metric([name], s.queued)
            in_flight.add_metric([name], s.in_flight)
            capacity.add_metric([name], s.capacity)
        yield depth
        yield in_flight
        yield capacity


class Metrics:
    def __init__(self, stats: Callable[[], dict[str, BucketStats]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_QueueCollector(stats))
        self.requests = Counter(
            "llm_extproc_requests",
            "LLM requests finished, by bucket and outcome.",
            ["bucket", "outcome"],
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "llm_extproc_queue_wait_seconds",
            "Time from arrival of the body to admission or refusal, by bucket and outcome.",
            ["bucket", "outcome"],
            buckets=_WAIT_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Histogram(
            "llm_extproc_prompt_tokens",
            "Estimated prompt tokens of parsed requests.",
            buckets=_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.max_tokens_actions = Counter(
            "llm_extproc_max_tokens",
            "max_tokens decisions: kept, defaulted or clamped.",
            ["action"],
            registry=self.registry,
        )
        # Children resolved once, so the request path does no label lookups.
        self._children: dict[tuple[str, str], tuple[Counter, Histogram]] = {}

    def finish(self, bucket: str, outcome: Outcome, wait_s: float) -> None:
        key = (bucket, outcome)
        pair = self._children.get(key)
        if pair is None:
            pair = (self.requests.labels(*key), self.queue_wait.labels(*key))
            self._children[key] = pair
        pair[0].inc()
        pair[1].observe(wait_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def serve_metrics(
    host: str, port: int, metrics: Metrics, debug: Callable[[], object]
) -> asyncio.Server:
    """``GET /metrics`` (Prometheus text) and ``GET /debug/queues`` (JSON) over HTTP/1.0."""

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
