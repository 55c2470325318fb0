"""Read vLLM's /metrics from every endpoint of the pool and fold them into one ``Signals``.

Theory of operation
-------------------
A URL names a host, not a pod: a Kubernetes headless Service answers with one A record per
ready pod, so each scrape resolves every host again (``loop.getaddrinfo``) and scrapes every
address it gets, concurrently, each under ``timeout_s`` (resolution has its own ``timeout_s``).
A pod that joins is scraped from the next round; one that leaves is simply no longer asked.

The HTTP client is a plain HTTP/1.1 GET with ``Connection: close`` on asyncio streams (the
sidecar does not depend on an HTTP library). The body may come with Content-Length, chunked or
until EOF; past ``max_body_bytes`` the endpoint counts as failed. Whatever goes wrong with one
endpoint (DNS, refused, timeout, a status other than 200, a page without vLLM's families, a
malformed sample of those families) counts it as failed with a short error string; ``scrape``
never raises for an endpoint.

What is read (summed over a family's label sets, since one server may run several models or
data-parallel engines): the gauges ``vllm:num_requests_waiting``, ``vllm:num_requests_running``
and ``vllm:kv_cache_usage_perc`` (older vLLM: ``vllm:gpu_cache_usage_perc``; a fraction, so its
max is taken rather than its sum), and the histograms ``vllm:time_to_first_token_seconds`` and
``vllm:inter_token_latency_seconds`` (older vLLM: ``vllm:time_per_output_token_seconds``; when a
version exposes both during the rename they carry the same observations, so only the new one
is read).

The page is parsed by hand: ``str.find`` goes from one line of a wanted family to the next, and
only those lines are parsed. A vLLM page is about 100 KB, mostly histograms we do not need;
``prometheus_client.parser`` builds every family of it in pure Python and costs about 30 times
more (measured on a page that prometheus_client wrote: ~24 ms against ~0.8 ms for 100 KB), per
endpoint, per round, on the event loop that serves the requests.

Windowed quantiles
------------------
Histogram buckets are cumulative since the vLLM process started; a quantile over them would
describe its whole life. Per endpoint (keyed ``address:port``) the previous bucket counts are
kept; each scrape adds the delta (now minus previous) of all endpoints together to a
time-stamped ring, and the quantile is taken over the sum of the ring's entries of the last
``window_s``, with Prometheus' ``histogram_quantile`` interpolation. The first sight of an
endpoint only records its counts (its history is not recent); so does a sight after a gap longer
than the window. A count that went down means the process restarted: its new counts are all
new observations and are the delta.

Only the pure parts (``parse_metrics``, ``histogram_quantile`` and the window, which take ``now``
from the caller) hold state or do arithmetic; ``Scraper.scrape`` does the I/O around them. It is
not reentrant: the poller runs one scrape at a time.
"""

from __future__ import annotations

import asyncio
import math
import re
import socket
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = [
    "EndpointSample",
    "Resolver",
    "Scraper",
    "Signals",
    "histogram_quantile",
    "parse_metrics",
]

# (host, port) -> the (address, port) pairs to scrape.
Resolver = Callable[[str, int], Awaitable[Sequence[tuple[str, int]]]]

# Headers and each chunk-size line must fit in this (asyncio's StreamReader limit).
_HEAD_LIMIT = 64 * 1024
# At most this many error strings in a Signals (a log line, not a report).
_MAX_ERRORS = 8

_WAITING = "vllm:num_requests_waiting"
_RUNNING = "vllm:num_requests_running"
_KV = "vllm:kv_cache_usage_perc"
_KV_OLD = "vllm:gpu_cache_usage_perc"
_TTFT = "vllm:time_to_first_token_seconds_bucket"
_ITL = "vllm:inter_token_latency_seconds_bucket"
_ITL_OLD = "vllm:time_per_output_token_seconds_bucket"
_WANTED = frozenset({_WAITING, _RUNNING, _KV, _KV_OLD, _TTFT, _ITL, _ITL_OLD})
_BUCKETS = frozenset({_TTFT, _ITL, _ITL_OLD})

_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')


# --- value objects ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class EndpointSample:
    """One endpoint's page: each family summed over its label sets; None where absent.

    Histograms map a bucket's upper bound (``le``, +Inf included) to its cumulative count."""

    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    ttft: Mapping[float, float] | None = None
    itl: Mapping[float, float] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Signals:
    """The pool's load at ``at``: gauges from this scrape, quantiles over the last window."""

    at: float
    endpoints_ok: int
    endpoints_failed: int
    waiting: int  # vLLM's own queue, all endpoints together
    running: int
    kv_usage: float  # the fullest endpoint, 0..1
    ttft_s: float | None  # None: no observation in the window
    itl_s: float | None
    ttft_count: int  # observations in the window
    itl_count: int
    errors: tuple[str, ...] = ()


# --- the pure parts --------------------------------------------------------------------------


def parse_metrics(text: str) -> EndpointSample:
    """The families we need from a Prometheus text page; raises ValueError on a malformed
    sample of one of them (other lines are not looked at)."""
    sums: dict[str, float] = {}
    kv: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    text = "\n" + text  # every sample line now starts after a newline
    for name in _WANTED:
        # str.find jumps from one line of the family to the next in C; a Python loop over
        # every line of the page would cost several times more.
        needle = "\n" + name
        pos = text.find(needle)
        while pos != -1:
            end = text.find("\n", pos + 1)
            line = text[pos + 1 : end if end != -1 else len(text)].rstrip("\r")
            pos = text.find(needle, end) if end != -1 else -1
            sep = line[len(name) : len(name) + 1]
            labels = ""
            if sep == "{":
                close = line.rfind("}")  # nothing after the labels (value, timestamp) has one
                if close == -1:
                    raise ValueError(f"bad labels {line[:60]!r}")
                labels = line[len(name) + 1 : close]
                rest = line[close + 1 :]
            elif sep in (" ", "\t", ""):
                rest = line[len(name) :]
            else:
                continue  # a longer name that starts with this one
            fields = rest.split()
            if not fields:
                raise ValueError(f"no value {line[:60]!r}")
            value = float(fields[0])
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"bad value {line[:60]!r}")
            if name in _BUCKETS:
                le = _label(labels, "le")
                if le is None:
                    raise ValueError(f"bucket without le {line[:60]!r}")
                bound = float(le)
                hist = buckets.setdefault(name, {})
                hist[bound] = hist.get(bound, 0.0) + value
            elif name in (_KV, _KV_OLD):
                kv[name] = max(kv.get(name, 0.0), value)
            else:
                sums[name] = sums.get(name, 0.0) + value
    return EndpointSample(
        waiting=sums.get(_WAITING),
        running=sums.get(_RUNNING),
        kv_usage=kv.get(_KV, kv.get(_KV_OLD)),
        ttft=buckets.get(_TTFT),
        itl=buckets.get(_ITL, buckets.get(_ITL_OLD)),
    )


def _label(labels: str, key: str) -> str | None:
    for m in _LABEL.finditer(labels):
        if m.group(1) == key:
            return m.group(2)
    return None


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The ``q`` quantile of cumulative ``buckets`` (upper bound -> count), as Prometheus'
    ``histogram_quantile``: linear interpolation inside the bucket where the rank falls, the
    first bucket starting at 0; a rank in the +Inf bucket gives the largest finite bound.
    None when there is no observation (or no finite bound).

    Counts are made monotonic first (summing endpoints whose bounds differ can break it),
    as Prometheus does."""
    bounds = sorted(buckets)
    if not bounds:
        return None
    counts: list[float] = []
    running_max = 0.0
    for b in bounds:
        running_max = max(running_max, buckets[b])
        counts.append(running_max)
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    i = next(i for i, c in enumerate(counts) if c >= rank)
    upper = bounds[i]
    if math.isinf(upper):
        return bounds[i - 1] if i > 0 else None
    if i == 0:
        if upper <= 0:
            return upper
        lower, below = 0.0, 0.0
    else:
        lower, below = bounds[i - 1], counts[i - 1]
    return lower + (upper - lower) * (rank - below) / (counts[i] - below)


def _observations(buckets: Mapping[float, float]) -> int:
    return round(max(buckets.values(), default=0.0))


def _delta(
    prev: Mapping[float, float] | None, cur: Mapping[float, float] | None
) -> dict[float, float] | None:
    """New observations between two readings of one endpoint's histogram; None when there is
    no earlier reading to subtract (a baseline)."""
    if cur is None or prev is None:
        return None
    if prev.keys() != cur.keys() or any(cur[b] < prev[b] for b in cur):
        return dict(cur)  # restarted (or re-bucketed): everything it has is new
    return {b: cur[b] - prev[b] for b in cur}


@dataclass(frozen=True, slots=True)
class _Reading:
    at: float
    ttft: Mapping[float, float] | None
    itl: Mapping[float, float] | None


class _Window:
    """Per-scrape histogram deltas (all endpoints together) of the last ``window_s``."""

    __slots__ = ("_ring", "window_s")

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._ring: deque[tuple[float, dict[float, float]]] = deque()

    def add(self, at: float, delta: dict[float, float]) -> None:
        if delta:
            self._ring.append((at, delta))

    def total(self, now: float) -> dict[float, float]:
        ring = self._ring
        while ring and ring[0][0] <= now - self.window_s:
            ring.popleft()
        out: dict[float, float] = {}
        for _, delta in ring:
            for b, n in delta.items():
                out[b] = out.get(b, 0.0) + n
        return out


def _add_into(into: dict[float, float], delta: Mapping[float, float] | None) -> None:
    if delta:
        for b, n in delta.items():
            into[b] = into.get(b, 0.0) + n


# --- the I/O shell ---------------------------------------------------------------------------


class _Failed(Exception):
    """An endpoint answered, but not with a page we can use."""


@dataclass(frozen=True, slots=True)
class _Target:
    host: str
    port: int
    path: str
    request: bytes


def _target(url: str) -> _Target:
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"{url!r}: only http:// URLs can be scraped")
    host = parts.hostname
    if not host:
        raise ValueError(f"{url!r}: no host")
    port = parts.port or 80  # ValueError for a port that is not a number or out of range
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    authority = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        authority += f":{port}"
    request = (
        f"GET {path} HTTP/1.1\r\n"
        f"Host: {authority}\r\n"
        "Accept: text/plain\r\n"  # no Accept-Encoding: the body comes uncompressed
        "User-Agent: llm-extproc\r\n"
        "Connection: close\r\n\r\n"
    ).encode("ascii")
    return _Target(host, port, path, request)


async def _getaddrinfo(host: str, port: int) -> list[tuple[str, int]]:
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    return [(str(info[4][0]), int(info[4][1])) for info in infos]


def _key(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


async def _get(address: str, port: int, request: bytes, max_body_bytes: int) -> bytes:
    """One HTTP/1.1 GET; the body of a 200, or ``_Failed``/``OSError``/``EOFError``."""
    reader, writer = await asyncio.open_connection(address, port, limit=_HEAD_LIMIT)
    try:
        writer.write(request)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        version, _, rest = status_line.partition(" ")
        if not version.startswith("HTTP/1."):
            raise _Failed("not HTTP/1.x")
        status = rest[:3]
        if status != "200" or rest[3:4] not in ("", " "):
            raise _Failed(f"status {status or '?'}")
        headers: dict[str, str] = {}
        for h in header_lines:
            name, sep, value = h.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip().lower()
        if headers.get("content-encoding", "identity") != "identity":
            raise _Failed("compressed body")
        transfer = headers.get("transfer-encoding")
        if transfer is not None:
            if transfer != "chunked":
                raise _Failed(f"transfer-encoding {transfer}")
            return await _read_chunked(reader, max_body_bytes)
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise _Failed("bad content-length")
            n = int(length)
            if n > max_body_bytes:
                raise _Failed(f"body over {max_body_bytes} bytes")
            return await reader.readexactly(n)
        body = bytearray()
        while chunk := await reader.read(65536):
            body += chunk
            if len(body) > max_body_bytes:
                raise _Failed(f"body over {max_body_bytes} bytes")
        return bytes(body)
    finally:
        writer.close()


async def _read_chunked(reader: asyncio.StreamReader, max_body_bytes: int) -> bytes:
    body = bytearray()
    while True:
        line = await reader.readuntil(b"\r\n")
        size_field = line.split(b";", 1)[0].strip()
        try:
            size = int(size_field, 16)
        except ValueError:
            raise _Failed("bad chunk size") from None
        if size < 0:
            raise _Failed("bad chunk size")
        if size == 0:
            return bytes(body)  # trailers, if any, are left unread: the connection closes
        if len(body) + size > max_body_bytes:
            raise _Failed(f"body over {max_body_bytes} bytes")
        body += await reader.readexactly(size)
        if await reader.readexactly(2) != b"\r\n":
            raise _Failed("bad chunk")


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
    return text[:80]


class Scraper:
    def __init__(
        self,
        urls: Sequence[str],
        *,
        timeout_s: float = 0.5,
        window_s: float = 10.0,
        ttft_quantile: float = 0.9,
        itl_quantile: float = 0.9,
        max_body_bytes: int = 8 * 1024 * 1024,
        resolve: Resolver | None = None,
    ) -> None:
        """``resolve`` maps (host, port) to the (address, port) pairs to scrape; the default is
        ``loop.getaddrinfo`` (every A/AAAA record). Raises ValueError for a URL that is not
        plain ``http://``, or for out-of-range settings."""
        if not urls:
            raise ValueError("no URL to scrape")
        for q in (ttft_quantile, itl_quantile):
            if not 0.0 < q < 1.0:
                raise ValueError(f"quantile {q} is not in (0, 1)")
        if timeout_s <= 0 or window_s <= 0 or max_body_bytes <= 0:
            raise ValueError("timeout_s, window_s and max_body_bytes must be positive")
        self._targets = [_target(u) for u in urls]
        self.timeout_s = timeout_s
        self.window_s = window_s
        self.ttft_quantile = ttft_quantile
        self.itl_quantile = itl_quantile
        self.max_body_bytes = max_body_bytes
        self._resolve: Resolver = resolve or _getaddrinfo
        self._last: dict[str, _Reading] = {}  # endpoint key -> its previous reading
        self._ttft = _Window(window_s)
        self._itl = _Window(window_s)

    async def scrape(self, now: float) -> Signals:
        """Scrape every address of every URL once; ``now`` stamps the readings."""
        errors: list[str] = []
        resolved = await asyncio.gather(*(self._addresses(t) for t in self._targets))
        endpoints: dict[str, tuple[str, int, _Target]] = {}
        for target, addresses in zip(self._targets, resolved, strict=True):
            if isinstance(addresses, str):
                errors.append(f"{target.host}: {addresses}")
                continue
            for address, port in addresses:
                endpoints.setdefault(_key(address, port), (address, port, target))
        keys = list(endpoints)
        results = await asyncio.gather(*(self._scrape_one(*endpoints[k]) for k in keys))
        return self._fold(now, dict(zip(keys, results, strict=True)), errors)

    async def _addresses(self, target: _Target) -> list[tuple[str, int]] | str:
        try:
            async with asyncio.timeout(self.timeout_s):
                addresses = await self._resolve(target.host, target.port)
        except Exception as exc:
            return _describe(exc)
        if not addresses:
            return "dns: no address"
        return list(dict.fromkeys(addresses))  # once each, in the resolver's order

    async def _scrape_one(self, address: str, port: int, target: _Target) -> EndpointSample | str:
        try:
            async with asyncio.timeout(self.timeout_s):
                body = await _get(address, port, target.request, self.max_body_bytes)
            sample = parse_metrics(body.decode("utf-8", errors="replace"))
        except Exception as exc:
            return _describe(exc)
        if sample == EndpointSample():
            return "no vllm metrics"
        return sample

    def _fold(
        self, now: float, results: Mapping[str, EndpointSample | str], errors: list[str]
    ) -> Signals:
        """The pure step: readings of this round -> deltas into the window -> Signals."""
        ok = 0
        failed = len(errors)  # hosts that did not resolve count as one failed endpoint each
        waiting = running = 0.0
        kv_usage = 0.0
        ttft_delta: dict[float, float] = {}
        itl_delta: dict[float, float] = {}
        for key, result in results.items():
            if isinstance(result, str):
                failed += 1
                errors.append(f"{key}: {result}")
                continue
            ok += 1
            waiting += result.waiting or 0.0
            running += result.running or 0.0
            kv_usage = max(kv_usage, result.kv_usage or 0.0)
            last = self._last.get(key)
            if last is not None and last.at > now - self.window_s:
                _add_into(ttft_delta, _delta(last.ttft, result.ttft))
                _add_into(itl_delta, _delta(last.itl, result.itl))
            self._last[key] = _Reading(now, result.ttft, result.itl)
        # Forget endpoints not read within the window: their next reading is a baseline anyway.
        for key in [k for k, r in self._last.items() if r.at <= now - self.window_s]:
            del self._last[key]
        self._ttft.add(now, ttft_delta)
        self._itl.add(now, itl_delta)
        ttft = self._ttft.total(now)
        itl = self._itl.total(now)
        if len(errors) > _MAX_ERRORS:
            errors[_MAX_ERRORS - 1 :] = [f"+{len(errors) - _MAX_ERRORS + 1} more"]
        return Signals(
            at=now,
            endpoints_ok=ok,
            endpoints_failed=failed,
            waiting=round(waiting),
            running=round(running),
            kv_usage=min(1.0, kv_usage),
            ttft_s=histogram_quantile(self.ttft_quantile, ttft),
            itl_s=histogram_quantile(self.itl_quantile, itl),
            ttft_count=_observations(ttft),
            itl_count=_observations(itl),
            errors=tuple(errors),
        )

    def __repr__(self) -> str:
        hosts = ", ".join(f"{t.host}:{t.port}" for t in self._targets)
        return f"<Scraper {hosts}, {len(self._last)} endpoints known>"
