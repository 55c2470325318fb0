"""The clients of the replica strategies: one open-loop schedule spread over several gateways.

The schedule is the one a single load-generator run would send (``bench.load``'s
``build_schedule``, same classes, seed and cut), so every strategy still gets the identical
load. Two spreads (``--spread``):

``request`` (:func:`round_robin`)
    Request ``i`` of it, in arrival order, goes to gateway ``i mod n``: round robin per
    request, as a load balancer in front of the replicas would do with equal weights. Every
    replica sees every tenant, each at a third of its rate.
``tenant`` (:func:`by_tenant`)
    Every request of a tenant goes to one gateway, picked by a hash of the tenant's name alone
    (:func:`tenant_gateway`), as Envoy's hash policy on ``x-tenant-id`` would route them: the
    uneven case, where the heavy tenant's queue lives on one replica with whichever light
    tenants hash there. A tenant's gateway does not depend on the other tenants, so the light
    tenants land on the same gateways with and without the heavy one (the noisy scenario's
    reference). Requests without a tenant go round robin.

Each gateway
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
import hashlib
from collections.abc import Sequence
from dataclasses import replace

from bench.load.runner import LoadConfig, run_load
from bench.load.summary import LoadResult, summarize
from bench.load.workload import PlannedRequest

from .options import Spread

__all__ = ["by_tenant", "merge_results", "round_robin", "run_spread", "tenant_gateway"]


def round_robin(schedule: Sequence[PlannedRequest], n: int) -> list[list[PlannedRequest]]:
    """``n`` sub-schedules: request ``i`` (in arrival order) in the ``i mod n``-th, each kept in
    time order with the request's own index (the retry seeds and the records stay those of the
    single run)."""
    if n < 1:
        raise ValueError("need at least one gateway")
    ordered = sorted(schedule, key=lambda pr: (pr.t_s, pr.index))
    return [ordered[k::n] for k in range(n)]


def tenant_gateway(tenant: str, n: int) -> int:
    """The gateway of every request of ``tenant``, of ``n``: SHA-256 of its name, mod ``n``
    (stable across processes and Python versions, unlike ``hash()``)."""
    if n < 1:
        raise ValueError("need at least one gateway")
    return int.from_bytes(hashlib.sha256(tenant.encode()).digest()[:8], "big") % n


def by_tenant(schedule: Sequence[PlannedRequest], n: int) -> list[list[PlannedRequest]]:
    """``n`` sub-schedules: each tenant's requests in its :func:`tenant_gateway`'s, the
    requests without a tenant round robin among themselves; each kept in time order."""
    untagged = round_robin([pr for pr in schedule if pr.tenant is None], n)
    for pr in sorted(schedule, key=lambda pr: (pr.t_s, pr.index)):
        if pr.tenant is not None:
            untagged[tenant_gateway(pr.tenant, n)].append(pr)
    return [sorted(part, key=lambda pr: (pr.t_s, pr.index)) for part in untagged]


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


async def run_spread(
    cfg: LoadConfig, urls: Sequence[str], spread: Spread = "request"
) -> LoadResult:
    """The schedule of ``cfg`` sent over ``urls`` as ``spread`` says (``cfg.url`` is not
    used)."""
    schedule = cfg.schedule()  # cut at max_requests, as run_load's
    parts = (round_robin if spread == "request" else by_tenant)(schedule, len(urls))
    results = await asyncio.gather(
        *(
            run_load(replace(cfg, url=url, stats_url=None), part)
            for url, part in zip(urls, parts, strict=True)
        )
    )
    return merge_results(cfg, results)
