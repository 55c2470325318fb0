"""The clients of the replica strategies: one open-loop schedule spread over several gateways.

The schedule is the one a single load-generator run would send (``bench.load``'s
``build_schedule``, same classes, seed and cut), so every strategy still gets the identical
load. Request ``i`` of it, in arrival order, goes to gateway ``i mod n``: round robin per
request, as a load balancer in front of the replicas would do with equal weights. Each gateway
gets its share from its own ``run_load`` (its own connection pool), all of them on one event
loop, started together; a request's retries go back to the gateway that answered it (the
client keeps its connection; a real load balancer might send a retry elsewhere, which would
help the replicas that split the pool: their refusals are local). The records are merged back
into one :class:`~bench.load.summary.LoadResult` (:func:`merge_results`), so the rest of a run
does not know there were several.

The split and the merge are pure; :func:`run_spread` is the asyncio shell.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace

from bench.load.runner import LoadConfig, run_load
from bench.load.summary import LoadResult, summarize
from bench.load.workload import PlannedRequest

__all__ = ["merge_results", "round_robin", "run_spread"]


def round_robin(schedule: Sequence[PlannedRequest], n: int) -> list[list[PlannedRequest]]:
    """``n`` sub-schedules: request ``i`` (in arrival order) in the ``i mod n``-th, each kept in
    time order with the request's own index (the retry seeds and the records stay those of the
    single run)."""
    if n < 1:
        raise ValueError("need at least one gateway")
    ordered = sorted(schedule, key=lambda pr: (pr.t_s, pr.index))
    return [ordered[k::n] for k in range(n)]


def merge_results(cfg: LoadConfig, parts: Sequence[LoadResult]) -> LoadResult:
    """One result from the gateways' (``cfg``: the whole run's configuration): the records in
    index order, the summaries over all of them, the worst send lag, the longest run."""
    if not parts:
        raise ValueError("no results to merge")
    records = tuple(sorted((r for p in parts for r in p.records), key=lambda r: r.index))
    # As run_load does: the arrival window, unless the schedule was cut at max_requests.
    cut = len(records) >= cfg.max_requests and records
    window = records[-1].arrival_s if cut else cfg.duration_s
    names = [c.name for c in cfg.classes]
    return LoadResult(
        window_s=window,
        elapsed_s=max(p.elapsed_s for p in parts),
        speedup=cfg.speedup,
        seed=cfg.seed,
        loadgen_lag_s_max=max(p.loadgen_lag_s_max for p in parts),
        overall=summarize("all", records, window),
        per_class={n: summarize(n, [r for r in records if r.cls == n], window) for n in names},
        backend=None,
        records=records,
    )


async def run_spread(cfg: LoadConfig, urls: Sequence[str]) -> LoadResult:
    """The schedule of ``cfg`` sent round robin over ``urls`` (``cfg.url`` is not used)."""
    schedule = cfg.schedule()  # cut at max_requests, as run_load's
    parts = round_robin(schedule, len(urls))
    results = await asyncio.gather(
        *(
            run_load(replace(cfg, url=url, stats_url=None), part)
            for url, part in zip(urls, parts, strict=True)
        )
    )
    return merge_results(cfg, results)
