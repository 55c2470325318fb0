"""What each scenario offers, pure: per class a piecewise-constant arrival rate, the backend's
speed changes, and the instants its figures are measured from.

The scenarios and what is measured in each, at the default 200 s: docs/benchmarks.md, "Shift,
halve and spike". Here their instants are fractions of the run's length ``D`` (``--duration``),
so a short test run keeps each scenario's shape, and rates are multiples of the capacity the
model computes (:mod:`.capacity`; ``1x`` split by the interactive share). Shift's idle use is
measured over ``[0.15 D, 0.45 D)``: the first 0.15 D fill the queues. Halve's speed change
(``POST /sim/speed``) reaches every replica at the same instant of the load's clock, so every
strategy meets it at the same point of the identical schedule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from bench.load.workload import ClassSpec

from .capacity import Capacity
from .options import Options, ScenarioName

__all__ = ["ScenarioRun", "noisy_runs", "plan"]

Pieces = tuple[tuple[float, float], ...]  # (start_s, rate) in time order, the first at 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ScenarioRun:
    """One run's offered load: the same for every strategy."""

    scenario: ScenarioName
    load: float  # steady: the offered load; otherwise the base load (x capacity)
    duration_s: float
    warmup_s: float
    rates: Mapping[str, Pieces]
    speed_changes: tuple[tuple[float, float], ...] = ()  # (at_s, speed factor of the backend)
    marks: Mapping[str, float] = field(default_factory=dict)  # named instants, simulated s
    seed: int | None = None  # the load's seed; None: ``--seed``
    # Per class, (tenant, weight) pairs: the class's arrivals split between its tenants.
    tenants: Mapping[str, tuple[tuple[str, float], ...]] = field(default_factory=dict)
    reference: bool = False  # a reference point: run by one strategy only

    @property
    def label(self) -> str:
        if self.scenario == "noisy":
            return f"{'no flood' if self.reference else 'flood'} s{self.seed}"
        return f"{self.load:g}x" if self.scenario == "steady" else self.scenario

    @property
    def key(self) -> str:
        """A name for files and records: ``steady-2x``, ``shift``, ``noisy-s0``,
        ``noflood-s0``, ..."""
        if self.scenario == "noisy":
            return f"{'noflood' if self.reference else 'noisy'}-s{self.seed}"
        return f"steady-{self.load:g}x" if self.scenario == "steady" else self.scenario

    def mean_rate(self, cls: str) -> float:
        """The class's arrivals per second, averaged over the run."""
        pieces = self.rates.get(cls, ())
        total = 0.0
        for i, (start, rate) in enumerate(pieces):
            end = pieces[i + 1][0] if i + 1 < len(pieces) else self.duration_s
            total += rate * max(0.0, min(end, self.duration_s) - start)
        return total / self.duration_s

    @property
    def offered_rps(self) -> float:
        return sum(self.mean_rate(c) for c in self.rates)

    def classes(self, opts: Options) -> tuple[ClassSpec, ...]:
        """The load generator's classes (our timeouts and lengths) with this run's rates; a
        class that never arrives is left out."""
        out = []
        for spec in opts.classes(1.0):
            mean = self.mean_rate(spec.name)
            if mean > 0:
                out.append(
                    replace(
                        spec,
                        rate=mean,
                        rate_schedule=tuple(self.rates[spec.name]),
                        tenants=self.tenants.get(spec.name, ()),
                    )
                )
        return tuple(out)


def plan(name: ScenarioName, cap: Capacity, opts: Options) -> list[ScenarioRun]:
    """The runs of a scenario (one per load for ``steady``, one otherwise)."""
    d, share = opts.duration_s, opts.interactive_share

    def mixed(load: float) -> dict[str, float]:
        rate = load * cap.capacity_rps
        return {"interactive": rate * share, "batch": rate * (1 - share)}

    if name == "steady":
        return [
            ScenarioRun(
                scenario="steady",
                load=load,
                rates={c: ((0.0, r),) for c, r in mixed(load).items()},
                duration_s=d,
                warmup_s=opts.warmup_s,
            )
            for load in opts.loads
        ]
    base = mixed(opts.base_load)
    if name == "shift":
        burst, both = 0.45 * d, 0.65 * d
        flood = {c: opts.flood_load * cap.class_capacity_rps[c] for c in ("interactive", "batch")}
        return [
            ScenarioRun(
                scenario="shift",
                load=opts.base_load,
                rates={
                    "interactive": (
                        (0.0, 0.0),
                        (burst, flood["interactive"]),
                        (both, base["interactive"]),
                    ),
                    "batch": ((0.0, flood["batch"]), (burst, 0.0), (both, base["batch"])),
                },
                marks={
                    "idle_from_s": 0.15 * d,
                    "idle_to_s": burst,
                    "recover_from_s": burst,
                    "both_s": both,
                },
                duration_s=d,
                warmup_s=opts.warmup_s,
            )
        ]
    if name == "halve":
        change = 0.4 * d
        return [
            ScenarioRun(
                scenario="halve",
                load=opts.base_load,
                rates={c: ((0.0, r),) for c, r in base.items()},
                speed_changes=((change, opts.slow_factor),),
                marks={"change_s": change, "recover_from_s": change},
                duration_s=d,
                warmup_s=opts.warmup_s,
            )
        ]
    if name == "spike":
        start = 0.4 * d
        end = start + min(opts.spike_s, 0.15 * d)
        spike = mixed(opts.spike_load)
        return [
            ScenarioRun(
                scenario="spike",
                load=opts.base_load,
                rates={c: ((0.0, r), (start, spike[c]), (end, r)) for c, r in base.items()},
                marks={"spike_s": start, "spike_end_s": end, "recover_from_s": end},
                duration_s=d,
                warmup_s=opts.warmup_s,
            )
        ]
    if name == "noisy":
        return noisy_runs(cap, opts)
    raise ValueError(f"unknown scenario {name!r}")


def noisy_runs(cap: Capacity, opts: Options) -> list[ScenarioRun]:
    """Per seed, the flood and its reference (the light tenants alone); loads are multiples
    of interactive's own capacity (that class alone at ``max_num_seqs``)."""
    unit = cap.class_capacity_rps["interactive"]
    light = tuple((f"light-{i + 1}", opts.light_load) for i in range(opts.light_tenants))
    out = []
    for seed in opts.noisy_seeds:
        for tenants in ((("heavy", opts.heavy_load), *light), light):
            load = sum(w for _, w in tenants)
            out.append(
                ScenarioRun(
                    scenario="noisy",
                    load=load,
                    rates={"interactive": ((0.0, load * unit),)},
                    tenants={"interactive": tenants},
                    duration_s=opts.duration_s,
                    warmup_s=opts.warmup_s,
                    seed=seed,
                    reference=tenants is light,
                )
            )
    return out
