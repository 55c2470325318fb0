"""What a run produced, pure: per-request records, per-class summaries, the backend's wasted
work, and the printed table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final

from bench.common.stats import percentile
from bench.common.table import fmt, format_table

from .client import Outcome


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestRecord:
    """What happened to one planned request (times in simulated seconds from its arrival)."""

    index: int
    cls: str
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    outcome: Outcome
    status: int | None  # final HTTP status; None for timeout / connection error / cancelled
    ttft_s: float | None  # streamed requests: first content chunk of the final attempt
    e2e_s: float  # arrival to the end of the final attempt (retries and backoffs included)
    output_tokens: int  # tokens received by the final attempt
    attempts: int
    gave_up: bool  # the client timed out and disconnected on its final attempt
    good: bool  # complete 200 within the class timeout
    tenant: str | None = None  # the x-tenant-id it was sent with; None: none


@dataclass(frozen=True, slots=True, kw_only=True)
class ClassSummary:
    """Aggregates over one class (or all: ``cls == "all"``)."""

    cls: str
    requests: int
    ok: int
    good: int
    offered_rps: float
    goodput_rps: float
    goodput_tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    ttft_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p95_s: float | None
    e2e_p99_s: float | None
    status_413: int
    status_429: int
    status_5xx: int
    timeouts: int
    other: int
    retries: int


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendWork:
    """Simulator counter deltas over the run (from /sim/stats)."""

    generation_tokens: int
    aborted_generation_tokens: int
    wasted_generation_frac: float
    prefill_tokens_computed: int
    aborted_prefill_tokens: int
    wasted_prefill_frac: float
    finished_requests: int
    aborted_requests: int
    preemptions: int
    sim_lag_s_max: float


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadResult:
    """Everything a run produced. ``to_dict()`` is JSON-ready."""

    window_s: float
    elapsed_s: float
    speedup: float
    seed: int
    loadgen_lag_s_max: float
    overall: ClassSummary
    per_class: dict[str, ClassSummary]
    backend: BackendWork | None
    records: tuple[RequestRecord, ...] = field(repr=False)

    def to_dict(self, *, include_records: bool = False) -> dict[str, Any]:
        out = asdict(self)
        if not include_records:
            del out["records"]
        return out


def summarize(cls: str, records: Sequence[RequestRecord], window_s: float) -> ClassSummary:
    """Counts, rates over ``window_s`` and latency percentiles of some records (one class, or
    all of them)."""
    ok = [r for r in records if r.outcome == "ok"]
    good = [r for r in ok if r.good]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2es = [r.e2e_s for r in ok]
    statuses = [r.status for r in records if r.outcome == "http_error"]
    n413 = sum(1 for s in statuses if s == 413)
    n429 = sum(1 for s in statuses if s == 429)
    n5xx = sum(1 for s in statuses if s is not None and s >= 500)
    timeouts = sum(1 for r in records if r.outcome == "timeout")
    other = len(records) - len(ok) - n413 - n429 - n5xx - timeouts
    w = window_s if window_s > 0 else float("nan")
    return ClassSummary(
        cls=cls,
        requests=len(records),
        ok=len(ok),
        good=len(good),
        offered_rps=len(records) / w,
        goodput_rps=len(good) / w,
        goodput_tokens_per_s=sum(r.output_tokens for r in good) / w,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p95_s=percentile(ttfts, 95),
        ttft_p99_s=percentile(ttfts, 99),
        e2e_p50_s=percentile(e2es, 50),
        e2e_p95_s=percentile(e2es, 95),
        e2e_p99_s=percentile(e2es, 99),
        status_413=n413,
        status_429=n429,
        status_5xx=n5xx,
        timeouts=timeouts,
        other=other,
        retries=sum(r.attempts - 1 for r in records),
    )


def backend_work(before: Mapping[str, Any], after: Mapping[str, Any]) -> BackendWork:
    """Simulator counter deltas between two ``/sim/stats`` bodies."""

    def d(key: str) -> int:
        return int(after.get(key, 0)) - int(before.get(key, 0))

    gen, prefill = d("generation_tokens"), d("prefill_tokens_computed")
    aborted_gen, aborted_prefill = d("aborted_generation_tokens"), d("aborted_prefill_tokens")
    return BackendWork(
        generation_tokens=gen,
        aborted_generation_tokens=aborted_gen,
        wasted_generation_frac=aborted_gen / gen if gen else 0.0,
        prefill_tokens_computed=prefill,
        aborted_prefill_tokens=aborted_prefill,
        wasted_prefill_frac=aborted_prefill / prefill if prefill else 0.0,
        finished_requests=d("finished_requests"),
        aborted_requests=d("aborted_requests"),
        preemptions=d("preemptions"),
        sim_lag_s_max=float(after.get("lag_s_max", 0.0)),
    )


HEADERS: Final = (
    "class", "req", "ok", "good", "good/s", "tok/s", "ttft50", "ttft99", "e2e50", "e2e99",
    "413", "429", "5xx", "tmo", "oth", "retry",
)  # fmt: skip


def _row(s: ClassSummary) -> list[str]:
    return [
        s.cls,
        *(str(n) for n in (s.requests, s.ok, s.good)),
        f"{s.goodput_rps:.2f}",
        f"{s.goodput_tokens_per_s:.0f}",
        *(fmt(x) for x in (s.ttft_p50_s, s.ttft_p99_s, s.e2e_p50_s, s.e2e_p99_s)),
        *(str(n) for n in (s.status_413, s.status_429, s.status_5xx, s.timeouts, s.other)),
        str(s.retries),
    ]


def format_result(result: LoadResult) -> str:
    """Human-readable summary of a run: one row per class, then all."""
    title = (
        f"window {result.window_s:.1f}s (sim), elapsed {result.elapsed_s:.1f}s, speedup "
        f"{result.speedup:g}, loadgen lag max {result.loadgen_lag_s_max:.3f}s; times in s"
    )
    rows = [_row(s) for s in [*result.per_class.values(), result.overall]]
    lines = [title, format_table(HEADERS, rows)]
    b = result.backend
    if b is not None:
        lines.append(
            f"backend: generated {b.generation_tokens} tokens, "
            f"{b.aborted_generation_tokens} for aborted requests "
            f"({b.wasted_generation_frac:.1%}); prefill wasted {b.wasted_prefill_frac:.1%}; "
            f"finished {b.finished_requests}, aborted {b.aborted_requests}, "
            f"preemptions {b.preemptions}, sim lag max {b.sim_lag_s_max:.3f}s"
        )
    return "\n".join(lines)
