"""Read vLLM's /metrics from every endpoint of the pool and fold them into one ``Signals``.

Theory of operation
-------------------
A URL names a host, not a pod: a Kubernetes headless Service answers with one A record per
ready pod, so each scrape resolves every host again (``loop.getaddrinfo``) and scrapes every
address it gets, concurrently, each under ``timeout_s`` (resolution has its own ``timeout_s``).
A pod that joins is scraped from the next round; one that leaves is simply no longer asked.
At most ``MAX_ENDPOINTS`` (64) addresses are scraped a round, all URLs together: past it, the
lowest 64 (address, port) pairs, the same ones each round whatever order the DNS answers in,
and each of the others counts as failed (``not scraped: over 64 addresses``).

Nothing an endpoint sends is trusted: the GET bounds the body's size and chunks, the reader
the lines it parses and what the values may be (``http``, ``prometheus``, ``vllm``), so one
page holds the event loop for a bounded time and a nonsense page fails its endpoint instead of
moving the limit. Pages are parsed one per iteration of the event loop: the parser holds a
turn (a lock) from its page into the loop's next iteration, so between two parses the loop
polls its sockets and runs what became ready (requests, lease renewals), and 64 pages that
arrive at once hold it for one page at a time, never for 64 back to back. docs/pool.md
("What the scraper trusts") states each bound and its cost.

One round is four stages, each a module of this package, data flowing one way:

1. resolve every URL's host (here; the only step that is not pure or HTTP);
2. GET each address (``http.get``: bounded in time, head and body size);
3. read the page (``vllm.parse_metrics`` over ``prometheus.samples``: pure, a page in, an
   ``EndpointSample`` out);
4. fold the samples (``Scraper._fold``, no I/O): gauges summed (KV usage: the fullest
   endpoint), each objective's histogram (``objectives``) into its ``window.HistogramWindow``
   (pure, ``now`` passed in), the windows' quantiles, and the failures, into one ``Signals``.

Whatever goes wrong with one endpoint (DNS, refused, timeout, a status other than 200, a page
without vLLM's families, a malformed sample of those families) counts it as failed with a short
error string; ``scrape`` never raises for an endpoint.

The page is parsed by hand (``prometheus``, ``vllm``) rather than with
``prometheus_client.parser``: a vLLM page is about 100 KB, mostly histograms we do not need,
and that parser builds every family of it in pure Python, per endpoint, per round, on the event
loop that serves the requests; ours parses only the lines of the families it reads, and costs
about 28 times less on a vLLM page (docs/performance.md, "Conclusions from earlier
measurements").

``Scraper.scrape`` is not reentrant: the poller runs one scrape at a time.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from extproc.backend.http import MAX_BODY_BYTES, Target, get
from extproc.backend.vllm import EndpointSample, parse_metrics
from extproc.backend.window import HistogramWindow, histogram_quantile, observations
from extproc.objectives import OBJECTIVES

if TYPE_CHECKING:
    from extproc.config.policy import AdaptivePolicy, BackendPolicy

__all__ = [
    "MAX_ENDPOINTS",
    "EndpointSample",
    "Latency",
    "Resolver",
    "Scraper",
    "Signals",
    "histogram_quantile",
    "parse_metrics",
]

# (host, port) -> the (address, port) pairs to scrape.
Resolver = Callable[[str, int], Awaitable[Sequence[tuple[str, int]]]]

# Addresses scraped in one round, all URLs together (docs/pool.md, "What the scraper trusts").
MAX_ENDPOINTS = 64
# At most this many error strings in a Signals (a log line, not a report), each cut at this.
_MAX_ERRORS = 8
_MAX_ERROR_CHARS = 120
# getaddrinfo's "this name has no address" (NXDOMAIN, or a name without A/AAAA records), as
# against a failure to ask (EAI_AGAIN, a timeout): the error ``_addresses`` reports for both.
_NO_ADDRESS = "dns: no address"
_NO_ADDRESS_ERRNOS = frozenset(
    e for e in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None)) if e is not None
)


class Latency(NamedTuple):
    """An objective's windowed quantile (None: no observation) and its observations."""

    seconds: float | None = None
    observations: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Signals:
    """The pool's load at ``at``: gauges from this scrape, quantiles over the last window."""

    at: float
    endpoints_ok: int
    endpoints_failed: int
    waiting: int  # vLLM's own queue, all endpoints together
    running: int
    kv_usage: float  # the fullest endpoint, 0..1
    # By latency objective (``objectives``); one absent: no observation (or not exported).
    latency: Mapping[str, Latency] = field(default_factory=dict)
    # Requests vLLM itself refused since the last round (its --max-num-queued-reqs cap), all
    # endpoints together; an endpoint's first reading counts none.
    refused: int = 0
    errors: tuple[str, ...] = ()
    # Every host named no address (NXDOMAIN, no record): no backend exists at all, as a
    # headless Service with no ready pod says (not a DNS failure, which is no data).
    no_backend: bool = False


async def _getaddrinfo(host: str, port: int) -> list[tuple[str, int]]:
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    return [(str(info[4][0]), int(info[4][1])) for info in infos]


def _key(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, asyncio.IncompleteReadError):
        return "closed early"
    if isinstance(exc, asyncio.LimitOverrunError):
        return "header too long"
    if isinstance(exc, socket.gaierror):
        return f"dns: {exc.strerror or exc}"
    text = str(exc) or type(exc).__name__
    return text[:_MAX_ERROR_CHARS]


class Scraper:
    """The metrics endpoints of one pool, read a round at a time (``scrape``); between rounds
    it holds the histogram windows. Its settings come from the resolved policy
    (``from_policy``); only the body bound and the resolver have defaults here."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        timeout_s: float,
        window_s: float,
        quantiles: Mapping[str, float] | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        resolve: Resolver | None = None,
    ) -> None:
        """``quantiles``: each objective's, by name (absent: its row's default). ``resolve`` maps
        (host, port) to the (address, port) pairs to scrape; the default is
        ``loop.getaddrinfo`` (every A/AAAA record). Raises ValueError for a URL that is not
        plain ``http://``, or for out-of-range settings."""
        if not urls:
            raise ValueError("no URL to scrape")
        self.quantiles = {o.name: (quantiles or {}).get(o.name, o.quantile) for o in OBJECTIVES}
        for q in self.quantiles.values():
            if not 0.0 < q < 1.0:
                raise ValueError(f"quantile {q} is not in (0, 1)")
        if timeout_s <= 0 or window_s <= 0 or max_body_bytes <= 0:
            raise ValueError("timeout_s, window_s and max_body_bytes must be positive")
        self._targets = [Target.parse(u) for u in urls]
        self.timeout_s = timeout_s
        self.window_s = window_s
        self.max_body_bytes = max_body_bytes
        self._resolve: Resolver = resolve or _getaddrinfo
        # One window per objective's histogram, by its name.
        self._windows = {name: HistogramWindow(window_s) for name in self.quantiles}
        # Each endpoint's last reading of vLLM's refusals counter (those read last round only).
        self._refused_seen: dict[str, float] = {}
        self._parse_turn = asyncio.Lock()  # one page parsed per iteration of the event loop

    @classmethod
    def from_policy(
        cls,
        backend: BackendPolicy,
        adaptive: AdaptivePolicy,
        *,
        max_body_bytes: int = MAX_BODY_BYTES,
        resolve: Resolver | None = None,
    ) -> Scraper:
        """The scraper of ``backend.metrics``, with the resolved policy's settings."""
        return cls(
            backend.metrics,
            timeout_s=backend.scrape_timeout_s,
            window_s=adaptive.window_s,
            quantiles=adaptive.quantiles,
            max_body_bytes=max_body_bytes,
            resolve=resolve,
        )

    async def scrape(self, now: float) -> Signals:
        """Scrape every address of every URL once; ``now`` stamps the readings."""
        errors: list[str] = []
        resolved = await asyncio.gather(*(self._addresses(t) for t in self._targets))
        endpoints: dict[str, tuple[str, int, Target]] = {}
        for target, addresses in zip(self._targets, resolved, strict=True):
            if isinstance(addresses, str):
                errors.append(f"{target.host}: {addresses}")
                continue
            for address, port in addresses:
                endpoints.setdefault(_key(address, port), (address, port, target))
        keys = list(endpoints)
        unread: dict[str, EndpointSample | str] = {}
        if len(keys) > MAX_ENDPOINTS:  # the same ones each round, whatever the DNS order
            keys = sorted(keys, key=lambda k: endpoints[k][:2])
            note = f"not scraped: over {MAX_ENDPOINTS} addresses"
            unread = dict.fromkeys(keys[MAX_ENDPOINTS:], note)
            keys = keys[:MAX_ENDPOINTS]
        results = await asyncio.gather(*(self._scrape_one(*endpoints[k]) for k in keys))
        no_backend = all(isinstance(a, str) and a.startswith(_NO_ADDRESS) for a in resolved)
        return self._fold(now, dict(zip(keys, results, strict=True)) | unread, errors, no_backend)

    async def _addresses(self, target: Target) -> list[tuple[str, int]] | str:
        try:
            async with asyncio.timeout(self.timeout_s):
                addresses = await self._resolve(target.host, target.port)
        except socket.gaierror as exc:
            if exc.errno in _NO_ADDRESS_ERRNOS:
                return f"{_NO_ADDRESS} ({exc.strerror or exc})"
            return _describe(exc)
        except Exception as exc:
            return _describe(exc)
        if not addresses:
            return _NO_ADDRESS
        return list(dict.fromkeys(addresses))  # once each, in the resolver's order

    async def _scrape_one(self, address: str, port: int, target: Target) -> EndpointSample | str:
        try:
            body = await get(
                address,
                port,
                target.request,
                timeout_s=self.timeout_s,
                max_body_bytes=self.max_body_bytes,
            )
            async with self._parse_turn:
                try:
                    sample = parse_metrics(body)
                finally:
                    await asyncio.sleep(0)  # hold the turn into the loop's next iteration
        except Exception as exc:
            return _describe(exc)
        if sample == EndpointSample():
            return "no vllm metrics"
        return sample

    def _fold(
        self,
        now: float,
        results: Mapping[str, EndpointSample | str],
        errors: list[str],
        no_backend: bool = False,
    ) -> Signals:
        """The pure step: readings of this round -> deltas into the windows -> Signals."""
        ok = 0
        failed = len(errors)  # hosts that did not resolve count as one failed endpoint each
        waiting = running = refused = 0.0
        kv_usage = 0.0
        refused_now: dict[str, float] = {}
        read: dict[str, dict[str, Mapping[float, float] | None]] = {n: {} for n in self._windows}
        for key, result in results.items():
            if isinstance(result, str):
                failed += 1
                errors.append(f"{key}: {result}")
                continue
            ok += 1
            waiting += result.waiting or 0.0
            running += result.running or 0.0
            kv_usage = max(kv_usage, result.kv_usage or 0.0)
            if result.refused is not None:
                seen = self._refused_seen.get(key)
                # A counter: the increase; below the last reading the engine restarted.
                if seen is not None:
                    refused += result.refused - seen if result.refused >= seen else result.refused
                refused_now[key] = result.refused
            for name, of_name in read.items():
                of_name[key] = result.histograms.get(name)
        self._refused_seen = refused_now
        latency = {}
        for name, window in self._windows.items():
            window.add(now, read[name])
            total = window.total(now)
            q = histogram_quantile(self.quantiles[name], total)
            latency[name] = Latency(q, observations(total))
        if len(errors) > _MAX_ERRORS:
            errors[_MAX_ERRORS - 1 :] = [f"+{len(errors) - _MAX_ERRORS + 1} more"]
        return Signals(
            at=now,
            endpoints_ok=ok,
            endpoints_failed=failed,
            waiting=round(waiting),
            running=round(running),
            kv_usage=min(1.0, kv_usage),
            latency=latency,
            refused=round(refused),
            errors=tuple(errors),
            no_backend=no_backend,
        )

    def __repr__(self) -> str:
        hosts = ", ".join(f"{t.host}:{t.port}" for t in self._targets)
        return f"<Scraper {hosts}, {len(next(iter(self._windows.values())))} endpoints known>"
