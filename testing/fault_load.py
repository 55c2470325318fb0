"""The fault suite's traffic (``testing.faults``): closed-loop clients on the gateways.

``Load(urls, clients, hold_ms=..., max_requests=...)`` runs ``clients[i]`` clients on gateway
``i``, each sending one streamed request after another (the recording backend holds each for
``hold_ms``), until ``stop()`` or ``max_requests`` were sent; a refused client comes back
after 100 ms, so the overload stays on. A client whose gateway was retired (killed, shut
down) sends to the next live one, as a load balancer would. Every answer is kept
(:class:`Answer`), and ``failures()`` are those that break the suite's rule.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

__all__ = ["Answer", "Load"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Answer:
    gateway: int
    sent: float  # time.monotonic()
    done: float
    status: int | str  # the HTTP status, or the client error's name
    retry_after: bool


class Load:
    """Closed-loop clients, ``clients[i]`` of them on gateway ``i``, until ``stop()`` or
    ``max_requests`` were sent. Every answer is kept (:class:`Answer`)."""

    def __init__(
        self, urls: Sequence[str], clients: Sequence[int], *, hold_ms: int, max_requests: int
    ) -> None:
        self.urls = list(urls)
        self.clients = list(clients)
        self.hold_ms = hold_ms
        self.max_requests = max_requests
        self.answers: list[Answer] = []
        self.retired: dict[int, float] = {}  # gateway -> when
        self.sent = 0
        self._stop = asyncio.Event()

    def retire(self, gateway: int) -> None:
        """From now on, the gateway's clients send to the next live one. Thread-safe enough:
        one dict write, read by the loop at each request."""
        self.retired.setdefault(gateway, time.monotonic())

    def stop(self) -> None:
        self._stop.set()

    def _route(self, home: int) -> int:
        for k in range(len(self.urls)):
            gw = (home + k) % len(self.urls)
            if gw not in self.retired:
                return gw
        return home

    async def run(self) -> None:
        body = json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        ).encode()
        headers = {"content-type": "application/json", "x-test-hold-ms": str(self.hold_ms)}
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=timeout
        ) as session:

            async def client(home: int) -> None:
                while not self._stop.is_set() and self.sent < self.max_requests:
                    self.sent += 1
                    gw = self._route(home)
                    t0 = time.monotonic()
                    status: int | str
                    retry_after = False
                    try:
                        url = f"{self.urls[gw]}/v1/chat/completions"
                        async with session.post(url, data=body, headers=headers) as r:
                            await r.read()
                            status, retry_after = r.status, "retry-after" in r.headers
                    except (aiohttp.ClientError, TimeoutError) as e:
                        status = type(e).__name__
                    self.answers.append(
                        Answer(
                            gateway=gw,
                            sent=t0,
                            done=time.monotonic(),
                            status=status,
                            retry_after=retry_after,
                        )
                    )
                    if status != 200:
                        await asyncio.sleep(0.1)  # a refused client comes back soon: overload

            await asyncio.gather(
                *(client(gw) for gw, n in enumerate(self.clients) for _ in range(n))
            )

    def failures(self) -> list[Answer]:
        """Answers that break the rule: not 200, and not 429 / 503 with ``retry-after``,
        leaving out a retired gateway's after its retirement."""
        return [
            a
            for a in self.answers
            if not (a.status == 200 or (a.status in (429, 503) and a.retry_after))
            and not (a.gateway in self.retired and a.done >= self.retired[a.gateway])
        ]
