"""The vLLM metrics scraper against real HTTP servers on 127.0.0.1: framing, failures, windows."""

from __future__ import annotations

import asyncio
import itertools
import random
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from extproc.backend.http import MAX_BODY_BYTES
from extproc.backend.scrape import (
    EndpointSample,
    Resolver,
    Scraper,
    histogram_quantile,
    parse_metrics,
)
from extproc.config.policy import AdaptivePolicy, BackendPolicy
from testing.wait import until_async

INF = float("inf")
# vLLM's bucket bounds (vllm/v1/metrics/loggers.py).
# fmt: off
TTFT_BOUNDS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BOUNDS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
              10.0, 20.0, 40.0, 80.0)
LATENCY_BOUNDS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                  60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# fmt: on
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def make_scraper(
    urls: Sequence[str],
    *,
    backend: BackendPolicy | None = None,
    adaptive: AdaptivePolicy | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    resolve: Resolver | None = None,
) -> Scraper:
    """A scraper of ``urls`` with the policy's settings (its defaults where not given)."""
    return Scraper.from_policy(
        replace(backend or BackendPolicy(), metrics=tuple(urls)),
        adaptive or AdaptivePolicy(),
        max_body_bytes=max_body_bytes,
        resolve=resolve,
    )


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 10))


# --- a vLLM page -------------------------------------------------------------------------------


@dataclass
class Engine:
    """One (model, engine) label set of a vLLM server. Histograms: observations per bucket
    (not cumulative), keyed by the bucket's upper bound."""

    model: str = MODEL
    engine: str = "0"
    waiting: int = 0
    running: int = 0
    kv: float = 0.0
    ttft: dict[float, int] = field(default_factory=dict)
    itl: dict[float, int] = field(default_factory=dict)
    tpot: dict[float, int] = field(default_factory=dict)
    queue: dict[float, int] = field(default_factory=dict)


def _le(bound: float) -> str:
    return "+Inf" if bound == INF else repr(float(bound))  # as prometheus_client writes it


def _histogram(name: str, doc: str, bounds: Sequence[float], engines: Sequence[Engine],
               per_bucket: Callable[[Engine], dict[float, int]]) -> list[str]:  # fmt: skip
    out = [f"# HELP {name} {doc}", f"# TYPE {name} histogram"]
    for e in engines:
        labels = f'engine="{e.engine}",model_name="{e.model}"'
        counts = per_bucket(e)
        total = 0
        for b in (*bounds, INF):
            total += counts.get(b, 0)
            out.append(f'{name}_bucket{{{labels},le="{_le(b)}"}} {float(total)}')
        out.append(f"{name}_count{{{labels}}} {float(total)}")
        out.append(f"{name}_sum{{{labels}}} {0.1 * total}")
    out += [f"# HELP {name}_created {doc}", f"# TYPE {name}_created gauge"]
    out += [f'{name}_created{{engine="{e.engine}",model_name="{e.model}"}} 1.7e9' for e in engines]
    return out


def vllm_page(*engines: Engine, old_names: bool = False, both_itl: bool = False) -> str:
    """A page in vLLM's format: process metrics first, then vLLM's families, including
    histograms we do not read (which make most of a real page)."""
    lines = [
        "# HELP python_gc_objects_collected_total Objects collected during gc",
        "# TYPE python_gc_objects_collected_total counter",
        'python_gc_objects_collected_total{generation="0"} 12345.0',
        "# HELP process_resident_memory_bytes Resident memory size in bytes.",
        "# TYPE process_resident_memory_bytes gauge",
        "process_resident_memory_bytes 2.1e+09",
    ]
    gauges = [
        ("vllm:num_requests_running", "Number of requests in model execution batches.", "running"),
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "waiting"),
        (
            "vllm:gpu_cache_usage_perc" if old_names else "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            "kv",
        ),
    ]
    for name, doc, attr in gauges:
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} gauge"]
        for e in engines:
            value = float(getattr(e, attr))
            lines.append(f'{name}{{engine="{e.engine}",model_name="{e.model}"}} {value}')
    lines += [
        "# HELP vllm:num_requests_waiting_by_reason Requests waiting, by reason.",
        "# TYPE vllm:num_requests_waiting_by_reason gauge",
        'vllm:num_requests_waiting_by_reason{reason="capacity"} 99.0',
        "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
        "# TYPE vllm:prompt_tokens_total counter",
        f'vllm:prompt_tokens_total{{engine="0",model_name="{MODEL}"}} 123456.0',
    ]
    lines += _histogram(
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        TTFT_BOUNDS,
        engines,
        lambda e: e.ttft,
    )
    itl_names = [
        "vllm:time_per_output_token_seconds" if old_names else "vllm:inter_token_latency_seconds"
    ]
    if both_itl:
        itl_names = ["vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"]
    for name in itl_names:
        lines += _histogram(name, "Histogram of inter-token latency.", ITL_BOUNDS, engines,
                            lambda e: e.itl)  # fmt: skip
    # Families we do not read, with observations that must not leak into ours.
    lines += _histogram("vllm:e2e_request_latency_seconds", "Latency.", LATENCY_BOUNDS, engines,
                        lambda e: {0.3: 1000})  # fmt: skip
    lines += _histogram("vllm:request_queue_time_seconds", "Queue time.", LATENCY_BOUNDS, engines,
                        lambda e: e.queue)  # fmt: skip
    lines += _histogram(
        "vllm:request_time_per_output_token_seconds", "TPOT.", ITL_BOUNDS, engines,
        lambda e: e.tpot,
    )  # fmt: skip
    return "\n".join(lines) + "\n"


# --- a metrics server --------------------------------------------------------------------------


class MetricsServer:
    """An asyncio HTTP/1.1 server with one page and a way of answering (``mode``):
    'length' (Content-Length), 'chunked', 'eof' (no length, close), 'never' (read the request,
    answer nothing), 'garbage', 'status' (503). ``events``, shared by several servers, gets
    ``"asked <port>"`` for each request and, in 'never' mode, ``"gave up <port>"`` when the
    client closes the connection: the order in which the scraper did things."""

    def __init__(
        self,
        page: str = "",
        mode: str = "length",
        host: str = "127.0.0.1",
        events: list[str] | None = None,
        chunk: int = 1000,
    ) -> None:
        self.page = page
        self.mode = mode
        self.host = host
        self.chunk = chunk
        self.port = 0
        self.requests: list[bytes] = []
        self.events = events if events is not None else []
        self._held: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> MetricsServer:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for writer in self._held:
            writer.close()
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            self.requests.append(await reader.readuntil(b"\r\n\r\n"))
            self.events.append(f"asked {self.port}")
            body = self.page.encode()
            if self.mode == "never":
                self._held.append(writer)
                await reader.read()  # b"" when the client closes
                self.events.append(f"gave up {self.port}")
                return
            if self.mode == "garbage":
                writer.write(b"\x16\x03\x01 not http at all\r\n\r\n")
            elif self.mode == "status":
                writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
            elif self.mode == "length":
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n")
                writer.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
            elif self.mode == "chunked":
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                for i in range(0, len(body), self.chunk):
                    chunk = body[i : i + self.chunk]
                    writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                writer.write(b"0\r\n\r\n")
            elif self.mode == "eof":
                writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + body)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client gave up first (an oversize body): fine
        writer.close()


def fixed(*addresses: tuple[str, int]) -> Callable[[str, int], Awaitable[list[tuple[str, int]]]]:
    """A resolver that answers every name with ``addresses`` (a headless Service's A records)."""

    async def resolve(host: str, port: int) -> list[tuple[str, int]]:
        return list(addresses)

    return resolve


# --- parsing and quantiles ---------------------------------------------------------------------


def test_parse_sums_label_sets_takes_kv_max_and_skips_other_families() -> None:
    page = vllm_page(
        Engine(engine="0", waiting=2, running=5, kv=0.25, ttft={0.1: 3, 0.5: 1}, itl={0.05: 7},
               tpot={0.01: 1000}),
        Engine(engine="1", waiting=1, running=4, kv=0.75, ttft={0.1: 2, INF: 1}, itl={0.05: 1},
               tpot={0.2: 5}),
    )  # fmt: skip
    s = parse_metrics(page)
    assert (s.waiting, s.running, s.kv_usage) == (3.0, 9.0, 0.75)
    assert list(s.histograms) == ["ttft", "itl", "tpot", "queue_time"]  # the table's order
    ttft, itl, tpot = s.histograms["ttft"], s.histograms["itl"], s.histograms["tpot"]
    assert len(ttft) == len(TTFT_BOUNDS) + 1
    assert (ttft[0.08], ttft[0.1], ttft[0.25], ttft[0.5], ttft[INF]) == (0, 5, 5, 6, 7)
    assert itl[0.05] == 8 and itl[INF] == 8  # request_time_per_output_token not mixed in
    # Each request's mean, a family of its own.
    assert (tpot[0.01], tpot[0.15], tpot[0.2], tpot[INF]) == (1000, 1000, 1005, 1005)
    assert s.histograms["queue_time"][INF] == 0  # exported, nothing observed


def test_parse_older_vllm_names_and_one_itl_when_both_are_exposed() -> None:
    old = parse_metrics(vllm_page(Engine(kv=0.5, itl={0.1: 4}), old_names=True))
    assert old.kv_usage == 0.5
    assert old.histograms["itl"][INF] == 4
    both = parse_metrics(vllm_page(Engine(itl={0.1: 4}), both_itl=True))
    assert both.histograms["itl"][INF] == 4  # not 8: the same observations


def test_parse_label_values_with_quotes_and_braces() -> None:
    page = (
        'vllm:time_to_first_token_seconds_bucket{model_name="a \\"b\\" {le=\\"9\\"}",le="0.5"}'
        " 3.0 1700000000000\r\n"
        'vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="x"} 4\n'
        "vllm:num_requests_waiting\t2\n"
    )
    s = parse_metrics(page)
    assert s.histograms == {"ttft": {0.5: 3.0, INF: 4.0}}
    assert s.waiting == 2.0


def test_parse_rejects_a_malformed_sample_of_a_wanted_family_only() -> None:
    assert parse_metrics("other_family{ garbage\nvllm:other !!\n") == EndpointSample()
    for bad in (
        "vllm:num_requests_waiting abc\n",
        'vllm:num_requests_waiting{engine="0"\n',
        "vllm:num_requests_waiting\n",
        "vllm:num_requests_waiting NaN\n",
        'vllm:time_to_first_token_seconds_bucket{engine="0"} 1\n',
    ):
        with pytest.raises(ValueError):
            parse_metrics(bad)


def test_parse_matches_what_prometheus_client_writes() -> None:
    """vLLM exposes its metrics with prometheus_client; read a page that library wrote."""
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    waiting = Gauge("vllm:num_requests_waiting", "w", labels, registry=registry)
    ttft = Histogram(
        "vllm:time_to_first_token_seconds", "t", labels, buckets=TTFT_BOUNDS, registry=registry
    )
    for engine in ("0", "1"):
        waiting.labels(MODEL, engine).set(3)
        for v in (0.003, 0.05, 0.2, 0.2, 30.0):
            ttft.labels(MODEL, engine).observe(v)
    s = parse_metrics(generate_latest(registry).decode())
    assert s.waiting == 6.0
    got = s.histograms["ttft"]
    assert (got[0.001], got[0.005], got[0.06], got[0.25], got[40.0]) == (
        0,
        2,
        4,
        8,
        10,
    )


@pytest.mark.parametrize("seed", range(20))
def test_a_quantile_compared_at_a_bucket_edge_is_exact(seed: int) -> None:
    """The interpolated quantile is above an objective that is a bucket's bound exactly when
    more than ``1 - q`` of the observations are above that bound: the comparison the limit
    makes is the fraction above the objective, with no interpolation error, whenever the
    objective is one of vLLM's bounds (100 ms for the inter-token buckets, 1 s for TTFT), but
    the largest finite one (80 s), where a rank in +Inf reads as that bound."""
    rng = random.Random(seed)
    bounds = [0.05, 0.075, 0.1, 0.15, 0.2, INF]
    counts = [float(rng.randrange(0, 30)) for _ in bounds]
    if seed == 0:  # exactly at the edge: 90 of 100 at or below 0.1
        counts = [30.0, 30.0, 30.0, 5.0, 5.0, 0.0]
    cumulative = dict(zip(bounds, itertools.accumulate(counts), strict=True))
    total = cumulative[INF]
    if total == 0:
        return
    for q in (0.5, 0.9, 0.95, 0.99):
        quantile = histogram_quantile(q, cumulative)
        assert quantile is not None
        for edge in bounds[:-2]:  # the largest finite bound caps a rank in +Inf (below)
            above = (total - cumulative[edge]) / total
            assert (quantile > edge) == (above > 1 - q + 1e-12), (q, edge, cumulative)


def test_histogram_quantile_matches_a_hand_computation() -> None:
    b = {0.1: 10.0, 0.5: 30.0, 1.0: 40.0, INF: 40.0}
    # rank 36 falls in (0.5, 1.0], 6 of its 10: 0.5 + 0.5 * 6/10
    assert histogram_quantile(0.9, b) == pytest.approx(0.8)
    # rank 20 falls in (0.1, 0.5], 10 of its 20: 0.1 + 0.4 * 10/20
    assert histogram_quantile(0.5, b) == pytest.approx(0.3)
    # rank 4 falls in the first bucket, which starts at 0: 0.1 * 4/10
    assert histogram_quantile(0.1, b) == pytest.approx(0.04)
    # rank 90 falls in +Inf: the largest finite bound
    assert histogram_quantile(0.9, {0.1: 10.0, 1.0: 20.0, INF: 100.0}) == 1.0
    assert histogram_quantile(0.9, {}) is None
    assert histogram_quantile(0.9, {0.1: 0.0, INF: 0.0}) is None
    assert histogram_quantile(0.9, {INF: 5.0}) is None
    # made monotonic first: {0.1: 10, 0.5: 10 (not 8), 1.0: 20}
    assert histogram_quantile(0.75, {0.1: 10.0, 0.5: 8.0, 1.0: 20.0, INF: 20.0}) == pytest.approx(
        0.75
    )


def test_urls_and_settings_are_checked() -> None:
    for url in ("https://a:8000/metrics", "ftp://a/x", "http:///metrics", "http://a:99999/"):
        with pytest.raises(ValueError):
            make_scraper([url])
    with pytest.raises(ValueError):
        make_scraper([])
    with pytest.raises(ValueError):
        make_scraper(["http://a:1/m"], adaptive=AdaptivePolicy(quantiles={"ttft": 1.0}))


def test_from_policy_takes_the_resolved_policy_settings() -> None:
    backend = BackendPolicy(metrics=("http://a:1/m", "http://b:2/m"), scrape_timeout_s=0.2)
    quantiles = {"ttft": 0.5, "itl": 0.99, "tpot": 0.8, "queue_time": 0.7}
    s = Scraper.from_policy(backend, AdaptivePolicy(window_s=7.0, quantiles=quantiles))
    assert (s.timeout_s, s.window_s, s.quantiles) == (0.2, 7.0, quantiles)
    # A quantile not given: its objective's default.
    assert make_scraper(["http://a:1/m"], adaptive=AdaptivePolicy(quantiles={})).quantiles == {
        "ttft": 0.9,
        "itl": 0.9,
        "tpot": 0.9,
        "queue_time": 0.9,
    }
    assert s.max_body_bytes == MAX_BODY_BYTES
    assert repr(s) == "<Scraper a:1, b:2, 0 endpoints known>"


# --- scraping ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["length", "chunked", "eof"])
def test_every_body_framing_is_read(mode: str) -> None:
    async def main() -> None:
        page = vllm_page(Engine(waiting=2, running=7, kv=0.4))
        assert len(page) > 1000  # several chunks
        async with MetricsServer(page, mode) as server:
            s = await make_scraper([server.url]).scrape(0.0)  # the default resolver
        assert (s.endpoints_ok, s.endpoints_failed, s.errors) == (1, 0, ())
        assert (s.waiting, s.running, s.kv_usage) == (2, 7, 0.4)
        head = server.requests[0].decode()
        assert head.startswith("GET /metrics HTTP/1.1\r\n")
        assert f"Host: 127.0.0.1:{server.port}\r\n" in head
        assert "Connection: close\r\n" in head

    run(main())


def test_an_aiohttp_server() -> None:
    async def main() -> None:
        page = vllm_page(Engine(waiting=1, running=3))

        async def metrics(request: web.Request) -> web.Response:
            return web.Response(text=page, content_type="text/plain")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            s = await make_scraper([f"http://127.0.0.1:{port}/metrics"]).scrape(0.0)
        finally:
            await runner.cleanup()
        assert (s.endpoints_ok, s.waiting, s.running) == (1, 1, 3)

    run(main())


def test_every_address_of_a_name_and_windowed_quantiles_over_all_of_them() -> None:
    async def main() -> None:
        a = Engine(waiting=1, running=10, kv=0.3, ttft={0.1: 100}, itl={0.05: 100})
        b = Engine(waiting=0, running=20, kv=0.6, ttft={0.1: 50}, itl={0.05: 50})
        async with MetricsServer(vllm_page(a)) as sa, MetricsServer(vllm_page(b)) as sb:
            resolve = fixed(("127.0.0.1", sa.port), ("127.0.0.1", sb.port))
            scraper = make_scraper(["http://pool.svc:8000/metrics"], resolve=resolve)
            first = await scraper.scrape(100.0)
            # The first sight of an endpoint is a baseline: its history is not recent.
            assert (first.endpoints_ok, first.waiting, first.running, first.kv_usage) == (
                2,
                1,
                30,
                0.6,
            )
            assert first.latency == dict.fromkeys(["ttft", "itl", "tpot", "queue_time"], (None, 0))
            # New observations: A 6 in (0.1, 0.25] and 2 in (0.25, 0.5]; B 2 in (0.25, 0.5].
            a.ttft = {0.1: 100, 0.25: 6, 0.5: 2}
            b.ttft = {0.1: 50, 0.5: 2}
            a.itl = {0.05: 100, 0.075: 10}
            b.tpot = {0.1: 20}
            a.queue = {0.3: 5, 0.5: 10}
            b.queue = {0.3: 15}
            sa.page, sb.page = vllm_page(a), vllm_page(b)
            second = await scraper.scrape(101.0)
        # Window: (0.1, 0.25] 6, (0.25, 0.5] 4; 10 in all. p90: rank 9 is the 3rd of the 4 in
        # (0.25, 0.5]: 0.25 + 0.25 * 3/4. ITL: 10 in (0.05, 0.075], rank 9: 0.05 + 0.025 * 0.9.
        latency = second.latency
        assert latency["ttft"] == (pytest.approx(0.25 + 0.25 * 3 / 4), 10)
        assert latency["itl"] == (pytest.approx(0.05 + 0.025 * 0.9), 10)
        # TPOT (B's 20 requests in (0.075, 0.1]), apart from the tokens' gaps.
        assert latency["tpot"] == (pytest.approx(0.075 + 0.025 * 0.9), 20)
        # vLLM's queue time, both endpoints: 20 in [0, 0.3], 10 in (0.3, 0.5]; p90 is rank 27,
        # the 7th of the 10 in (0.3, 0.5].
        assert latency["queue_time"] == (pytest.approx(0.3 + 0.2 * 7 / 10), 30)

    run(main())


def test_one_name_many_addresses_on_one_port() -> None:
    """A headless Service: the same port on each pod's address (127.0.0.1 and 127.0.0.2, both
    on Linux's loopback, which routes all of 127.0.0.0/8)."""

    async def main() -> None:
        async with MetricsServer(vllm_page(Engine(running=1))) as one:
            two = MetricsServer(vllm_page(Engine(running=2)), host="127.0.0.2")
            two.port = one.port
            async with two:

                async def resolve(host: str, port: int) -> list[tuple[str, int]]:
                    assert (host, port) == ("vllm.ns.svc.cluster.local", one.port)
                    return [("127.0.0.1", port), ("127.0.0.2", port), ("127.0.0.1", port)]

                url = f"http://vllm.ns.svc.cluster.local:{one.port}/metrics"
                s = await make_scraper([url], resolve=resolve).scrape(0.0)
        assert (s.endpoints_ok, s.running) == (2, 3)  # the repeated address is scraped once
        assert len(one.requests) == len(two.requests) == 1

    run(main())


def test_failing_endpoints_are_counted_never_raised() -> None:
    async def main() -> None:
        page = vllm_page(Engine(running=4))
        refused = socket.socket()
        refused.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        refused_port = refused.getsockname()[1]
        big = vllm_page(Engine()) * 20
        events: list[str] = []
        async with (
            MetricsServer(page, events=events) as good,
            MetricsServer(page, "never", events=events) as silent,
            MetricsServer(big, "length", events=events) as big_length,
            MetricsServer(big, "chunked", events=events) as big_chunked,
            MetricsServer(big, "eof", events=events) as big_eof,
            MetricsServer(page, "garbage", events=events) as garbage,
            MetricsServer(page, "status", events=events) as status,
            MetricsServer("<html>hello</html>", events=events) as html,
            MetricsServer('vllm:num_requests_running{x="1"} abc\n', events=events) as malformed,
        ):
            servers = (good, silent, big_length, big_chunked, big_eof, garbage, status, html)
            resolve = fixed(
                *(("127.0.0.1", s.port) for s in (*servers, malformed)),
                ("127.0.0.1", refused_port),
            )

            async def no_such_host(host: str, port: int) -> list[tuple[str, int]]:
                if host == "gone.svc":
                    raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
                return await resolve(host, port)

            scraper = make_scraper(
                ["http://pool.svc:1/metrics", "http://gone.svc:1/metrics"],
                backend=BackendPolicy(scrape_timeout_s=0.3),
                max_body_bytes=len(big) - 1,
                resolve=no_such_host,
            )
            s = await scraper.scrape(0.0)
            gave_up = f"gave up {silent.port}"
            await until_async(lambda: gave_up in events, "the silent endpoint's connection closed")
        refused.close()
        assert (s.endpoints_ok, s.endpoints_failed, s.running) == (1, 10, 4)
        # Concurrently, each under the timeout: every endpoint was asked before the scraper
        # gave up on the silent one (in turn, those after it would be asked only then).
        assert sorted(events[: events.index(gave_up)]) == sorted(
            f"asked {server.port}" for server in (*servers, malformed)
        )
        errors = "\n".join(s.errors)
        assert len(s.errors) == 8 and s.errors[-1] == "+3 more"  # capped for a log line
        assert "gone.svc: dns: no address (Name or service not known)" in errors
        assert not s.no_backend  # one host has addresses
        assert f"127.0.0.1:{silent.port}: timeout" in errors

    run(main())


@pytest.mark.parametrize(
    ("errno", "no_backend"),
    [(socket.EAI_NONAME, True), (None, True), (socket.EAI_AGAIN, False)],
)
def test_no_backend_only_when_every_host_names_no_address(
    errno: int | None, no_backend: bool
) -> None:
    """NXDOMAIN (or an empty answer) for every host: no backend exists. A failure to ask is
    no data, not an answer."""

    async def resolve(host: str, port: int) -> list[tuple[str, int]]:
        if errno is None:
            return []
        raise socket.gaierror(errno, "dns said so")

    async def main() -> None:
        s = await make_scraper(
            ["http://a.svc:1/metrics", "http://b.svc:1/metrics"], resolve=resolve
        ).scrape(0.0)
        assert (s.endpoints_ok, s.endpoints_failed, s.no_backend) == (0, 2, no_backend)

    run(main())


def test_each_failure_kind_has_a_short_error() -> None:
    async def main() -> None:
        big = vllm_page(Engine()) * 20
        cases = [
            (MetricsServer(big, "length"), "body over"),
            (MetricsServer(big, "chunked"), "body over"),
            (MetricsServer(big, "eof"), "body over"),
            (MetricsServer("x", "garbage"), "not HTTP/1.x"),
            (MetricsServer("x", "status"), "status 503"),
            (MetricsServer("<html>hello</html>"), "no vllm metrics"),
            (MetricsServer("vllm:num_requests_running abc\n"), "could not convert"),
            (MetricsServer("x", "never"), "timeout"),
        ]
        for server, expected in cases:
            async with server:
                timeout = BackendPolicy(scrape_timeout_s=0.2)
                scraper = make_scraper([server.url], backend=timeout, max_body_bytes=1000)
                s = await scraper.scrape(0.0)
            assert (s.endpoints_ok, s.endpoints_failed) == (0, 1), expected
            assert len(s.errors) == 1 and expected in s.errors[0], (expected, s.errors)
            assert s.errors[0].startswith(f"127.0.0.1:{server.port}: ")
        refused = socket.socket()
        refused.bind(("127.0.0.1", 0))
        port = refused.getsockname()[1]
        s = await make_scraper([f"http://127.0.0.1:{port}/metrics"]).scrape(0.0)
        refused.close()
        assert s.errors == (f"127.0.0.1:{port}: refused",)

    run(main())


def test_counter_reset_window_expiry_and_gap() -> None:
    async def main() -> None:
        engine = Engine(ttft={0.1: 1000})
        async with MetricsServer(vllm_page(engine)) as server:
            scraper = make_scraper([server.url], adaptive=AdaptivePolicy(window_s=10.0))

            async def at(now: float, ttft: dict[float, int]) -> tuple[float | None, int]:
                engine.ttft = ttft
                server.page = vllm_page(engine)
                s = await scraper.scrape(now)
                assert s.endpoints_ok == 1
                return s.latency["ttft"]

            assert await at(0.0, {0.1: 1000}) == (None, 0)  # baseline
            # +20 in (0.5, 0.75]: p90 rank 18 -> 0.5 + 0.25 * 18/20
            q, n = await at(1.0, {0.1: 1000, 0.75: 20})
            assert n == 20 and q == pytest.approx(0.725)
            # Restarted: 10 observations in all, now in (1.0, 2.5]; they are the delta.
            q, n = await at(2.0, {2.5: 10})
            assert n == 30
            assert q == pytest.approx(1.0 + 1.5 * (27 - 20) / 10)  # rank 27 of 30
            assert await at(6.0, {2.5: 10}) == (q, 30)  # nothing new: same window
            # At 11.5 the window is (1.5, 11.5]: the entry of t=1 has left, t=2's remains.
            q, n = await at(11.5, {2.5: 10})
            assert n == 10 and q == pytest.approx(1.0 + 1.5 * 0.9)
            assert await at(12.5, {2.5: 10}) == (None, 0)  # all gone
            # A gap longer than the window: the next reading is a baseline again.
            assert await at(30.0, {2.5: 500}) == (None, 0)
            q, n = await at(31.0, {2.5: 500, INF: 10})
            assert n == 10 and q == 2560.0  # in +Inf: the largest finite bound

    run(main())


# --- a hostile endpoint ------------------------------------------------------------------------

TTFT = "vllm:time_to_first_token_seconds_bucket"


def ttft_lines(counts: Sequence[tuple[str, float]], labels: str = 'engine="0"') -> str:
    """TTFT bucket lines of one series: (le as written, cumulative count)."""
    return "".join(f'{TTFT}{{{labels},le="{le}"}} {n}\n' for le, n in counts)


NONSENSE = [
    (ttft_lines([("0.1", 5), ("NaN", 7), ("+Inf", 9)]), f"{TTFT}: le='NaN' is not a number >= 0"),
    (ttft_lines([("-1", 5), ("0.1", 7), ("+Inf", 9)]), f"{TTFT}: le='-1' is not a number >= 0"),
    (ttft_lines([("-Inf", 0), ("+Inf", 9)]), f"{TTFT}: le='-Inf' is not a number >= 0"),
    (ttft_lines([("0.1", 5), ("0.5", 3), ("+Inf", 9)]), f"{TTFT}: counts fall to 3 at le=0.5"),
    (ttft_lines([("0.1", 5), ("+Inf", 9), ("+Inf", 9)]), f"{TTFT}: le='+Inf' twice in one"),
    (
        ttft_lines([(f"{i / 100:g}", i) for i in range(1, 66)]),
        "bucket bounds, over 64",
    ),  # with the page's 23
    (ttft_lines([("0.1", 1e300), ("+Inf", 1e300)]), "bad value"),  # over 2**53
    ('vllm:num_requests_waiting{engine="0"} 1e308\n' * 2, "bad value"),  # summed: +Inf
    (ttft_lines([("0.1", 1e308), ("+Inf", 1e308)]) * 2, "bad value"),
]


@pytest.mark.parametrize(("page", "error"), NONSENSE)
def test_nonsense_buckets_fail_their_endpoint_and_leave_the_others_signals(
    page: str, error: str
) -> None:
    """The hostile endpoint counts as failed with a precise error; the windows, quantiles and
    gauges are the honest endpoint's alone, so nothing the hostile one sends moves the limit
    (a NaN quantile froze it, a negative bound read as a fast backend and let it grow)."""

    async def main() -> None:
        good = Engine(waiting=1, ttft={0.1: 100})
        async with MetricsServer(vllm_page(good)) as honest, MetricsServer("") as hostile:
            resolve = fixed(("127.0.0.1", honest.port), ("127.0.0.1", hostile.port))
            scraper = make_scraper(["http://pool.svc:1/metrics"], resolve=resolve)
            hostile.page = vllm_page(Engine()) + page  # vLLM's families, then the nonsense
            await scraper.scrape(100.0)
            good.ttft = {0.1: 100, 0.5: 20}
            honest.page = vllm_page(good)
            s = await scraper.scrape(101.0)
        assert (s.endpoints_ok, s.endpoints_failed) == (1, 1)
        assert len(s.errors) == 1
        assert s.errors[0].startswith(f"127.0.0.1:{hostile.port}: ")
        assert error in s.errors[0], s.errors
        assert s.waiting == 1
        assert s.latency["ttft"] == (pytest.approx(0.25 + 0.25 * 0.9), 20)  # rank 18 in (.25, .5]

    run(main())


def test_addresses_past_the_bound_are_not_scraped_and_count_as_failed() -> None:
    """One name with more addresses than MAX_ENDPOINTS (64): the 64 lowest are scraped, the
    same each round whatever the DNS order; the others count as failed, never asked."""

    async def main() -> None:
        page = vllm_page(Engine(running=1))
        servers = [MetricsServer(page) for _ in range(70)]
        for server in servers:
            await server.__aenter__()
        try:
            addresses = [("127.0.0.1", server.port) for server in servers]
            s = await make_scraper(["http://pool.svc:1/m"], resolve=fixed(*addresses)).scrape(0.0)
            first = {server.port for server in servers if server.requests}
            reversed_dns = fixed(*reversed(addresses))
            again = await make_scraper(["http://pool.svc:1/m"], resolve=reversed_dns).scrape(0.0)
            second = {server.port for server in servers if len(server.requests) == 2}
        finally:
            for server in servers:
                await server.__aexit__()
        assert (s.endpoints_ok, s.endpoints_failed, s.running) == (64, 6, 64)
        assert (again.endpoints_ok, again.endpoints_failed) == (64, 6)
        assert len(first) == 64 and first == second
        assert s.errors[0].endswith(": not scraped: over 64 addresses")
        assert len(s.errors) == 6

    run(main())


def big_page(size: int) -> str:
    """vLLM's page, padded with comments to ``size`` bytes."""
    page = vllm_page(Engine(running=3))
    comment = "# HELP padding " + "x" * 80 + "\n"
    return comment * ((size - len(page)) // len(comment) + 1) + page


@pytest.mark.parametrize(
    ("server", "error"),
    [
        (MetricsServer(big_page(2 << 20), "length"), "body over 1048576 bytes"),
        (MetricsServer(big_page(2 << 20), "eof"), "body over 1048576 bytes"),
        (MetricsServer(big_page(2 << 20), "chunked", chunk=65536), "body over 1048576 bytes"),
        (MetricsServer(vllm_page(Engine()), "chunked", chunk=8), "over 1024 chunks"),
        (
            MetricsServer('vllm:num_requests_running{engine="%d"} 1\n' * 2049),
            "over 2048 lines of the families read",
        ),
        (
            MetricsServer(f"{TTFT}{{{'a' * 30000}}} 1\n"),  # quadratic to search: 10+ s
            "bucket without le",
        ),
    ],
)
def test_a_page_past_a_bound_fails_its_endpoint_at_once(server: MetricsServer, error: str) -> None:
    """Pages the old scraper read (up to 8 MiB, any number of chunks and lines: 260 ms of
    parsing on the event loop for the worst): each bound fails the endpoint, quickly."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with server:
            t0 = loop.time()
            s = await make_scraper([server.url]).scrape(0.0)
            took = loop.time() - t0
        assert (s.endpoints_ok, s.endpoints_failed) == (0, 1)
        assert len(s.errors) == 1
        assert s.errors[0].startswith(f"127.0.0.1:{server.port}: {error}"), s.errors
        assert took < 1.0

    run(main())


def test_pages_within_the_bounds_are_read() -> None:
    """At the bounds, not past them: a 1 MiB page, 1,024 chunks, 2,048 lines, 64 bounds."""

    async def main() -> None:
        lines = 'vllm:num_requests_running{engine="%d"} 1\n'
        bounds = ttft_lines([(f"{i / 100:g}", i) for i in range(1, 64)] + [("+Inf", 64)])
        pages = [
            (MetricsServer(big_page((1 << 20) - 200)[-(1 << 20) :]), 3),
            (MetricsServer(vllm_page(Engine(running=2)), "chunked", chunk=64), 2),
            (MetricsServer("".join(lines % i for i in range(2048 - 64)) + bounds), 2048 - 64),
        ]
        for server, running in pages:
            async with server:
                s = await make_scraper([server.url]).scrape(0.0)
            assert (s.endpoints_ok, s.errors, s.running) == (1, (), running)

    run(main())


def test_vllms_own_refusals_are_counted_by_their_increase() -> None:
    """``vllm:admission_rejections_total`` (vLLM's ``--max-num-queued-reqs`` cap; labelled by
    reason, no engine label): ``Signals.refused`` is its increase since the last round, all
    reasons together; the first reading is a baseline, a lower one a restart (issue 32)."""

    def page(refused: dict[str, float]) -> str:
        lines = [vllm_page(Engine())]
        lines += [
            "# HELP vllm:admission_rejections_total Rejected.",
            "# TYPE vllm:admission_rejections_total counter",
        ]
        lines += [
            f'vllm:admission_rejections_total{{model_name="{MODEL}",reason="{r}"}} {v}'
            for r, v in refused.items()
        ]
        return "\n".join(lines) + "\n"

    async def main() -> None:
        async with MetricsServer(page({"max_num_queued_reqs": 5.0})) as server:
            scraper = make_scraper([server.url])

            async def at(now: float, refused: dict[str, float]) -> int:
                server.page = page(refused)
                return (await scraper.scrape(now)).refused

            assert await at(0.0, {"max_num_queued_reqs": 5.0}) == 0  # a baseline
            assert await at(1.0, {"max_num_queued_reqs": 7.0, "max_num_queued_tokens": 1.0}) == 3
            assert await at(2.0, {"max_num_queued_reqs": 7.0, "max_num_queued_tokens": 1.0}) == 0
            assert await at(3.0, {"max_num_queued_reqs": 2.0}) == 2  # restarted: all of it

    run(main())
    assert parse_metrics(vllm_page(Engine())).refused is None  # not exported: None, not 0
