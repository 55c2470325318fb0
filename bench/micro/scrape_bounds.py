"""What one metrics page can cost the event loop, at the scraper's bounds:
``python -m bench.micro.scrape_bounds [--rounds N]``.

A metrics endpoint is not trusted (docs/pool.md, "What the scraper trusts"): whatever it sends,
the sidecar reads at most ``http.MAX_BODY_BYTES`` of body in at most ``http.MAX_CHUNKS`` chunks,
and parses at most ``prometheus.MAX_LINES`` lines of the families it reads, each histogram
with at most ``vllm.MAX_BOUNDS`` bounds. Parsing runs on the event loop that admits requests
and renews leases, so what it costs is what one page can hold the loop for.

Rows, each the median and the largest of ``--rounds`` calls:

- vLLM's own page (``bench.micro.metrics_parser.vllm_page``: prometheus_client's output with
  vLLM's families) for 1, 3 and 8 engines: its size and lines of the families read, against
  which the bounds were chosen;
- the worst pages an endpoint may send: ``MAX_LINES`` bucket lines that pass every check
  (series of ``MAX_BOUNDS`` bounds), with short labels and with labels padded to fill the body
  bound; ``MAX_LINES`` gauge lines; a body of families not read; a body that is not UTF-8; one
  bucket line whose label text fills the body; one line over ``MAX_LINES`` (refused at the
  last line);
- the GET of a body of ``MAX_CHUNKS`` one-byte chunks from a loopback server (a thread, so
  that its writes do not share the loop): the longest the loop was held while reading it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import socket
import statistics
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TypeVar

from bench.micro.metrics_parser import vllm_page
from extproc.backend import http, prometheus, scrape, vllm

__all__ = ["chunked_get_hold_ms", "main", "parse_costs", "round_hold_ms", "worst_pages"]

_TTFT = "vllm:time_to_first_token_seconds_bucket"
_T = TypeVar("_T")


def _bucket_page(pad: int) -> str:
    """``MAX_LINES`` TTFT bucket lines: series of ``MAX_BOUNDS`` bounds each, model names of
    ``pad`` characters."""
    per_series = vllm.MAX_BOUNDS
    lines = []
    for series in range(prometheus.MAX_LINES // per_series):
        for i in range(per_series):
            le = "+Inf" if i == per_series - 1 else f"{0.001 * (i + 1):g}"
            labels = f'engine="{series}",model_name="{"m" * pad}",le="{le}"'
            lines.append(f"{_TTFT}{{{labels}}} {float(i)}")
    return "\n".join(lines) + "\n"


def worst_pages() -> dict[str, str | bytes]:
    """The pages at the bounds, by name (each within ``MAX_BODY_BYTES``)."""
    body = http.MAX_BODY_BYTES
    short = _bucket_page(1)
    pad = 1 + (body - len(short)) // prometheus.MAX_LINES - 2
    pages: dict[str, str | bytes] = {
        f"{prometheus.MAX_LINES} bucket lines": short,
        f"{prometheus.MAX_LINES} bucket lines, long labels": _bucket_page(pad),
        f"{prometheus.MAX_LINES} gauge lines": "vllm:num_requests_waiting 1\n"
        * prometheus.MAX_LINES,
        "families not read": ("process_other_metric_total 1\n" * body)[:body],
        "not UTF-8": b"\xff" * body,
        "one line of label text": f"{_TTFT}{{{'a' * (body - 60)}}} 1\n",
        f"{prometheus.MAX_LINES + 1} lines (refused)": "vllm:num_requests_waiting 1\n"
        * (prometheus.MAX_LINES + 1),
    }
    for name, page in pages.items():
        size = len(page) if isinstance(page, bytes) else len(page.encode())
        assert size <= body, (name, size)
    return pages


def _parse(page: str | bytes) -> None:
    try:
        vllm.parse_metrics(page)
    except ValueError:
        pass  # refused: the cost until then is what counts


def _until_error(read: Iterator[prometheus.Sample]) -> Iterator[prometheus.Sample]:
    with contextlib.suppress(ValueError):
        yield from read


def _times_ms(call: Callable[[], object], rounds: int) -> tuple[float, float]:
    call()  # warm up
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), max(times)


def parse_costs(rounds: int) -> list[tuple[str, int, int, float, float]]:
    """(page, bytes, lines of the families read, median ms, max ms) for each page."""
    rows = []
    pages: dict[str, str | bytes] = {f"vLLM, {n} engine(s)": vllm_page(n) for n in (1, 3, 8)}
    pages |= worst_pages()
    for name, page in pages.items():
        data = page if isinstance(page, bytes) else page.encode()
        read = prometheus.samples(data.decode("latin-1"), vllm.FAMILIES, max_lines=len(data))
        lines = sum(1 for _ in _until_error(read))
        median, worst = _times_ms(functools.partial(_parse, page), rounds)
        rows.append((name, len(data), lines, median, worst))
    return rows


async def _held(work: Awaitable[_T]) -> tuple[_T, float, float]:
    """(what ``work`` returns, the longest the loop was held meanwhile, how long it took), in
    ms: a task that yields at every iteration measures the gaps between its turns."""
    loop = asyncio.get_running_loop()
    longest, last, done = 0.0, loop.time(), False

    async def ticker() -> None:
        nonlocal longest, last
        while not done:
            await asyncio.sleep(0)
            now = loop.time()
            longest, last = max(longest, now - last), now

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    t0 = loop.time()
    result = await work
    took = loop.time() - t0
    done = True
    await tick
    return result, longest * 1e3, took * 1e3


def chunked_get_hold_ms(rounds: int) -> tuple[float, float]:
    """(median, max) over ``rounds`` GETs of the longest the event loop was held while one
    read ``MAX_CHUNKS`` one-byte chunks."""
    body = b"1\r\nx\r\n" * http.MAX_CHUNKS + b"0\r\n\r\n"
    answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        for _ in range(rounds + 1):
            conn, _ = listener.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(answer)  # all at once: the client finds it buffered

    server = threading.Thread(target=serve, daemon=True)
    server.start()

    async def one() -> float:
        got, held_ms, _ = await _held(
            http.get(
                "127.0.0.1", port, b"GET / HTTP/1.1\r\n\r\n", timeout_s=10, max_body_bytes=1 << 20
            )
        )
        assert len(got) == http.MAX_CHUNKS
        return held_ms

    async def all_rounds() -> list[float]:
        await one()  # warm up
        return [await one() for _ in range(rounds)]

    holds = asyncio.run(all_rounds())
    server.join(5)
    listener.close()
    return statistics.median(holds), max(holds)


def round_hold_ms(rounds: int) -> tuple[float, float, float]:
    """(median hold, max hold, median round) in ms over ``rounds`` scrape rounds of
    ``MAX_ENDPOINTS`` endpoints that all answer the costliest page at the bounds at once
    (servers on a loop of their own, in a thread): the longest the scraper's loop was held."""
    page = _bucket_page(
        1 + (http.MAX_BODY_BYTES - len(_bucket_page(1))) // prometheus.MAX_LINES - 2
    )
    body = page.encode()
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    ports: list[int] = []
    started = threading.Event()
    server_loop = asyncio.new_event_loop()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        writer.close()

    async def listen() -> None:
        for _ in range(scrape.MAX_ENDPOINTS):
            server = await asyncio.start_server(handle, "127.0.0.1", 0)
            ports.append(server.sockets[0].getsockname()[1])

    def serve() -> None:
        server_loop.run_until_complete(listen())
        started.set()
        server_loop.run_forever()  # until stopped below; the servers go with the process

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    started.wait(10)

    async def resolve(host: str, port: int) -> list[tuple[str, int]]:
        return [("127.0.0.1", p) for p in ports]

    async def one(scraper: scrape.Scraper) -> tuple[float, float]:
        signals, held_ms, took_ms = await _held(scraper.scrape(0.0))
        assert signals.endpoints_ok == scrape.MAX_ENDPOINTS, signals.errors
        return held_ms, took_ms

    async def all_rounds() -> list[tuple[float, float]]:
        scraper = scrape.Scraper(
            ["http://pool.svc:1/metrics"],
            timeout_s=10.0,
            window_s=10.0,
            resolve=resolve,
        )
        await one(scraper)  # warm up
        return [await one(scraper) for _ in range(rounds)]

    results = asyncio.run(all_rounds())
    server_loop.call_soon_threadsafe(server_loop.stop)
    thread.join(5)
    holds = [hold for hold, _ in results]
    return statistics.median(holds), max(holds), statistics.median(t for _, t in results)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="timed calls per row")
    args = parser.parse_args(argv)
    print(
        f"bounds: body {http.MAX_BODY_BYTES:,} bytes, {http.MAX_CHUNKS:,} chunks, "
        f"{prometheus.MAX_LINES:,} lines read, {vllm.MAX_BOUNDS} bounds a histogram"
    )
    print(f"{'page':<36} {'bytes':>10} {'lines':>6} {'median ms':>10} {'max ms':>8}")
    for name, size, lines, median, worst in parse_costs(args.rounds):
        print(f"{name:<36} {size:>10,} {lines:>6,} {median:>10.2f} {worst:>8.2f}")
    median, worst = chunked_get_hold_ms(args.rounds)
    print(
        f"GET of {http.MAX_CHUNKS:,} one-byte chunks: the loop held {median:.2f} ms "
        f"(median), {worst:.2f} ms (max)"
    )
    hold, worst, took = round_hold_ms(max(1, args.rounds // 5))
    print(
        f"a round of {scrape.MAX_ENDPOINTS} endpoints, each the long-label page at once: the "
        f"loop held {hold:.2f} ms (median), {worst:.2f} ms (max); the round took {took:.0f} ms"
    )


if __name__ == "__main__":
    main()
