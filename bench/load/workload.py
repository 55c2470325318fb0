"""Workload description for the load generator: request classes, length distributions, traces and
the open-loop arrival schedule.

Pure and deterministic given a seed: :func:`build_schedule` turns the :class:`ClassSpec` list
into a sorted tuple of :class:`PlannedRequest` (arrival in simulated seconds, class, prompt and
output tokens) before anything is sent. Each class draws its arrivals and lengths from random
streams of its own (seeded from ``seed`` and the class name), so adding a class, or changing
the duration or the request cap, does not change the other requests:

* Arrivals are Poisson at ``rate`` per simulated second; lengths are a uniformly sampled row of
  the class's trace, else its ``prompt`` / ``output`` distributions. A ``rate_schedule`` makes
  the rate piecewise constant, drawn piece by piece from the same stream (exact, since the
  exponential is memoryless), so a steady run and a scenario share their schedule up to the
  first change.
* ``tenants`` split a class's arrivals by weight, each tenant a Poisson process with streams
  of its own (seeded from the tenant too): the same light tenants get the very same requests
  with or without a heavy one. Each request carries its tenant (sent as ``x-tenant-id``).

Traces: the Azure LLM inference traces in ``data/traces/`` (CSV columns ``arrived_at,
num_prefill_tokens, num_decode_tokens``; CC-BY-4.0, attribution in its README).
"""

from __future__ import annotations

import csv
import functools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

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


# --------------------------------------------------------------------------------------------
# Traces
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Trace:
    """A request trace's token counts per row."""

    name: str
    prompt_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.prompt_tokens)


@functools.lru_cache(maxsize=8)
def load_trace(path: str | Path) -> Trace:
    """Read an Azure-style trace CSV (``arrived_at,num_prefill_tokens,num_decode_tokens``)."""
    path = Path(path)
    prompts: list[int] = []
    outputs: list[int] = []
    with path.open(newline="") as fh:
        for row in csv.DictReader(fh):
            prompts.append(max(1, int(row["num_prefill_tokens"])))
            outputs.append(max(1, int(row["num_decode_tokens"])))
    if not prompts:
        raise ValueError(f"empty trace {path}")
    return Trace(name=path.name, prompt_tokens=tuple(prompts), output_tokens=tuple(outputs))


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
    trace: str | None = None  # trace file (name in traces_dir, or a path) for lengths
    prompt: LengthDist = LogNormal(median=1000, sigma=1.0, lo=4, hi=6000)
    output: LengthDist = LogNormal(median=128, sigma=1.0, lo=1, hi=2000)
    stream: bool = False
    timeout_s: float = 30.0  # client timeout per attempt; a request that exceeds it disconnects
    endpoint: Literal["chat", "completions"] = "chat"
    # (start_s, rate) pieces in time order: from each start until the next, arrivals come at that
    # rate (0: none); before the first start at ``rate``.
    rate_schedule: tuple[tuple[float, float], ...] = ()
    # (tenant, weight): the arrivals split between these tenants in proportion to the weights,
    # each a stream of its own; () = no tenant.
    tenants: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.timeout_s <= 0:
            raise ValueError(f"class {self.name}: rate and timeout_s must be > 0")
        if self.rate_schedule:
            starts = [t for t, _ in self.rate_schedule]
            if starts[0] < 0 or starts != sorted(starts):
                raise ValueError(f"class {self.name}: rate_schedule starts must be >= 0, in order")
            if any(r < 0 for _, r in self.rate_schedule):
                raise ValueError(f"class {self.name}: rate_schedule rates must be >= 0")
        if self.tenants:
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
