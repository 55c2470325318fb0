"""Disconnect storm: many requests, a random share of whose clients leave at random moments.

``run_storm``, which ``tests/e2e/test_faults.py`` sends through the real Envoy and sidecar.
Each request is a chat completion, streamed or not, of a random class; a random ``abort_share``
of clients close their connection after a random delay, which lands while the request is
queued, admitted, or mid-stream (:func:`bench.load.presets.storm_arrivals`). The client
(:mod:`bench.load.client`) keeps at most ``concurrency`` requests open and stops by itself.
Afterwards the sidecar must hold nothing (in flight and queued both zero) and its per-outcome
counters must add up to the requests that reached it.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from bench.load.client import Call, Reply, attempt, send_all, session
from bench.load.presets import storm_arrivals

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
    """Send :func:`~bench.load.presets.storm_arrivals` to ``url``, ``concurrency`` at a time,
    for at most ``time_limit_s`` (requests whose turn comes later are not sent)."""
    calls = storm_arrivals(
        n,
        abort_share=abort_share,
        seed=seed,
        max_abort_delay_s=max_abort_delay_s,
        backend_delay_ms=backend_delay_ms,
    )
    result = StormResult()
    t0 = time.monotonic()
    async with session() as http:

        async def send(call: Call, at: float) -> None:
            reply = await attempt(http, url, call)
            status = _status(call, reply)
            result.aborted += status == "aborted"
            result.statuses[status] += 1

        sent = await send_all(
            calls, send, concurrency=concurrency, stop_after_s=time_limit_s, keep=False
        )
    result.sent = sent.count
    result.seconds = time.monotonic() - t0
    return result


def _status(call: Call, reply: Reply) -> int | str:
    """How a storm request ended: its status; ``aborted`` (its client left as planned) or
    ``timeout``; else the exception that ended it."""
    if reply.outcome == "timeout":
        return "aborted" if call.aborts else "timeout"
    if reply.error is None and reply.status is not None:
        return reply.status
    return reply.error or reply.outcome
