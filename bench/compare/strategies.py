"""The configurations of the strategies and the processes each one runs.

============================ ===============================================================
``direct``                   the simulator alone
``envoy-cb-default``         Envoy, backend breakers at the engine's ``max_num_seqs``
``envoy-cb``                 Envoy, backend breakers at the model's C (:func:`envoy_breakers`)
``envoy-adaptive``           Envoy's adaptive_concurrency filter (:func:`adaptive_concurrency`)
``priority-gateway``         :mod:`bench.gateway` in front of the simulator, C workers
``sidecar-static``           Envoy + the sidecar, fixed slots per bucket (:func:`sidecar_policy`)
``sidecar``                  Envoy + the sidecar, one adaptive pool (:func:`pool_policy`)
``replicas-shared``          3 x (Envoy + sidecar), one static pool of C through Redis
``replicas-full``            3 x (Envoy + sidecar), each a pool of C (3C in all)
``replicas-split``           3 x (Envoy + sidecar), each a pool of C / 3
============================ ===============================================================

The replica strategies (:func:`replica_policies`, not in the default list) put
``Options.replicas`` gateways (``testing.gateways.Gateways``: Envoy + sidecar each) in front of
one simulator; the clients spread their requests over the gateways' listeners
(:mod:`.spread`). Their pools are the ``sidecar`` strategy's buckets without the adaptive limit,
so the three differ only in each replica's limit and in whether the replicas share it.

Every Envoy with the sidecar runs with what ``extproc.config.envoy.render(policy)`` derives
from its policy (:func:`policy_envoy_patch`): the shipped envoy/envoy.yaml is written for the
default policy, whose longest queue is 120 s, so a longer queue deadline would otherwise be cut
by Envoy's ``max_message_timeout`` (121 s) with a 504 after the 1 s message timeout.
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from extproc.config.envoy import EXT_PROC_FILTER, render
from extproc.config.policy import policy_from_yaml
from testing.gateways import Gateways
from testing.stack import Proc, Stack, free_port, wait_http

from .capacity import Capacity, workload_mix
from .options import REPLICA_STRATEGIES, SIDECAR_STRATEGIES, Options, Strategy, backend_argv

__all__ = [
    "ADAPTIVE_CONCURRENCY_FILTER",
    "Deployment",
    "adaptive_concurrency",
    "deploy",
    "envoy_breakers",
    "envoy_default_breakers",
    "gateway_argv",
    "gateway_thresholds",
    "policy_envoy_patch",
    "pool_policy",
    "replica_limits",
    "replica_policies",
    "replica_pool_policy",
    "sidecar_policy",
    "slot_split",
    "with_http_filter",
]

EnvoyPatch = Callable[[dict[str, Any]], None]
ADAPTIVE_CONCURRENCY_FILTER: Final = "envoy.filters.http.adaptive_concurrency"
ADAPTIVE_CONCURRENCY_TYPE: Final = (
    "type.googleapis.com/envoy.extensions.filters.http.adaptive_concurrency.v3.AdaptiveConcurrency"
)
ROUTER_FILTER: Final = "envoy.filters.http.router"
# replicas-shared: where its policy names Redis (testing.gateways.Gateways fills it in).
REDIS_PLACEHOLDER: Final = "{redis}"
SHARED_KEY_PREFIX: Final = "bench-compare"


def slot_split(cap: Capacity) -> dict[str, int]:
    """C slots split between the buckets in proportion to each class's mean in-flight count at C
    (Little's law), so that under overload each class keeps its share of the backend."""
    fl = cap.at_concurrency.in_flight
    total = sum(fl.values()) or 1.0
    batch = max(1, round(cap.concurrency * fl.get("batch", 0.0) / total))
    batch = min(batch, cap.concurrency - 1) if cap.concurrency > 1 else 1
    return {"interactive": max(1, cap.concurrency - batch), "batch": batch}


def _duration(sim_s: float, speedup: float) -> str:
    """A policy duration: simulated seconds on the wall clock, whole milliseconds."""
    return f"{max(1, round(1000 * sim_s / speedup))}ms"


def _common_policy(opts: Options) -> str:
    """Tokens, limits and Retry-After: the same in both sidecar policies. The output cap is
    above every request of the mix, so nothing is clamped and all strategies do the same work."""
    max_len = opts.engine.max_model_len
    max_output = 2048 if opts.mix == "default" else 4096
    return f"""\
tokens:
  chars_per_token: 4.0
limits:
  max_prompt_tokens: {max_len}
  default_max_tokens: 256
  max_output_tokens: {max_output}
  on_excess: clamp
retry_after: {{min: 1s, max: 60s}}   # not scaled: see "Time" in bench/compare/__init__.py
"""


def sidecar_policy(cap: Capacity, opts: Options) -> str:
    """``sidecar-static``'s policy (YAML) for this backend and these clients.

    * buckets: ``interactive`` by header, everything else ``batch``; slots from
      :func:`slot_split`; no length conditions in ``match`` (the class is the client's);
    * ``queue_timeout``: interactive ``--interactive-queue-timeout`` (default 1 s: of a 2 s
      TTFT objective, 1 s in the queue and 1 s for the backend's own TTFT, the ``sidecar``
      pool's p90 objective; past it, 429 + Retry-After. The first runs used 1.5 s: measured,
      1 s gave the pool 15-35 % more SLO goodput at the same good req/s); batch
      ``--batch-queue-frac`` x its client timeout (default 80 %: a batch request admitted at its
      deadline still has a fifth of its timeout to run, far more than its p99 service time at C);
    * ``max_queue`` (``--queue-bound``): ``drain`` (default) bounds each queue by what its
      slots can admit before the deadline (Little's law: slots / mean hold at C x deadline), so
      the surplus is refused at once instead of after waiting the whole deadline; ``deadline``
      makes it large (2000 / 5000), so the deadline, not the bound, decides who is refused
      (the first design: measured worse, see docs/benchmarks.md);
    * limits: prompts above the simulator's ``max_model_len`` get 413 at the door.
    """
    slots = slot_split(cap)
    qt = opts.queue_timeouts_s
    s = opts.speedup
    max_queue = {"interactive": 2000, "batch": 5000}
    if opts.queue_bound == "drain":
        point = cap.at_concurrency
        for name in max_queue:
            hold_s = point.in_flight.get(name, 0.0) / max(point.class_rps.get(name, 0.0), 1e-9)
            max_queue[name] = max(1, math.ceil(slots[name] / max(hold_s, 1e-9) * qt[name]))
    return f"""\
# Generated by bench.compare for the {opts.profile} profile at speedup {s:g}: queue deadlines are
# wall-clock, so each is (simulated seconds) / {s:g}. C = {cap.concurrency} slots in all.
{_common_policy(opts)}buckets:
  - name: interactive
    match: {{headers: {{x-llm-class: interactive}}}}
    max_concurrency: {slots["interactive"]}
    queue_timeout: {_duration(qt["interactive"], s)}   # {qt["interactive"]:g} s simulated
    max_queue: {max_queue["interactive"]}
  - name: batch
    max_concurrency: {slots["batch"]}
    queue_timeout: {_duration(qt["batch"], s)}   # {qt["batch"]:g} s simulated
    max_queue: {max_queue["batch"]}
"""


def _pool_buckets(opts: Options) -> str:
    """The buckets of every pool policy here (``sidecar`` and the replica strategies):
    interactive guaranteed half the pool, cheapest first; its retries (the SDK's
    ``x-stainless-retry-count`` above 0) in a band of their own behind its first attempts; batch
    in the least urgent band, cheapest first."""
    qt, s = opts.queue_timeouts_s, opts.speedup
    return f"""\
buckets:
  - name: interactive-retry      # a retry has already waited; first attempts can still start fast
    match: {{headers: {{x-llm-class: interactive}}, retried: true}}
    priority: 1
    order: cost
    queue_timeout: {_duration(qt["interactive"], s)}   # {qt["interactive"]:g} s simulated
    max_queue: 2000
  - name: interactive
    match: {{headers: {{x-llm-class: interactive}}}}
    priority: 0
    min_share: 0.5
    order: cost
    queue_timeout: {_duration(qt["interactive"], s)}   # {qt["interactive"]:g} s simulated
    max_queue: 2000
  - name: batch
    priority: 10
    max_share: 0.9
    order: cost
    queue_timeout: {_duration(qt["batch"], s)}   # {qt["batch"]:g} s simulated
    max_queue: 5000
"""


def pool_policy(cap: Capacity, opts: Options, metrics_urls: list[str]) -> str:
    """``sidecar``'s policy: one pool whose limit the sidecar reads from the simulators' own
    metrics against latency objectives. Nothing here comes from the capacity model but the
    static fallback ``max_concurrency`` (C), used only while the metrics are stale.

    Time: the sidecar's timers (queue deadlines, scrape interval, windows, holds) run on the
    wall clock and are written as simulated / speedup; the objectives are compared with the
    simulator's histograms, which are in simulated seconds, so they are written as they are.
    Deadlines are the same as ``sidecar-static``'s (``--interactive-queue-timeout``,
    ``--batch-queue-frac``).
    """
    s = opts.speedup
    urls = ", ".join(f'"{u}"' for u in metrics_urls)
    return f"""\
# Generated by bench.compare for the {opts.profile} profile at speedup {s:g}: timers are
# wall-clock ((simulated seconds) / {s:g}); the SLOs are simulated seconds (the simulator's
# histograms are). max_concurrency is only the fallback while the metrics are stale.
{_common_policy(opts)}pool:
  max_concurrency: {cap.concurrency}
  fail_fast: true
  adaptive:
    min: 8
    max: {opts.engine.max_num_seqs}
    initial: 32
    slo: {{ttft: 1s, ttft_quantile: 0.9, inter_token: 100ms, inter_token_quantile: 0.9}}
    interval: {_duration(0.5, s)}
    window: {_duration(10.0, s)}
    max_kv_usage: 0.9
  overload: {{tighten_eviction_rate: 0.05, step_hold: {_duration(120.0, s)}, \
window: {_duration(30.0, s)}}}
backend:
  metrics: [{urls}]
{_pool_buckets(opts)}"""


def replica_limits(strategy: Strategy, cap: Capacity, opts: Options) -> list[int]:
    """Each replica's ``pool.max_concurrency``: C for ``replicas-shared`` (the pool's limit,
    all replicas together) and ``replicas-full`` (each replica the whole pool: what replicas
    configured from one backend's capacity admit today, ``replicas`` x C in all); for
    ``replicas-split`` C / ``replicas``, the remainder to the first replicas, so the limits add
    up to C (as the shared pool's local shares do, ``extproc.pool.shared.leases``)."""
    n, c = opts.replicas, cap.concurrency
    if strategy == "replicas-split":
        return [max(1, c // n + (1 if i < c % n else 0)) for i in range(n)]
    if strategy in ("replicas-shared", "replicas-full"):
        return [c] * n
    raise ValueError(f"{strategy!r} is not a replica strategy")


def _shared_lease_s(opts: Options) -> float:
    """The shared pool's lease: 10 s, the policy's default, as simulated seconds on the wall
    clock, no shorter than the 500 ms the policy allows."""
    return max(0.5, 10.0 / opts.speedup)


def replica_pool_policy(opts: Options, *, limit: int, shared: bool) -> str:
    """One replica's policy: the ``sidecar`` strategy's pool (:func:`pool_policy`: the same
    buckets, priorities, shares, cost order, deadlines, queue bounds and overload steps) with
    a static ``max_concurrency`` of ``limit`` instead of the adaptive limit, and no backend
    metrics (nothing reads them without it).

    ``shared``: the pool is ``pool.shared`` through Redis (:data:`REDIS_PLACEHOLDER` in place
    of its URL): ``limit`` is then the pool's, all replicas together. The lease is 10 s scaled
    by the speedup (``lease / 3`` between renewals, as at speedup 1 per simulated second); the
    Redis call timeout is a network deadline, not scaled: 250 ms (the policy's default), at
    most a quarter of the lease. ``fail_fast`` is off in every replica strategy: shared mode
    turns it off (a local release rate says nothing about the pool's), so it is off in the
    other two too, and the three differ only in the limit and the sharing.
    """
    s = opts.speedup
    lease_s = _shared_lease_s(opts)
    timeout_ms = max(1, round(1000 * min(0.25, lease_s / 4)))
    shared_line = (
        f'  shared: {{redis: "{REDIS_PLACEHOLDER}", key_prefix: {SHARED_KEY_PREFIX}, '
        f"lease: {round(1000 * lease_s)}ms, timeout: {timeout_ms}ms, replicas: {opts.replicas}}}\n"
        if shared
        else ""
    )
    what = (
        f"one pool of {limit} shared by {opts.replicas} replicas through Redis"
        if shared
        else f"this replica's own pool of {limit}, shared with nobody"
    )
    return f"""\
# Generated by bench.compare for the {opts.profile} profile at speedup {s:g}: {what}.
# Timers are wall-clock ((simulated seconds) / {s:g}).
{_common_policy(opts)}pool:
  max_concurrency: {limit}
  fail_fast: false
{shared_line}  overload: {{tighten_eviction_rate: 0.05, step_hold: {_duration(120.0, s)}, \
window: {_duration(30.0, s)}}}
{_pool_buckets(opts)}"""


def replica_policies(strategy: Strategy, cap: Capacity, opts: Options) -> list[str]:
    """The policy of each of the ``opts.replicas`` gateways of a replica strategy
    (:func:`replica_limits`, :func:`replica_pool_policy`)."""
    shared = strategy == "replicas-shared"
    return [
        replica_pool_policy(opts, limit=limit, shared=shared)
        for limit in replica_limits(strategy, cap, opts)
    ]


def envoy_breakers(cap: Capacity, opts: Options) -> dict[str, int]:
    """Backend-cluster circuit breakers for ``envoy-cb``: C at once, a pending queue of about
    ``--cb-pending-s`` seconds of backend throughput at C (like the sidecar's interactive queue)."""
    pending = max(1, round(cap.at_concurrency.throughput_rps * opts.cb_pending_s))
    return {
        "max_connections": cap.concurrency,
        "max_requests": cap.concurrency,
        "max_pending_requests": pending,
        "max_retries": 3,
    }


def envoy_default_breakers(cap: Capacity, opts: Options) -> dict[str, int]:
    """``envoy-cb-default``: what an operator sets without a model of the backend, the engine's
    own ``max_num_seqs`` (HTTP/1.1 upstream: one request per connection), the same pending
    queue as ``envoy-cb``."""
    return {
        **envoy_breakers(cap, opts),
        "max_connections": opts.engine.max_num_seqs,
        "max_requests": opts.engine.max_num_seqs,
    }


def adaptive_concurrency(speedup: float) -> dict[str, Any]:
    """Envoy's adaptive_concurrency filter with the gradient controller, with the values of the
    example configuration in Envoy's docs (docs/root/configuration/http/http_filters/
    adaptive_concurrency_filter.rst, "Example Configuration", envoyproxy/envoy main): p90 of the
    samples, the limit updated every 100 ms and never below 25 (``min_concurrency_limit``, which
    Envoy 1.40 has: with it set, the minRTT is measured from live traffic instead of pinning
    the limit to ``min_concurrency``), the minRTT recalculated every 60 s with 10 % jitter over
    50 requests; every other field at its default (buffer 25 %, max_concurrency_limit 1000,
    503 when blocked). Older docs show the same example without the two ``min_*`` fields;
    without them each minRTT measurement pins the limit to 3 until 50 requests have completed,
    which takes minutes with LLM streams.

    Its two intervals are wall-clock and tuned for a real backend: they are divided by the
    speedup, so the controller acts as often per *simulated* second as it would at speedup 1
    (as the sidecar's timers are). Its latency samples are whole requests (it samples when the
    response ends, so a stream counts until its last token)."""
    return {
        "name": ADAPTIVE_CONCURRENCY_FILTER,
        "typed_config": {
            "@type": ADAPTIVE_CONCURRENCY_TYPE,
            "gradient_controller_config": {
                "sample_aggregate_percentile": {"value": 90},
                "concurrency_limit_params": {
                    "concurrency_update_interval": f"{0.1 / speedup:.6f}s",
                    "min_concurrency_limit": 25,
                },
                "min_rtt_calc_params": {
                    "min_concurrency": 50,
                    "jitter": {"value": 10},
                    "interval": f"{60.0 / speedup:.6f}s",
                    "request_count": 50,
                },
            },
            "enabled": {"default_value": True, "runtime_key": "adaptive_concurrency.enabled"},
        },
    }


def _hcms(cfg: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for listener in cfg["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                yield f["typed_config"]


def with_http_filter(http_filter: dict[str, Any]) -> EnvoyPatch:
    """An ``envoy_patch`` that puts ``http_filter`` just before the router."""

    def patch(cfg: dict[str, Any]) -> None:
        for hcm in _hcms(cfg):
            chain = hcm["http_filters"]
            at = [f["name"] for f in chain].index(ROUTER_FILTER)
            chain.insert(at, copy.deepcopy(http_filter))

    return patch


def policy_envoy_patch(policy_yaml: str) -> EnvoyPatch:
    """An ``envoy_patch`` that gives Envoy what ``render(policy)`` derives from this policy:
    ext_proc's ``max_message_timeout`` (the longest queue deadline + 1 s), the HCM's
    ``stream_idle_timeout``, the LLM routes' ``timeout`` and the sidecar cluster's circuit
    breakers (one stream per queued or running request)."""
    rendered = render(policy_from_yaml(policy_yaml, source="bench.compare"))
    (ext_proc,) = [f for f in rendered["http_filters"] if f["name"] == EXT_PROC_FILTER]
    (sidecar_cluster,) = rendered["clusters"]
    idle = rendered["http_connection_manager"]["stream_idle_timeout"]
    route_timeout = rendered["llm_routes"]["timeout"]

    def patch(cfg: dict[str, Any]) -> None:
        for hcm in _hcms(cfg):
            hcm["stream_idle_timeout"] = idle
            for f in hcm["http_filters"]:
                if f["name"] == EXT_PROC_FILTER:
                    f["typed_config"]["max_message_timeout"] = ext_proc["typed_config"][
                        "max_message_timeout"
                    ]
            for vhost in hcm["route_config"]["virtual_hosts"]:
                for route in vhost["routes"]:
                    # The LLM routes are those the sidecar sees (no per-route ext_proc off).
                    if EXT_PROC_FILTER not in route.get("typed_per_filter_config", {}):
                        route["route"]["timeout"] = route_timeout
        for cluster in cfg["static_resources"]["clusters"]:
            if cluster["name"] == sidecar_cluster["name"]:
                cluster["circuit_breakers"] = copy.deepcopy(sidecar_cluster["circuit_breakers"])

    return patch


def gateway_thresholds(opts: Options) -> tuple[int, int]:
    """priority-gateway's "short" thresholds (prompt, max_tokens): the options', else the
    medians of the workload's mix, so that about the cheaper half of each dimension goes
    first."""
    if opts.gateway_short_prompt is not None and opts.gateway_short_output is not None:
        return opts.gateway_short_prompt, opts.gateway_short_output
    mix = workload_mix(opts)
    prompt = round(statistics.median(r.prompt_tokens for r in mix))
    output = round(statistics.median(r.output_tokens for r in mix))
    return opts.gateway_short_prompt or prompt, opts.gateway_short_output or output


def gateway_argv(cap: Capacity, opts: Options, port: int, upstreams: list[str]) -> list[str]:
    """The gateway's command line: C workers (the same C as envoy-cb and sidecar-static), the
    sidecar's queue deadlines per class (wall-clock), no other knowledge of the backend."""
    prompt, output = gateway_thresholds(opts)
    qt = opts.queue_timeouts_s
    s = opts.speedup
    argv = [
        sys.executable,
        "-m",
        "bench.gateway",
        "--port",
        str(port),
        "--workers",
        str(cap.concurrency),
        "--short-prompt",
        str(prompt),
        "--short-output",
        str(output),
        "--queue-timeout",
        f"{qt['batch'] / s:.6g}",
        "--class-queue-timeout",
        f"interactive={qt['interactive'] / s:.6g}",
    ]
    for url in upstreams:
        argv += ["--upstream", url]
    return argv


@dataclass(frozen=True, slots=True, kw_only=True)
class Deployment:
    """A running strategy: where the clients go, and where its counters are read. The replica
    strategies have several of each gateway URL: the clients spread their requests over
    ``urls`` (:mod:`.spread`), and the counters are summed over the sidecars and Envoys."""

    strategy: Strategy
    urls: tuple[str, ...]
    backend_urls: tuple[str, ...]
    sidecar_metrics_urls: tuple[str, ...] = ()
    envoy_admin_urls: tuple[str, ...] = ()
    gateway_url: str | None = None

    @property
    def url(self) -> str:
        """The (first) gateway's URL."""
        return self.urls[0]


@contextlib.contextmanager
def deploy(strategy: Strategy, cap: Capacity, opts: Options, log_dir: Path) -> Iterator[Deployment]:
    """Start a strategy's processes (their logs, Envoy config and policy in ``log_dir``), yield
    where to reach them, stop them all."""
    log_dir.mkdir(parents=True, exist_ok=True)
    if strategy in REPLICA_STRATEGIES:
        with _deploy_replicas(strategy, cap, opts, log_dir) as dep:
            yield dep
        return
    common: dict[str, Any] = {"backend_argv": backend_argv(opts), "log_dir": log_dir}
    if strategy in ("direct", "priority-gateway"):
        stack = Stack(**common, start_sidecar=False, start_envoy=False)
    elif strategy in ("envoy-cb-default", "envoy-cb", "envoy-adaptive"):
        breakers = {
            "envoy-cb-default": envoy_default_breakers(cap, opts),
            "envoy-cb": envoy_breakers(cap, opts),
            "envoy-adaptive": None,  # envoy.yaml's own, out of the filter's way
        }[strategy]
        patch = with_http_filter(adaptive_concurrency(opts.speedup))
        stack = Stack(
            **common,
            start_sidecar=False,
            ext_proc=False,
            backend_circuit_breakers=breakers,
            envoy_patch=patch if strategy == "envoy-adaptive" else None,
        )
    else:
        # The ports are chosen when the Stack is built, so the pool policy can name the
        # simulators' metrics before anything starts.
        stack = Stack(**common, policy_path=log_dir / "policy.yaml")
        metrics = [f"{u}/metrics" for u in stack.backend_urls]
        text = (
            pool_policy(cap, opts, metrics) if strategy == "sidecar" else sidecar_policy(cap, opts)
        )
        (log_dir / "policy.yaml").write_text(text)
        stack.envoy_patch = policy_envoy_patch(text)
    with stack:
        backends = tuple(stack.backend_urls)
        if strategy == "direct":
            yield Deployment(strategy=strategy, urls=(stack.backend_url,), backend_urls=backends)
        elif strategy == "priority-gateway":
            port = free_port()
            proc = Proc("gateway", gateway_argv(cap, opts, port, list(backends)), log_dir)
            try:
                url = f"http://127.0.0.1:{port}"
                try:
                    wait_http(f"{url}/health", proc=proc)
                except BaseException:
                    print(f"----- gateway log -----\n{proc.log_text()[-4000:]}", file=sys.stderr)
                    raise
                yield Deployment(
                    strategy=strategy, urls=(url,), backend_urls=backends, gateway_url=url
                )
            finally:
                proc.stop()
        else:
            yield Deployment(
                strategy=strategy,
                urls=(stack.url,),
                backend_urls=backends,
                sidecar_metrics_urls=(stack.metrics_url,) if strategy in SIDECAR_STRATEGIES else (),
                envoy_admin_urls=(f"http://127.0.0.1:{stack.admin_port}",),
            )


@contextlib.contextmanager
def _deploy_replicas(
    strategy: Strategy, cap: Capacity, opts: Options, log_dir: Path
) -> Iterator[Deployment]:
    """``opts.replicas`` gateways in front of one simulator (``testing.gateways.Gateways``:
    the simulator, then each Envoy + sidecar; a redis-server first for ``replicas-shared``).

    Every Envoy gets what ``render(policy)`` derives from the first replica's policy, the
    largest (:func:`replica_limits` gives the remainder to the first): the deadlines are the
    same in all, and the sidecar cluster's breakers are upper bounds."""
    policies = replica_policies(strategy, cap, opts)
    # render() checks the Redis URL: any well-formed one will do, the patch does not hold it.
    patch = policy_envoy_patch(policies[0].replace(REDIS_PLACEHOLDER, "redis://127.0.0.1:6379/0"))
    with Gateways(
        opts.replicas,
        policies[0] if len(set(policies)) == 1 else policies,  # one policy.yaml if one will do
        log_dir,
        backend_argv=backend_argv(opts),
        envoy_patch=patch,
        start_redis=strategy == "replicas-shared",
    ) as g:
        yield Deployment(
            strategy=strategy,
            urls=tuple(g.urls),
            backend_urls=(g.backend_url,),
            sidecar_metrics_urls=tuple(st.metrics_url for st in g.stacks),
            envoy_admin_urls=tuple(f"http://127.0.0.1:{st.admin_port}" for st in g.stacks),
        )
