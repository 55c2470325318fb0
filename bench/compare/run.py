"""Running one strategy at one load: a fresh stack, one load-generator run, the counters
snapshotted at the window's edges, teardown."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Final

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.load.runner import LoadConfig, run_load
from bench.load.summary import LoadResult
from testing.stack import Stack

from .capacity import Capacity
from .options import Options, Strategy
from .strategies import stack_for
from .summary import RunSummary, Window, summarize_run

_SIM_KEYS: Final = (
    "generation_tokens",
    "aborted_generation_tokens",
    "prefill_tokens_computed",
    "aborted_prefill_tokens",
    "finished_requests",
    "aborted_requests",
    "requests_added",
    "preemptions",
    "busy_s",
)
_ENVOY_STATS: Final = (
    "upstream_rq_total",
    "upstream_rq_pending_total",
    "upstream_rq_pending_overflow",
    "upstream_rq_cancelled",
    "upstream_rq_503",
)


async def _snapshot(
    session: aiohttp.ClientSession, strategy: Strategy, stack: Stack
) -> dict[str, float]:
    """The counters of the run, flat: ``sim.*``, ``sidecar.<bucket>/<outcome>``, ``envoy.*``."""
    out: dict[str, float] = {}
    timeout = aiohttp.ClientTimeout(total=10)
    async with session.get(f"{stack.backend_url}/sim/stats", timeout=timeout) as r:
        stats = await r.json()
    for key in _SIM_KEYS:
        out[f"sim.{key}"] = float(stats.get(key, 0.0))
    out["sim.lag_s_max"] = float(stats.get("lag_s_max", 0.0))
    out["sim.lag_s_mean"] = float(stats.get("lag_s_mean", 0.0))
    for gauge in ("num_requests_running", "num_requests_waiting"):
        out[f"gauge.{gauge}"] = float(stats.get(gauge, 0.0))
    if strategy == "sidecar":
        async with session.get(stack.metrics_url, timeout=timeout) as r:
            text = await r.text()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "llm_extproc_requests_total":
                    key = f"sidecar.{s.labels.get('bucket')}/{s.labels.get('outcome')}"
                    out[key] = out.get(key, 0.0) + s.value
    elif strategy == "envoy-cb":
        pattern = "^cluster\\.backend\\.(" + "|".join(_ENVOY_STATS) + ")$"
        url = f"http://127.0.0.1:{stack.admin_port}/stats"
        async with session.get(url, params={"filter": pattern}, timeout=timeout) as r:
            text = await r.text()
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if name.startswith("cluster.backend."):
                out["envoy." + name.removeprefix("cluster.backend.")] = float(value)
    return out


async def _drive(
    cfg: LoadConfig, strategy: Strategy, stack: Stack, window: Window
) -> tuple[LoadResult, list[dict[str, float]]]:
    """The load-generator run, with the counters snapshotted at its start and at the window's
    start and end."""
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as session:
        snaps = [await _snapshot(session, strategy, stack)]
        t0 = loop.time()
        load = asyncio.create_task(run_load(cfg))
        for edge in (window.start_s, window.end_s):
            await asyncio.sleep(max(0.0, t0 + edge / cfg.speedup - loop.time()))
            snaps.append(await _snapshot(session, strategy, stack))
        result = await load
    return result, snaps


def run_one(
    strategy: Strategy, load: float, cap: Capacity, opts: Options, log_dir: Path
) -> tuple[RunSummary, LoadResult]:
    """Fresh simulator (+ Envoy, + sidecar), one load-generator run, counters, teardown.

    Arrivals run 1 s past the window so the load is steady up to its end; then everything still
    open is cut (it resolves after the window and does not count)."""
    rate = load * cap.capacity_rps
    classes = opts.classes(rate)
    window = Window(start_s=opts.warmup_s, end_s=opts.duration_s)
    t0 = time.monotonic()
    with stack_for(strategy, cap, opts, log_dir) as stack:
        cfg = LoadConfig(
            url=stack.backend_url if strategy == "direct" else stack.url,
            classes=classes,
            duration_s=opts.duration_s + 1.0,
            max_requests=opts.max_requests,
            speedup=opts.speedup,
            seed=opts.seed,
            max_retries=opts.max_retries,
            traces_dir=opts.traces_dir,
            max_run_s=opts.duration_s + 1.0,
        )
        result, snaps = asyncio.run(_drive(cfg, strategy, stack, window))
    wall = time.monotonic() - t0
    return summarize_run(strategy, load, rate, result, snaps, window, opts, wall), result
