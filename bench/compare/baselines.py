"""The peers the sidecar is measured against, each defined here once: what it is, what it runs
with, and how ``compare.json`` shows its configuration (their names, in report order:
``options.BASELINES``). What each peer is: docs/benchmarks.md, "The strategies". The sidecar's
own strategies are in :mod:`.strategies`; :mod:`.deploy` starts either.

What the table there leaves out: the Envoy peers run no ext_proc. The two breaker peers'
upstream is HTTP/1.1, one request per connection, so ``max_requests`` requests run at once;
past the pending queue Envoy answers 503 (``x-envoy-overloaded``). The adaptive_concurrency
filter sits just before the router. ``priority-gateway``'s clients talk to it directly: it
proxies itself, and an Envoy in front would add a hop and CPU on a two-core host without
changing a single admission decision.
"""

from __future__ import annotations

import sys
from typing import Any, Final

from bench.common.stats import percentile

from .capacity import Capacity, workload_mix
from .options import Options

__all__ = [
    "ADAPTIVE_CONCURRENCY_FILTER",
    "adaptive_concurrency",
    "baseline_configs",
    "envoy_breakers",
    "envoy_default_breakers",
    "gateway_argv",
    "gateway_thresholds",
]

ADAPTIVE_CONCURRENCY_FILTER: Final = "envoy.filters.http.adaptive_concurrency"
ADAPTIVE_CONCURRENCY_TYPE: Final = (
    "type.googleapis.com/envoy.extensions.filters.http.adaptive_concurrency.v3.AdaptiveConcurrency"
)


def envoy_breakers(cap: Capacity, opts: Options) -> dict[str, int]:
    """Backend-cluster circuit breakers for ``envoy-cb``: C at once, a pending queue of about
    ``Options.cb_pending_s`` (2) seconds of backend throughput at C (like the sidecar's
    interactive queue)."""
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
    """Envoy's adaptive_concurrency filter (gradient controller) with the values of the example
    configuration in Envoy's docs (adaptive_concurrency_filter.rst, "Example Configuration",
    envoyproxy/envoy main); every other field at its default (buffer 25 %,
    max_concurrency_limit 1000, 503 when blocked). Older docs show the example without the two
    ``min_*`` fields, which Envoy 1.40 has: without them each minRTT measurement pins the limit
    to 3 until 50 requests have completed, which takes minutes with LLM streams.

    The two intervals are wall-clock, so they are divided by the speedup, as the sidecar's
    timers are. A request is sampled when its response ends: a stream counts until its last
    token."""
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


def gateway_thresholds(opts: Options) -> tuple[int, int]:
    """priority-gateway's "short" thresholds (prompt, max_tokens): the medians of the
    workload's mix, so that about the cheaper half of each dimension goes first."""
    mix = workload_mix(opts)
    prompt = round(percentile([r.prompt_tokens for r in mix], 50) or 0)
    output = round(percentile([r.output_tokens for r in mix], 50) or 0)
    return prompt, output


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


def baseline_configs(cap: Capacity, opts: Options) -> dict[str, Any]:
    """The configuration of each peer among ``opts.strategies``, as ``compare.json`` shows it
    (``direct`` has none)."""
    s = set(opts.strategies)
    out: dict[str, Any] = {}
    if "envoy-cb-default" in s:
        out["envoy-cb-default breakers"] = envoy_default_breakers(cap, opts)
    if "envoy-cb" in s:
        out["envoy-cb breakers"] = envoy_breakers(cap, opts)
    if "envoy-adaptive" in s:
        out["envoy-adaptive filter"] = adaptive_concurrency(opts.speedup)
    if "priority-gateway" in s:
        prompt, output = gateway_thresholds(opts)
        out["priority-gateway"] = {
            "workers": cap.concurrency,
            "short_prompt_below": prompt,
            "short_max_tokens_below": output,
            "queue_timeout_s": opts.queue_timeouts_s,
        }
    return out
