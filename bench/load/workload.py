"""Workload description for the load generator: request classes, length distributions, traces and
the open-loop arrival schedule.

Everything here is pure and deterministic given a seed: :func:`build_schedule` turns a list of
:class:`ClassSpec` into a sorted tuple of :class:`PlannedRequest` (arrival time in simulated
seconds, class, prompt and output token counts) before any request is sent, so the schedule can
be tested and compared across runs without a network.

Each class has its own arrival process and its own random streams for arrivals and lengths
(seeded from ``seed`` and the class name, so adding a class, or changing the duration or the
request cap, does not change the other requests):

* ``arrivals="poisson"``: exponential inter-arrival times at ``rate`` requests per simulated
  second. Lengths come from the class's trace (a uniformly sampled row) if it has one, else from
  its ``prompt`` / ``output`` distributions. A ``rate_schedule`` makes the rate piecewise
  constant (a scenario's quiet phase, flood or spike): a non-homogeneous Poisson process drawn
  piece by piece from the same random stream, exact because the exponential is memoryless. One
  piece from 0 gives the very arrivals of a constant ``rate``, so a steady run and a scenario
  share their schedule up to the first change.
* ``tenants``: the class's arrivals split between tenants in proportion to their weights, each
  tenant a Poisson process of its own (its share of the rate, piece by piece) with its own
  random streams (seeded from ``seed``, the class name and the tenant), so a tenant's requests
  do not depend on the other tenants: the same light tenants with and without a heavy one get
  the very same requests. Each request carries its tenant (sent as ``x-tenant-id``).
* ``arrivals="trace"``: the trace's own arrival times, replayed in order from the first row and
  compressed or stretched so that the mean rate equals ``rate`` (factor ``trace_rate / rate``,
  burstiness preserved); the lengths are the rows' recorded token counts. The trace wraps around
  if the run is longer than the scaled trace.

Traces are the Azure LLM inference traces (CSV columns ``arrived_at,num_prefill_tokens,
num_decode_tokens``) shipped in ``data/traces/`` (CC-BY-4.0, attribution in its README).
"""

from __future__ import annotations

import csv
import functools
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

DEFAULT_TRACES_DIR: Final = Path(__file__).resolve().parents[2] / "data" / "traces"


# --------------------------------------------------------------------------------------------
# Length distributions
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Fixed:
    """Always ``n`` tokens."""

    n: int

    def sample(self, rng: random.Random) -> int:
        return self.n


@dataclass(frozen=True, slots=True, kw_only=True)
class Uniform:
    """Uniform integer in ``[lo, hi]``."""

    lo: int
    hi: int

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)


@dataclass(frozen=True, slots=True, kw_only=True)
class LogNormal:
    """Log-normal with the given median and log-space sigma, rounded and clipped to ``[lo, hi]``."""

    median: float
    sigma: float
    lo: int = 1
    hi: int = 8192

    def sample(self, rng: random.Random) -> int:
        value = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return min(self.hi, max(self.lo, value))


LengthDist = Fixed | Uniform | LogNormal


def parse_dist(spec: str) -> LengthDist:
    """``fixed:N`` | ``uniform:LO:HI`` | ``lognormal:MEDIAN:SIGMA[:LO:HI]``."""
    kind, *args = spec.split(":")
    try:
        if kind == "fixed" and len(args) == 1:
            return Fixed(n=int(args[0]))
        if kind == "uniform" and len(args) == 2:
            return Uniform(lo=int(args[0]), hi=int(args[1]))
        if kind == "lognormal" and len(args) in (2, 4):
            extra = {"lo": int(args[2]), "hi": int(args[3])} if len(args) == 4 else {}
            return LogNormal(median=float(args[0]), sigma=float(args[1]), **extra)
    except ValueError:
        pass
    raise ValueError(f"bad length distribution {spec!r}")


# --------------------------------------------------------------------------------------------
# Traces
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Trace:
    """A request trace: arrival times (s, from 0) and token counts per row."""

    name: str
    arrivals_s: tuple[float, ...]
    prompt_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.arrivals_s)

    @property
    def span_s(self) -> float:
        return self.arrivals_s[-1] - self.arrivals_s[0]

    @property
    def mean_rate(self) -> float:
        """Requests per second over the trace (rows - 1 gaps over the span)."""
        return (len(self) - 1) / self.span_s if len(self) > 1 and self.span_s > 0 else 1.0


@functools.lru_cache(maxsize=8)
def load_trace(path: str | Path) -> Trace:
    """Read an Azure-style trace CSV (``arrived_at,num_prefill_tokens,num_decode_tokens``)."""
    path = Path(path)
    arrivals: list[float] = []
    prompts: list[int] = []
    outputs: list[int] = []
    with path.open(newline="") as fh:
        for row in csv.DictReader(fh):
            arrivals.append(float(row["arrived_at"]))
            prompts.append(max(1, int(row["num_prefill_tokens"])))
            outputs.append(max(1, int(row["num_decode_tokens"])))
    if not arrivals:
        raise ValueError(f"empty trace {path}")
    t0 = arrivals[0]
    return Trace(
        name=path.name,
        arrivals_s=tuple(t - t0 for t in arrivals),
        prompt_tokens=tuple(prompts),
        output_tokens=tuple(outputs),
    )


def resolve_trace(name: str, traces_dir: str | Path | None = None) -> Path:
    """A trace file name is looked up in ``traces_dir``; an existing path is used as is."""
    candidate = Path(name)
    if candidate.is_absolute() or candidate.exists():
        return candidate
    return Path(traces_dir if traces_dir is not None else DEFAULT_TRACES_DIR) / name


# --------------------------------------------------------------------------------------------
# Classes and schedule
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ClassSpec:
    """One traffic class. Times are simulated seconds."""

    name: str  # sent as the x-llm-class header
    rate: float  # mean arrivals per simulated second
    arrivals: Literal["poisson", "trace"] = "poisson"
    trace: str | None = None  # trace file (name in traces_dir, or a path) for lengths/arrivals
    prompt: LengthDist = LogNormal(median=1000, sigma=1.0, lo=4, hi=6000)
    output: LengthDist = LogNormal(median=128, sigma=1.0, lo=1, hi=2000)
    stream: bool = False
    timeout_s: float = 30.0  # client timeout per attempt; a request that exceeds it disconnects
    endpoint: Literal["chat", "completions"] = "chat"
    # (start_s, rate) pieces in time order: from each start until the next, arrivals come at that
    # rate (0: none); before the first start at ``rate``. Poisson arrivals only.
    rate_schedule: tuple[tuple[float, float], ...] = ()
    # (tenant, weight): the arrivals split between these tenants in proportion to the weights,
    # each a stream of its own; () = no tenant. Poisson arrivals only.
    tenants: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.timeout_s <= 0:
            raise ValueError(f"class {self.name}: rate and timeout_s must be > 0")
        if self.arrivals == "trace" and self.trace is None:
            raise ValueError(f"class {self.name}: arrivals='trace' needs a trace")
        if self.rate_schedule:
            if self.arrivals == "trace":
                raise ValueError(f"class {self.name}: a rate_schedule needs Poisson arrivals")
            starts = [t for t, _ in self.rate_schedule]
            if starts[0] < 0 or starts != sorted(starts):
                raise ValueError(f"class {self.name}: rate_schedule starts must be >= 0, in order")
            if any(r < 0 for _, r in self.rate_schedule):
                raise ValueError(f"class {self.name}: rate_schedule rates must be >= 0")
        if self.tenants:
            if self.arrivals == "trace":
                raise ValueError(f"class {self.name}: tenants need Poisson arrivals")
            names = [t for t, _ in self.tenants]
            if len(set(names)) != len(names) or any(w <= 0 for _, w in self.tenants):
                raise ValueError(f"class {self.name}: tenants must be unique, weights > 0")

    def tenant_shares(self) -> tuple[tuple[str | None, float], ...]:
        """Each tenant with its share of the class's arrivals (one ``(None, 1.0)`` without)."""
        if not self.tenants:
            return ((None, 1.0),)
        total = sum(w for _, w in self.tenants)
        return tuple((t, w / total) for t, w in self.tenants)

    def rate_pieces(self, duration_s: float) -> list[tuple[float, float, float]]:
        """``(start_s, end_s, rate)`` covering ``[0, duration_s)``."""
        points = [(0.0, self.rate), *self.rate_schedule]
        out = []
        for i, (start, rate) in enumerate(points):
            end = points[i + 1][0] if i + 1 < len(points) else duration_s
            end = min(end, duration_s)
            if end > start:
                out.append((start, end, rate))
        return out


def class_from_dict(d: Mapping[str, Any]) -> ClassSpec:
    """Build a :class:`ClassSpec` from JSON-ish values (length distributions as strings)."""
    kwargs = dict(d)
    for key in ("prompt", "output"):
        if isinstance(kwargs.get(key), str):
            kwargs[key] = parse_dist(kwargs[key])
    if "rate_schedule" in kwargs:  # JSON lists of [start_s, rate]
        kwargs["rate_schedule"] = tuple((float(t), float(r)) for t, r in kwargs["rate_schedule"])
    if "tenants" in kwargs:  # JSON lists of [tenant, weight]
        kwargs["tenants"] = tuple((str(t), float(w)) for t, w in kwargs["tenants"])
    return ClassSpec(**kwargs)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannedRequest:
    """One request of the open-loop schedule."""

    index: int
    t_s: float  # arrival, simulated seconds from the start of the run
    cls: str
    prompt_tokens: int
    output_tokens: int
    tenant: str | None = None  # sent as x-tenant-id


def poisson_arrivals(
    rate: float, *, duration_s: float, rng: random.Random, max_n: int
) -> list[float]:
    """Arrival times of a Poisson process in ``[0, duration_s)``, at most ``max_n``."""
    return piecewise_poisson_arrivals([(0.0, duration_s, rate)], rng=rng, max_n=max_n)


def piecewise_poisson_arrivals(
    pieces: Sequence[tuple[float, float, float]], *, rng: random.Random, max_n: int
) -> list[float]:
    """Arrival times of a Poisson process whose rate is ``rate`` on each ``(start_s, end_s,
    rate)`` piece (pieces in time order, not overlapping), at most ``max_n``. Each piece starts
    afresh at its start: the exponential is memoryless, so this is the exact process."""
    times: list[float] = []
    for start, end, rate in pieces:
        if rate <= 0:
            continue
        t = start + rng.expovariate(rate)
        while t < end and len(times) < max_n:
            times.append(t)
            t += rng.expovariate(rate)
    return times


def trace_arrivals(
    trace: Trace, *, rate: float, duration_s: float, max_n: int
) -> list[tuple[float, int]]:
    """(time, row) pairs replaying ``trace`` at mean rate ``rate``, wrapping around if needed."""
    scale = trace.mean_rate / rate  # trace seconds -> run seconds
    period = (trace.span_s + 1.0 / trace.mean_rate) * scale
    out: list[tuple[float, int]] = []
    lap = 0
    while len(out) < max_n:
        base = lap * period
        if base >= duration_s:
            break
        for row, t in enumerate(trace.arrivals_s):
            at = base + t * scale
            if at >= duration_s or len(out) >= max_n:
                return out
            out.append((at, row))
        lap += 1
    return out


def build_schedule(
    classes: Sequence[ClassSpec],
    *,
    duration_s: float,
    max_requests: int,
    seed: int = 0,
    traces_dir: str | Path | None = None,
) -> tuple[PlannedRequest, ...]:
    """The merged, time-ordered open-loop schedule of all classes, cut at ``max_requests``."""
    if not classes:
        raise ValueError("no classes")
    names = [c.name for c in classes]
    if len(set(names)) != len(names):
        raise ValueError("class names must be unique")
    # (t, class position, tenant position, prompt, output)
    raw: list[tuple[float, int, int, int, int]] = []
    for pos, spec in enumerate(classes):
        trace = (
            load_trace(resolve_trace(spec.trace, traces_dir)) if spec.trace is not None else None
        )
        if spec.arrivals == "trace":
            assert trace is not None
            for t, row in trace_arrivals(
                trace, rate=spec.rate, duration_s=duration_s, max_n=max_requests
            ):
                raw.append((t, pos, 0, trace.prompt_tokens[row], trace.output_tokens[row]))
            continue
        for k, (tenant, share) in enumerate(spec.tenant_shares()):
            # Separate streams: the n-th request's lengths do not depend on duration or caps,
            # nor a tenant's requests on the other tenants.
            stream = spec.name if tenant is None else f"{spec.name}:{tenant}"
            arrival_rng = random.Random(f"{seed}:{stream}:arrivals")
            rng = random.Random(f"{seed}:{stream}:lengths")
            pieces = [(a, b, rate * share) for a, b, rate in spec.rate_pieces(duration_s)]
            for t in piecewise_poisson_arrivals(pieces, rng=arrival_rng, max_n=max_requests):
                if trace is not None:
                    row = rng.randrange(len(trace))
                    raw.append((t, pos, k, trace.prompt_tokens[row], trace.output_tokens[row]))
                else:
                    raw.append((t, pos, k, spec.prompt.sample(rng), spec.output.sample(rng)))
    raw.sort(key=lambda r: (r[0], r[1], r[2]))
    return tuple(
        PlannedRequest(
            index=i,
            t_s=t,
            cls=classes[pos].name,
            prompt_tokens=p,
            output_tokens=o,
            tenant=classes[pos].tenant_shares()[k][0],
        )
        for i, (t, pos, k, p, o) in enumerate(raw[:max_requests])
    )
