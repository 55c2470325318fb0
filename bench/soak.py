"""Soak: a long mixed load above capacity, with aborts, watching for leaks and drift.

``python -m bench.soak --minutes 60`` (``make soak``; CI runs ``--minutes 5``).

The echo backend (testing/backend.py: every request takes ``--backend-ms``), the sidecar with
SOAK_POLICY (one pool: 12 slots, 4,000 tokens, two bands) and the real Envoy, so capacity is
known: slots / service time. Poisson arrivals at ``--load`` times it, half interactive, half
batch, a share streamed, ``--abort-share`` of them giving up at a random moment
(:func:`bench.load.presets.soak_arrivals`). Every ``--every`` seconds it samples the sidecar's
RSS, the in-flight and queued gauges, and the latency of the window's requests.

It fails (exit 1) when, after the load stops, anything is still in flight or queued (bucket
gauges, the pool's slots and tokens); when the outcome counters do not add up to the requests
the sidecar saw; when RSS grew by more than ``--max-rss-growth-mb`` from the first sample to
the last; or when admitted requests' p50 latency drifted: the median of the window p50s in the
last third above twice that of the first third (single windows are noisy on two shared cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common.policy import policy_yaml
from bench.common.stats import percentile
from bench.load.client import Call, attempt, send_all, session
from bench.load.presets import soak_arrivals
from testing.harness import scrape
from testing.stack import REPO, Stack

SLOTS = 12
# One shared pool of 12 with two bands, a token bound that binds now and then (requests cost
# up to ~500 tokens), cost order and predicted-wait refusals: every path that takes or gives
# back a slot runs.
SOAK_POLICY = policy_yaml(
    {
        "pool": {"max_concurrency": SLOTS, "max_tokens_in_flight": 4000},
        "buckets": [
            {"name": "interactive", "match": {"headers": {"x-llm-class": "interactive"}},
             "priority": 0, "min_share": 0.5, "queue_timeout": "1s", "max_queue": 100},
            {"name": "batch", "priority": 10, "min_share": 0.25, "max_share": 0.75,
             "order": "cost", "queue_timeout": "5s", "max_queue": 200},
        ],
    },
    source="bench.soak",
)  # fmt: skip


@dataclass(slots=True)
class Window:
    t: float
    rss_mb: float
    in_flight: float
    queued: float
    sent: int = 0
    ok: int = 0
    refused: int = 0
    aborted: int = 0
    latencies: list[float] = field(default_factory=list)

    def p(self, q: float) -> float | None:
        """The ``q``-th percentile (``q`` in [0, 100]) of the window's latencies."""
        return percentile(self.latencies, q)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def gauges(stack: Stack) -> dict[str, float]:
    """In flight and queued (all buckets), finished (all outcomes), and the pool's slots and
    tokens in flight, from the sidecar's metrics."""
    out: dict[str, float] = {"in_flight": 0.0, "queued": 0.0, "finished": 0.0}
    total = {
        "llm_extproc_in_flight": "in_flight",
        "llm_extproc_queue_depth": "queued",
        "llm_extproc_requests_total": "finished",
    }
    for (name, _), value in scrape(stack).items():
        if name in ("llm_extproc_pool_in_flight", "llm_extproc_pool_tokens_in_flight"):
            out[name.removeprefix("llm_extproc_")] = value
        elif name in total:
            out[total[name]] += value
    return out


async def drive(stack: Stack, args: argparse.Namespace, windows: list[Window]) -> int:
    """Send :func:`~bench.load.presets.soak_arrivals` at ``--load`` times capacity for
    ``--minutes``, a window sampled every ``--every`` seconds until then; each request counts in
    the window it was sent in. Returns how many were sent."""
    rate = args.load * SLOTS / (args.backend_ms / 1000)
    seconds = args.minutes * 60
    end = time.monotonic() + seconds
    pid = stack.procs["sidecar"].popen.pid
    windows.append(Window(time.monotonic(), rss_mb(pid), 0, 0))

    async def sample() -> None:
        while True:
            await asyncio.sleep(args.every)
            now = time.monotonic()
            if now >= end:
                return
            g = await asyncio.to_thread(gauges, stack)
            windows.append(Window(now, rss_mb(pid), g["in_flight"], g["queued"]))
            last = windows[-2]
            print(
                f"  t={now - windows[0].t:6.0f}s rss={windows[-1].rss_mb:6.1f}MB "
                f"in_flight={g['in_flight']:3.0f} queued={g['queued']:4.0f} "
                f"last window: sent={last.sent} ok={last.ok} 429={last.refused} "
                f"aborted={last.aborted} p50={last.p(50)}",
                flush=True,
            )

    async with session() as http:

        async def send(call: Call, at: float) -> None:
            w = windows[-1]
            w.sent += 1
            reply = await attempt(http, stack.url, call)
            if reply.outcome == "timeout" or reply.error is not None:
                w.aborted += 1  # gave up, or the connection broke
            elif reply.status == 200:
                w.ok += 1
                w.latencies.append(reply.seconds)
            else:
                w.refused += 1

        arrivals = soak_arrivals(
            rate, seconds, backend_ms=args.backend_ms, abort_share=args.abort_share, seed=args.seed
        )
        sampler = asyncio.create_task(sample())
        try:
            sent = await send_all(arrivals, send, keep=False)
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
    return sent.count


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--load", type=float, default=1.5, help="offered load / capacity")
    ap.add_argument("--backend-ms", type=int, default=100)
    ap.add_argument("--abort-share", type=float, default=0.2)
    ap.add_argument("--every", type=float, default=30.0, help="seconds per sample")
    ap.add_argument("--max-rss-growth-mb", type=float, default=50.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)

    log_dir = Path(REPO / "bench" / "results" / "soak")
    log_dir.mkdir(parents=True, exist_ok=True)
    policy = log_dir / "policy.yaml"
    policy.write_text(SOAK_POLICY)
    backend = [sys.executable, str(REPO / "testing" / "backend.py"), "--port", "{port}"]
    windows: list[Window] = []
    print(
        f"soak: {args.minutes:g} min at {args.load:g}x capacity "
        f"({SLOTS} slots x {args.backend_ms} ms), {args.abort_share:.0%} aborts"
    )
    with Stack(backend_argv=backend, policy_path=policy, log_dir=log_dir) as stack:
        sent = asyncio.run(drive(stack, args, windows))
        deadline = time.monotonic() + 15
        g = gauges(stack)
        while (g["in_flight"] or g["queued"]) and time.monotonic() < deadline:
            time.sleep(0.1)
            g = gauges(stack)
        final_rss = rss_mb(stack.procs["sidecar"].popen.pid)

    full = [w for w in windows[1:-1] if w.latencies] or windows
    third = max(1, len(full) // 3)

    def median_p50(ws: list[Window]) -> float | None:
        return percentile([p for w in ws if (p := w.p(50)) is not None], 50)

    growth = final_rss - windows[1 if len(windows) > 1 else 0].rss_mb
    p50_first, p50_last = median_p50(full[:third]), median_p50(full[-third:])
    report = {
        "sent": sent,
        "ok": sum(w.ok for w in windows),
        "refused_429": sum(w.refused for w in windows),
        "aborted": (aborted := sum(w.aborted for w in windows)),
        "counted_by_sidecar": g["finished"],
        "in_flight_after": g["in_flight"],
        "queued_after": g["queued"],
        "pool_in_flight_after": g.get("pool_in_flight"),
        "pool_tokens_in_flight_after": g.get("pool_tokens_in_flight"),
        "rss_mb_first_sample": round(windows[1 if len(windows) > 1 else 0].rss_mb, 1),
        "rss_mb_end": round(final_rss, 1),
        "p50_s_first_third": p50_first,
        "p50_s_last_third": p50_last,
    }
    print(json.dumps(report, indent=1))
    problems = []
    if g["in_flight"] or g["queued"] or g.get("pool_in_flight") or g.get("pool_tokens_in_flight"):
        problems.append("slots, tokens or queue entries left behind")
    if not sent - aborted <= g["finished"] <= sent:
        problems.append("outcome counters do not add up")
    if growth > args.max_rss_growth_mb:
        problems.append(f"RSS grew by {growth:.1f} MB")
    if p50_first and p50_last and p50_last > 2 * p50_first:
        problems.append("p50 latency drifted above 2x")
    print("soak: " + ("FAIL: " + "; ".join(problems) if problems else "PASS"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
