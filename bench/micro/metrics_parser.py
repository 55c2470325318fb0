"""The scraper's page parser against ``prometheus_client.parser``, on one vLLM-shaped page.

``python -m bench.micro.metrics_parser [--engines N] [--rounds N]``

The page is written by prometheus_client (as vLLM's is) from a registry with vLLM's families:
its gauges and counters, and its histograms with vLLM's bucket bounds, per (model, engine)
label set, with observations in every bucket. Both sides read the same five figures from it
(``extproc.backend.vllm.parse_metrics``'s), and must agree before anything is timed:

- ours: ``parse_metrics``, which parses only the lines of the families it reads;
- prometheus_client: ``text_string_to_metric_families`` (every family of the page), then the
  same sums and maxima over its samples.

Each side is timed ``--rounds`` times in turn, the two interleaved so that a busy machine slows
both alike; the figure is the median time per page, and the ratio is of the medians.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from importlib.metadata import version

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from extproc.backend.vllm import EndpointSample, parse_metrics

__all__ = ["main", "prometheus_client_read", "vllm_page"]

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
# vLLM's bucket bounds (vllm/v1/metrics/loggers.py); the token histograms' for an 8k model.
# fmt: off
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
         10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0)
_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
_ITERATION = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# fmt: on
_HISTOGRAMS = (
    ("vllm:time_to_first_token_seconds", _TTFT),
    ("vllm:inter_token_latency_seconds", _ITL),
    ("vllm:time_per_output_token_seconds", _ITL),
    ("vllm:request_time_per_output_token_seconds", _ITL),
    ("vllm:e2e_request_latency_seconds", _LATENCY),
    ("vllm:request_queue_time_seconds", _LATENCY),
    ("vllm:request_inference_time_seconds", _LATENCY),
    ("vllm:request_prefill_time_seconds", _LATENCY),
    ("vllm:request_decode_time_seconds", _LATENCY),
    ("vllm:request_prompt_tokens", _TOKENS),
    ("vllm:request_generation_tokens", _TOKENS),
    ("vllm:request_params_max_tokens", _TOKENS),
    ("vllm:request_max_num_generation_tokens", _TOKENS),
    ("vllm:iteration_tokens_total", _ITERATION),
    ("vllm:request_params_n", (1, 2, 5, 10, 20)),
)
_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
_COUNTERS = (
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
)


def vllm_page(engines: int, seed: int = 1) -> str:
    """A page with vLLM's families for ``engines`` label sets of one model, as prometheus_client
    writes it (with the ``_created`` samples a real page has)."""
    rng = random.Random(seed)
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    gauges = [Gauge(name, "g", labels, registry=registry) for name in _GAUGES]
    counters = [Counter(name, "c", labels, registry=registry) for name in _COUNTERS]
    success = Counter("vllm:request_success", "s", [*labels, "finished_reason"], registry=registry)
    histograms = [
        (Histogram(name, "h", labels, buckets=bounds, registry=registry), bounds)
        for name, bounds in _HISTOGRAMS
    ]
    for engine in map(str, range(engines)):
        for name, g in zip(_GAUGES, gauges, strict=True):
            g.labels(MODEL, engine).set(rng.random() if "perc" in name else rng.randint(0, 50))
        for c in counters:
            c.labels(MODEL, engine).inc(rng.randint(1, 10**6))
        for reason in ("stop", "length", "abort"):
            success.labels(MODEL, engine, reason).inc(rng.randint(1, 1000))
        for h, bounds in histograms:
            for bound in bounds:  # something in every bucket, so no count repeats
                for _ in range(rng.randint(1, 5)):
                    h.labels(MODEL, engine).observe(bound * rng.uniform(0.5, 1.0))
    return generate_latest(registry).decode()


def prometheus_client_read(page: str) -> EndpointSample:
    """``parse_metrics``'s figures, read with prometheus_client's parser."""
    sums: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            if s.name.endswith("_bucket"):
                hist = buckets.setdefault(s.name, {})
                le = float(s.labels["le"])
                hist[le] = hist.get(le, 0.0) + s.value
            elif s.name == "vllm:kv_cache_usage_perc":
                sums[s.name] = max(sums.get(s.name, 0.0), s.value)
            else:
                sums[s.name] = sums.get(s.name, 0.0) + s.value
    return EndpointSample(
        waiting=sums.get("vllm:num_requests_waiting"),
        running=sums.get("vllm:num_requests_running"),
        kv_usage=sums.get("vllm:kv_cache_usage_perc"),
        histograms={
            name: buckets[f"{family}_bucket"]
            for name, family in (
                ("ttft", "vllm:time_to_first_token_seconds"),
                ("itl", "vllm:inter_token_latency_seconds"),
            )
            if f"{family}_bucket" in buckets
        },
    )


def _time_per_call(read: Callable[[str], EndpointSample], page: str) -> float:
    t0 = time.perf_counter()
    read(page)
    return time.perf_counter() - t0


def _agree(a: EndpointSample, b: EndpointSample) -> bool:
    def close(x: float | None, y: float | None) -> bool:
        return x == y or (x is not None and y is not None and math.isclose(x, y))

    return (
        close(a.waiting, b.waiting)
        and close(a.running, b.running)
        and close(a.kv_usage, b.kv_usage)
        and all(a.histograms.get(n) == b.histograms.get(n) for n in ("ttft", "itl"))
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=3, help="label sets (default 3: ~100 KB)")
    parser.add_argument("--rounds", type=int, default=100, help="timed calls per side")
    args = parser.parse_args(argv)
    page = vllm_page(args.engines)
    ours, theirs = parse_metrics(page), prometheus_client_read(page)
    if "ttft" not in ours.histograms or not _agree(ours, theirs):
        raise SystemExit(f"the two parsers disagree:\n  ours   {ours}\n  theirs {theirs}")
    sides: dict[str, Callable[[str], EndpointSample]] = {
        "ours (extproc.backend.vllm.parse_metrics)": parse_metrics,
        f"prometheus_client {version('prometheus-client')} (text_string_to_metric_families)": (
            prometheus_client_read
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in sides}
    for read in sides.values():  # warm up
        read(page)
    for _ in range(args.rounds):
        for name, read in sides.items():
            times[name].append(_time_per_call(read, page))
    lines = page.count("\n")
    print(f"page: {len(page.encode()):,} bytes, {lines:,} lines, {args.engines} engine(s)")
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, median in medians.items():
        print(f"  {median * 1e3:8.2f} ms per page (median of {args.rounds})  {name}")
    ours_s, theirs_s = medians.values()
    print(f"  prometheus_client / ours: {theirs_s / ours_s:.0f}x")


if __name__ == "__main__":
    main()
