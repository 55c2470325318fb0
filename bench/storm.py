"""Disconnect storm: many requests, a random share of whose clients leave at random moments.

``python -m bench.storm --url http://127.0.0.1:10000 -n 10000`` (or ``run_storm`` from a test).
Each request is a chat completion, streamed or not, of a random class; a random ``abort_share``
of clients close their connection after a random delay, which lands while the request is
queued, admitted, or mid-stream. The driver keeps at most ``concurrency`` requests open and
stops by itself. Afterwards the sidecar must hold nothing (in flight and queued both zero) and
its per-outcome counters must add up to the requests that reached it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp

__all__ = ["StormResult", "run_storm"]


@dataclass(slots=True)
class StormResult:
    sent: int = 0
    aborted: int = 0
    statuses: Counter[int | str] = field(default_factory=Counter)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "sent": self.sent,
            "aborted_by_client": self.aborted,
            "statuses": {str(k): v for k, v in sorted(self.statuses.items(), key=str)},
            "seconds": round(self.seconds, 2),
            "rate_per_s": round(self.sent / self.seconds, 1) if self.seconds else None,
        }


async def run_storm(
    url: str,
    n: int,
    *,
    abort_share: float = 0.5,
    concurrency: int = 64,
    seed: int = 1,
    max_abort_delay_s: float = 0.3,
    backend_delay_ms: tuple[int, ...] = (0, 10, 50),
    time_limit_s: float = 600.0,
) -> StormResult:
    rng = random.Random(seed)
    result = StormResult()
    sem = asyncio.Semaphore(concurrency)
    deadline = time.monotonic() + time_limit_s

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        stream = rng.random() < 0.5
        headers = {
            "content-type": "application/json",
            "x-test-delay-ms": str(rng.choice(backend_delay_ms)),
            "x-test-chunks": str(rng.randint(1, 4)),
        }
        if rng.random() < 0.5:
            headers["x-llm-class"] = "interactive"
        body = json.dumps(
            {
                "messages": [{"role": "user", "content": "x" * rng.randint(1, 400)}],
                "max_tokens": rng.randint(1, 200),
                "stream": stream,
            }
        ).encode()
        abort_after = rng.uniform(0.0, max_abort_delay_s) if rng.random() < abort_share else None
        async with sem:
            if time.monotonic() > deadline:
                return
            result.sent += 1

            async def call() -> int:
                async with session.post(
                    f"{url}/v1/chat/completions", data=body, headers=headers
                ) as r:
                    await r.read()
                    return r.status

            try:
                status: int | str = await asyncio.wait_for(call(), abort_after or 60.0)
            except TimeoutError:
                status = "aborted" if abort_after is not None else "timeout"
            except aiohttp.ClientError as e:
                status = type(e).__name__
            if status == "aborted":
                result.aborted += 1
            result.statuses[status] += 1

    t0 = time.monotonic()
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(one(session, i) for i in range(n)))
    result.seconds = time.monotonic() - t0
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--url", default="http://127.0.0.1:10000")
    ap.add_argument("-n", type=int, default=10_000)
    ap.add_argument("--abort-share", type=float, default=0.5)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    result = asyncio.run(
        run_storm(
            args.url,
            args.n,
            abort_share=args.abort_share,
            concurrency=args.concurrency,
            seed=args.seed,
        )
    )
    print(json.dumps(result.as_dict(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
