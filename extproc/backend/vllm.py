"""What is read from one vLLM endpoint's page: pure, a page in, an ``EndpointSample`` out.

Each family is summed over its label sets, since one server may run several models or
data-parallel engines: the gauges ``vllm:num_requests_waiting``, ``vllm:num_requests_running``
and ``vllm:kv_cache_usage_perc`` (older vLLM: ``vllm:gpu_cache_usage_perc``; a fraction, so its
max is taken rather than its sum), and the histograms ``vllm:time_to_first_token_seconds`` and
``vllm:inter_token_latency_seconds`` (older vLLM: ``vllm:time_per_output_token_seconds``; when a
version exposes both during the rename they carry the same observations, so only the new one
is read). A histogram is read from its ``_bucket`` samples: upper bound (``le``) -> cumulative
count, the counts of one bound summed over label sets.

Every value must be finite and not negative, and every bucket must have an ``le``; otherwise
``parse_metrics`` raises ValueError (as ``prometheus.samples`` does for a malformed line).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from extproc.backend.prometheus import label, samples

__all__ = ["EndpointSample", "parse_metrics"]

_WAITING = "vllm:num_requests_waiting"
_RUNNING = "vllm:num_requests_running"
_KV = "vllm:kv_cache_usage_perc"
_KV_OLD = "vllm:gpu_cache_usage_perc"
_TTFT = "vllm:time_to_first_token_seconds_bucket"
_ITL = "vllm:inter_token_latency_seconds_bucket"
_ITL_OLD = "vllm:time_per_output_token_seconds_bucket"
_WANTED = frozenset({_WAITING, _RUNNING, _KV, _KV_OLD, _TTFT, _ITL, _ITL_OLD})
_BUCKETS = frozenset({_TTFT, _ITL, _ITL_OLD})


@dataclass(frozen=True, slots=True, kw_only=True)
class EndpointSample:
    """One endpoint's page: each family summed over its label sets; None where absent.

    Histograms map a bucket's upper bound (``le``, +Inf included) to its cumulative count."""

    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    ttft: Mapping[float, float] | None = None
    itl: Mapping[float, float] | None = None


def parse_metrics(page: str | bytes) -> EndpointSample:
    """The families above from a Prometheus text page (bytes are read as UTF-8, undecodable
    bytes replaced); raises ValueError on a malformed sample of one of them (other lines are
    not looked at)."""
    if isinstance(page, bytes):
        page = page.decode("utf-8", errors="replace")
    sums: dict[str, float] = {}
    kv: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    for name, labels, value, line in samples(page, _WANTED):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"bad value {line[:60]!r}")
        if name in _BUCKETS:
            le = label(labels, "le")
            if le is None:
                raise ValueError(f"bucket without le {line[:60]!r}")
            bound = float(le)
            hist = buckets.setdefault(name, {})
            hist[bound] = hist.get(bound, 0.0) + value
        elif name in (_KV, _KV_OLD):
            kv[name] = max(kv.get(name, 0.0), value)
        else:
            sums[name] = sums.get(name, 0.0) + value
    return EndpointSample(
        waiting=sums.get(_WAITING),
        running=sums.get(_RUNNING),
        kv_usage=kv.get(_KV, kv.get(_KV_OLD)),
        ttft=buckets.get(_TTFT),
        itl=buckets.get(_ITL, buckets.get(_ITL_OLD)),
    )
