"""What is read from one vLLM endpoint's page: pure, a page in, an ``EndpointSample`` out.

Each family is summed over its label sets, since one server may run several models or
data-parallel engines: the gauges ``vllm:num_requests_waiting``, ``vllm:num_requests_running``
and ``vllm:kv_cache_usage_perc`` (older vLLM: ``vllm:gpu_cache_usage_perc``; a fraction, so its
max is taken rather than its sum), and the histogram of each latency objective
(``extproc.objectives``: a row's ``family``, or its ``old`` name where ``family`` is
absent; an objective's family absent in a version leaves it out of ``histograms``). A
histogram is read from its ``_bucket`` samples: upper bound (``le``) -> cumulative count, the
counts of one bound summed over label sets.

A page is an endpoint's word, checked before it can move the limit; ``parse_metrics`` raises
ValueError (as ``prometheus.samples`` does for a malformed line, or for a page over
``prometheus.MAX_LINES`` lines of these families), and the endpoint counts as failed, when:

1. a value is not finite, is negative, or is above ``MAX_VALUE`` (2**53: counts beyond it are
   no longer whole numbers, and sums of them could overflow to infinity);
2. a bucket has no ``le``, or one that is not a number >= 0 (``NaN`` would make every
   quantile NaN, which no objective compares with, and freeze the limit; a negative bound
   would read as a latency below zero and let it grow);
3. one series (a label set without its ``le``) gives a bound twice, or its cumulative counts
   fall as the bound rises;
4. one histogram has more than ``MAX_BOUNDS`` (64) distinct bounds over its label sets: the
   windows keep every bound of every endpoint for ``window``. vLLM's have 23 and 20.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from extproc.backend.prometheus import samples, split_label
from extproc.objectives import OBJECTIVES

__all__ = ["FAMILIES", "MAX_BOUNDS", "MAX_VALUE", "EndpointSample", "parse_metrics"]

MAX_VALUE = float(2**53)
MAX_BOUNDS = 64

_WAITING = "vllm:num_requests_waiting"
_RUNNING = "vllm:num_requests_running"
_KV = "vllm:kv_cache_usage_perc"
_KV_OLD = "vllm:gpu_cache_usage_perc"
# vLLM's own admission cap (--max-num-queued-reqs / tokens): requests it refused, by reason.
_REFUSED = "vllm:admission_rejections_total"
# Each objective's bucket families, the first one present read.
_READ = {o.name: [f"{f}_bucket" for f in (o.family, o.old) if f] for o in OBJECTIVES}
_BUCKETS = frozenset(f for families in _READ.values() for f in families)
# The families read.
FAMILIES = frozenset({_WAITING, _RUNNING, _KV, _KV_OLD, _REFUSED, *_BUCKETS})


@dataclass(frozen=True, slots=True, kw_only=True)
class EndpointSample:
    """One endpoint's page: each family summed over its label sets; None where absent.

    ``histograms``: by objective, those present, each a bucket's upper bound (``le``, +Inf
    included) -> its cumulative count."""

    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    histograms: Mapping[str, Mapping[float, float]] = field(default_factory=dict)
    # Requests vLLM refused since it started, all reasons (a counter); None: not exported.
    refused: float | None = None


def parse_metrics(page: str | bytes) -> EndpointSample:
    """The families above from a Prometheus text page; raises ValueError by the rules above
    (lines of other families are not looked at).

    Bytes are read as Latin-1, a character a byte: what is read (names, numbers, the ``le``
    label) is ASCII, which reads the same in UTF-8, and label values are only compared, so
    text that is not UTF-8 costs nothing more than a copy (replacing bad bytes would cost
    a character each and make the page wider)."""
    if isinstance(page, bytes):
        page = page.decode("latin-1")
    sums: dict[str, float] = {}
    kv: dict[str, float] = {}
    series: dict[str, dict[str, dict[float, float]]] = {}  # family -> series -> le -> count
    for name, labels, value, line in samples(page, FAMILIES):
        if not 0.0 <= value <= MAX_VALUE:  # NaN fails both
            raise ValueError(f"bad value {line[:60]!r}")
        if name in _BUCKETS:
            le, rest = split_label(labels, "le")
            if le is None:
                raise ValueError(f"bucket without le {line[:60]!r}")
            bound = float(le)
            if not bound >= 0.0:
                raise ValueError(f"{name}: le={le!r} is not a number >= 0")
            counts = series.setdefault(name, {}).setdefault(rest, {})
            if bound in counts:
                raise ValueError(f"{name}: le={le!r} twice in one series")
            counts[bound] = value
        elif name in (_KV, _KV_OLD):
            kv[name] = max(kv.get(name, 0.0), value)
        else:
            sums[name] = sums.get(name, 0.0) + value
    buckets = {name: _histogram(name, of_name.values()) for name, of_name in series.items()}
    present = {name: [buckets[f] for f in fs if f in buckets] for name, fs in _READ.items()}
    return EndpointSample(
        waiting=sums.get(_WAITING),
        running=sums.get(_RUNNING),
        kv_usage=kv.get(_KV, kv.get(_KV_OLD)),
        histograms={name: found[0] for name, found in present.items() if found},
        refused=sums.get(_REFUSED),
    )


def _histogram(name: str, series: Iterable[dict[float, float]]) -> dict[float, float]:
    """One family's buckets, the counts of a bound summed over its series (rules 3 and 4)."""
    hist: dict[float, float] = {}
    for counts in series:
        below = 0.0
        for bound in sorted(counts):
            if counts[bound] < below:
                raise ValueError(f"{name}: counts fall to {counts[bound]:g} at le={bound:g}")
            below = counts[bound]
            hist[bound] = hist.get(bound, 0.0) + below
    if len(hist) > MAX_BOUNDS:
        raise ValueError(f"{name}: {len(hist)} bucket bounds, over {MAX_BOUNDS}")
    return hist
