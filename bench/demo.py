"""``make demo``: a busy LLM server behind Envoy and the sidecar, hit by a mixed burst.

Starts the vLLM-like simulator (bench/sim/, H100 profile, real time), the sidecar with
its embedded default policy, and Envoy with envoy/envoy.yaml, all on free ports of 127.0.0.1.
Then sends, at once and above the capacity the policy gives each bucket:

- short interactive chat requests (``x-llm-class: interactive``, ~100-token prompts,
  max_tokens 64) at 250 req/s for 4 s: the interactive bucket has 48 slots, a queue of 500
  and a 5 s deadline;
- long batch requests (~1500-token prompts, max_tokens 4000, which the policy clamps to 1024):
  60 at once into a bucket of 16 slots;
- a few oversize prompts (~40k tokens), which get 413.

It prints one row per kind of request (sent, admitted, 413, 429 for a full queue, 429 for
a passed deadline, other, p50/p99 latency of admitted requests and p50 of refusals, the range
of Retry-After given) and stops every process it started.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass

import aiohttp

from bench.common.stats import percentile
from bench.common.table import fmt, format_table
from testing.stack import Stack

__all__ = ["main"]


@dataclass(slots=True)
class Result:
    bucket: str
    status: int | str
    seconds: float
    retry_after: str | None = None
    code: str | None = None


def _chat(tokens: int, max_tokens: int, seed: int) -> bytes:
    words = " ".join(f"w{(seed * 7 + i) % 997}" for i in range(tokens))  # ~1 token per word
    text = words[: tokens * 4]
    return json.dumps(
        {"model": "demo", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    ).encode()


async def _send(
    session: aiohttp.ClientSession, url: str, bucket: str, body: bytes, headers: dict[str, str]
) -> Result:
    t0 = time.monotonic()
    try:
        async with session.post(
            url,
            data=body,
            headers={"content-type": "application/json", **headers},
            timeout=aiohttp.ClientTimeout(total=300),
        ) as r:
            data = await r.read()
            code = None
            if r.status != 200:
                try:
                    code = json.loads(data)["error"]["code"]
                except (ValueError, KeyError, TypeError):
                    code = None
            return Result(
                bucket, r.status, time.monotonic() - t0, r.headers.get("retry-after"), code
            )
    except (TimeoutError, aiohttp.ClientError) as e:
        return Result(bucket, type(e).__name__, time.monotonic() - t0)


async def burst(url: str, interactive_rate: float, seconds: float, batch: int) -> list[Result]:
    rng = random.Random(1)
    tasks: list[asyncio.Task[Result]] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        chat_url = f"{url}/v1/chat/completions"
        for i in range(batch):
            body = _chat(rng.randint(1000, 2000), 4000, i)
            tasks.append(asyncio.create_task(_send(session, chat_url, "batch", body, {})))
        for i in range(3):
            body = _chat(40_000, 64, i)
            tasks.append(asyncio.create_task(_send(session, chat_url, "oversize", body, {})))
        start = time.monotonic()
        n = int(interactive_rate * seconds)
        for i in range(n):
            delay = start + i / interactive_rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            body = _chat(rng.randint(50, 150), 64, i)
            tasks.append(
                asyncio.create_task(
                    _send(session, chat_url, "interactive", body, {"x-llm-class": "interactive"})
                )
            )
        return list(await asyncio.gather(*tasks))


_HEADERS = [
    "requests",
    "sent",
    "200",
    "413",
    "429 full",
    "429 late",
    "other",
    "p50 ok s",
    "p99 ok s",
    "p50 429 s",
    "retry-after",
]


def table(results: list[Result]) -> str:
    """One row per kind of request; latencies are ``bench.common.stats.percentile``."""
    groups: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        groups[r.bucket].append(r)
    rows = []
    for bucket in ("interactive", "batch", "oversize"):
        rs = groups.get(bucket, [])
        ok = [r.seconds for r in rs if r.status == 200]
        refused = [r for r in rs if r.status == 429]
        other = sum(1 for r in rs if r.status not in (200, 413, 429))
        ras = sorted(int(r.retry_after) for r in refused if r.retry_after)
        rows.append(
            [
                bucket,
                str(len(rs)),
                str(len(ok)),
                str(sum(1 for r in rs if r.status == 413)),
                str(sum(1 for r in refused if r.code == "queue_full")),
                str(sum(1 for r in refused if r.code == "queue_timeout")),
                str(other),
                fmt(percentile(ok, 50)),
                fmt(percentile(ok, 99)),
                fmt(percentile([r.seconds for r in refused], 50)),
                f"{ras[0]}-{ras[-1]}s" if ras else "-",
            ]
        )
    head, *body = format_table(_HEADERS, rows).splitlines()
    return "\n".join([head, "-" * len(head), *body])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--interactive-rate", type=float, default=250.0, help="req/s")
    ap.add_argument("--seconds", type=float, default=4.0, help="interactive burst length")
    ap.add_argument("--batch", type=int, default=60, help="batch requests sent at once")
    args = ap.parse_args(argv)

    backend = [sys.executable, "-m", "bench.sim", "--port", "{port}", "--profile", "h100"]
    print("starting simulator (H100 profile), sidecar (embedded default policy) and Envoy ...")
    with Stack(backend_argv=backend, envoy_concurrency=1) as stack:
        print(f"  Envoy listening on {stack.url}, sidecar metrics on {stack.metrics_url}")
        print(
            f"sending {int(args.interactive_rate * args.seconds)} interactive requests over "
            f"{args.seconds:g}s, {args.batch} batch requests and 3 oversize prompts at once ..."
        )
        t0 = time.monotonic()
        results = asyncio.run(burst(stack.url, args.interactive_rate, args.seconds, args.batch))
        print(f"done in {time.monotonic() - t0:.1f}s\n")
        print(table(results))
        with urllib.request.urlopen(stack.metrics_url) as r:
            metrics = r.read().decode()
        print("\nsidecar outcome counters:")
        for line in metrics.splitlines():
            if line.startswith("llm_extproc_requests_total"):
                print("  " + line)
    print("\nall processes stopped.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
