"""Prometheus metrics with vLLM's names, from a per-instance registry.

Gauges and counters are read from the engine at scrape time. Latency histograms are observed
by the engine in simulated seconds: TTFT when a request's first token is sampled (the end of the
step that finishes its prefill), e2e and queue time when it finishes, and one inter-token gap per
token after the first (end of its step minus the end of the step of its previous token), counted
per step in bulk (:class:`BulkHistogram`) since a step can give tokens to hundreds of requests.

Names, buckets and semantics are vLLM v1's (``vllm/v1/metrics/loggers.py``,
``PrometheusStatLogger``; ``vllm/v1/metrics/stats.py``, ``IterationStats``), among them
``vllm:request_time_per_output_token_seconds``: one observation per finished request, its decode
time (last token minus first) over its tokens after the first, 0 for a one-token answer
(``update_from_finished_request``), on the inter-token buckets.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import Final

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from .engine import SimEngine

# vLLM's bucket boundaries.
# fmt: off
TTFT_BUCKETS: Final = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                       5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
LATENCY_BUCKETS: Final = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                          50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITL_BUCKETS: Final = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                      5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# fmt: on
LABELS: Final = ("model_name", "engine")
# vLLM >= 0.9 name first; the older name (deprecated there) carries the same observations.
ITL_NAMES: Final = (
    ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
    ("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds."),
)


class BulkHistogram:
    """Histogram counts that take ``count`` equal observations in one call."""

    __slots__ = ("_les", "bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self._les = (*(repr(float(b)) for b in self.bounds), "+Inf")  # as prometheus_client
        self.counts = [0] * len(self._les)  # per bucket (not cumulative), the last one is +Inf
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += count  # a bucket is ``value <= le``
        self.count += count
        self.sum += value * count

    def cumulative(self) -> list[tuple[str, float]]:
        """(le, observations <= le) pairs, +Inf last, as Prometheus exposes them."""
        out: list[tuple[str, float]] = []
        total = 0
        for le, n in zip(self._les, self.counts, strict=True):
            total += n
            out.append((le, float(total)))
        return out


class _HistogramCollector(Collector):
    """Exposes one :class:`BulkHistogram` under each of ``names`` ((name, help) pairs)."""

    def __init__(
        self, hist: BulkHistogram, names: Sequence[tuple[str, str]], model_name: str
    ) -> None:
        self._hist = hist
        self._names = tuple(names)
        self._labels = [model_name, "0"]

    def collect(self) -> Iterable[Metric]:
        buckets = self._hist.cumulative()
        for name, doc in self._names:
            h = HistogramMetricFamily(name, doc, labels=LABELS)
            h.add_metric(self._labels, buckets, self._hist.sum)
            yield h


class _EngineCollector(Collector):
    """Exposes the engine's gauges and the core's counters at scrape time."""

    def __init__(self, engine: SimEngine, model_name: str) -> None:
        self._engine = engine
        self._labels = [model_name, "0"]

    def collect(self) -> Iterable[Metric]:
        engine = self._engine
        core = engine.core
        st = core.stats
        gauges = (
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                core.num_running,
            ),
            (
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
                core.num_waiting,
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                core.kv_usage,
            ),
            (
                "vllm_sim:engine_lag_seconds",
                (
                    "How late the last step's results were delivered (simulated s); "
                    "growing means the host cannot keep up with --speedup."
                ),
                engine.lag.current_s,
            ),
        )
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(self._labels, float(value))
            yield g
        counters = (
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", st.prompt_tokens),
            (
                "vllm:generation_tokens",
                "Number of generation tokens processed.",
                st.generation_tokens,
            ),
            ("vllm:num_preemptions", "Cumulative number of preemptions.", st.preemptions),
            (
                "vllm_sim:finished_requests",
                "Requests that generated all their tokens.",
                st.finished_requests,
            ),
            (
                "vllm_sim:aborted_requests",
                "Requests aborted because the client disconnected.",
                st.aborted_requests,
            ),
            (
                "vllm_sim:aborted_generation_tokens",
                "Tokens generated for requests that were later aborted (wasted decode work).",
                st.aborted_generation_tokens,
            ),
            (
                "vllm_sim:aborted_prefill_tokens",
                "Prefill tokens computed for requests later aborted (wasted prefill work).",
                st.aborted_prefill_tokens,
            ),
            (
                "vllm_sim:rejected_requests",
                "Requests rejected with a 4xx error.",
                engine.rejected_requests,
            ),
            ("vllm_sim:busy_seconds", "Simulated GPU busy time.", st.busy_s),
        )
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(self._labels, float(value))
            yield c


def make_registry(engine: SimEngine, model_name: str) -> CollectorRegistry:
    """A fresh registry with the engine's metrics; wires the latency histograms into the engine."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_EngineCollector(engine, model_name))
    hists = {
        "ttft": Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            LABELS,
            buckets=TTFT_BUCKETS,
            registry=registry,
        ),
        "e2e": Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            LABELS,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        ),
        "tpot": Histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            LABELS,
            buckets=ITL_BUCKETS,
            registry=registry,
        ),
        "queue": Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase.",
            LABELS,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        ),
    }
    engine.ttft_hist = hists["ttft"].labels(model_name, "0")
    engine.e2e_hist = hists["e2e"].labels(model_name, "0")
    engine.queue_hist = hists["queue"].labels(model_name, "0")
    engine.tpot_hist = hists["tpot"].labels(model_name, "0")
    engine.itl_hist = BulkHistogram(ITL_BUCKETS)
    registry.register(_HistogramCollector(engine.itl_hist, ITL_NAMES, model_name))
    return registry
