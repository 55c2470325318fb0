"""The noisy-neighbour scenario's report (:mod:`.scenarios`, ``noisy``): a table per strategy
with a row per seed and tenant, and PASS or MISS against the targets the fair sidecar is held
to (issue 23), pure.

Targets, per seed, for the held strategy (``sidecar-fair``, else the first strategy that ran):
  * every light tenant keeps at least 95 % of the SLO attainment it has with no flood (the
    light tenants alone, the same requests, through the held strategy);
  * the heavy tenant gets what is left: total good tokens/s at least 95 % of ``sidecar``'s
    (the same pool without fairness) in the same flood;
  * Jain's index over the light tenants' attainment at least 0.95.

Each strategy's table reads its light tenants against the same reference (the no-flood run of
the held strategy), so ``xalone`` says what a strategy keeps of what the light tenants get
alone on this backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from bench.common.table import fmt, format_table

from .measure import RunSummary
from .options import FAIR_STRATEGY, Strategy
from .report import TargetCheck, pct
from .tenants import TenantStats, jain_index

__all__ = ["check_noisy", "format_tenants", "held_strategy"]

KEEP_ALONE: Final = 0.95
TOKENS_VS_OFF: Final = 0.95
JAIN: Final = 0.95
FAIRNESS_OFF: Final = "sidecar"


def held_strategy(strategies: Sequence[Strategy]) -> Strategy:
    """The strategy the targets are checked on, and the one that runs the no-flood reference."""
    return FAIR_STRATEGY if FAIR_STRATEGY in strategies else strategies[0]


def _light(r: RunSummary) -> dict[str, TenantStats]:
    return {k: v for k, v in r.per_tenant.items() if k != "heavy"}


def _seed(r: RunSummary) -> str:
    return r.label.rsplit(" ", 1)[-1]


def _references(rows: Sequence[RunSummary]) -> dict[str, RunSummary]:
    """The no-flood run of each seed."""
    return {_seed(r): r for r in rows if r.scenario == "noisy" and r.label.startswith("no flood")}


def _ratios(r: RunSummary, ref: RunSummary | None) -> dict[str, float | None]:
    """Each light tenant's attainment over its attainment in ``ref`` (None: not measurable)."""
    out: dict[str, float | None] = {}
    for name, t in _light(r).items():
        alone = ref.per_tenant.get(name) if ref is not None else None
        a, b = t.attainment, alone.attainment if alone is not None else None
        out[name] = a / b if a is not None and b else None
    return out


def _jain(r: RunSummary) -> float | None:
    values = [t.attainment for t in _light(r).values()]
    return jain_index([v for v in values if v is not None]) if values else None


def _total_tokens(r: RunSummary) -> float:
    return sum(t.good_tokens_per_s for t in r.per_tenant.values())


def _target(
    r: RunSummary, name: str, value: float | None, threshold: float, detail: str
) -> TargetCheck:
    """A target met when ``value`` is at least ``threshold`` (None: not measured, a MISS)."""
    return TargetCheck(
        name=name,
        scenario=r.scenario,
        label=r.label,
        value=value,
        threshold=threshold,
        passed=value is not None and value >= threshold,
        detail=detail,
    )


def check_noisy(rows: Sequence[RunSummary], held: Strategy) -> list[TargetCheck]:
    """The targets of every flood run of ``held`` (see the module docstring)."""
    refs = _references(rows)
    checks: list[TargetCheck] = []
    for r in rows:
        if r.scenario != "noisy" or r.strategy != held or r.label.startswith("no flood"):
            continue

        ratios = _ratios(r, refs.get(_seed(r)))
        values = list(ratios.values())
        # A light tenant without a figure fails the target: nothing shows it kept anything.
        worst = min(v for v in values if v is not None) if values and None not in values else None
        detail = ", ".join(f"{k} {fmt(v)}" for k, v in ratios.items()) or "no light tenant"
        checks.append(
            _target(
                r, "light tenants keep >= 95% of no-flood attainment", worst, KEEP_ALONE, detail
            )
        )
        off = next(
            (
                o
                for o in rows
                if (o.strategy, o.scenario, o.label) == (FAIRNESS_OFF, r.scenario, r.label)
            ),
            None,
        )
        if off is not None and held != FAIRNESS_OFF:
            mine, theirs = _total_tokens(r), _total_tokens(off)
            ratio = mine / theirs if theirs else None
            detail = f"{mine:.0f} vs {theirs:.0f} tok/s ({FAIRNESS_OFF}): {fmt(ratio)}"
            checks.append(
                _target(r, "total good tok/s >= 95% of fairness off", ratio, TOKENS_VS_OFF, detail)
            )
        jain = _jain(r)
        detail = f"{fmt(jain, 3)} over {len(_light(r))} light tenants"
        checks.append(_target(r, "Jain's index over light attainment >= 0.95", jain, JAIN, detail))
    return checks


TENANT_HEADERS: Final = (
    "run", "tenant", "req", "slo", "attain", "xalone", "good", "tok/s", "refused", "ttft99",
)  # fmt: skip


def format_tenants(rows: Sequence[RunSummary], held: Strategy) -> str:
    """A table per strategy: per seed, a row per tenant and one over all of them (total good
    tokens/s; Jain's index over the light tenants' attainment in ``xalone``'s column)."""
    refs = _references(rows)
    noisy = [r for r in rows if r.scenario == "noisy" and r.per_tenant]
    blocks = []
    for strategy in dict.fromkeys(r.strategy for r in noisy):
        cells = []
        for r in (x for x in noisy if x.strategy == strategy):
            ref = None if r.label.startswith("no flood") else refs.get(_seed(r))
            ratios = _ratios(r, ref)
            for name, t in r.per_tenant.items():
                cells.append(
                    [
                        r.label,
                        name,
                        str(t.resolved),
                        str(t.slo_met),
                        pct(t.attainment),
                        fmt(ratios.get(name)),
                        str(t.good),
                        f"{t.good_tokens_per_s:.0f}",
                        pct(t.refused / t.resolved if t.resolved else None),
                        fmt(t.ttft_p99_s),
                    ]
                )
            n = sum(t.resolved for t in r.per_tenant.values())
            met = sum(t.slo_met for t in r.per_tenant.values())
            cells.append(
                [
                    r.label,
                    "all",
                    str(n),
                    str(met),
                    pct(met / n if n else None),
                    f"jain {fmt(_jain(r), 3)}",
                    str(sum(t.good for t in r.per_tenant.values())),
                    f"{_total_tokens(r):.0f}",
                    "",
                    "",
                ]
            )
        blocks.append(f"{strategy}:\n" + format_table(TENANT_HEADERS, cells))
    if not blocks:
        return ""
    legend = (
        "per tenant over the window: req: its requests resolved in it (all of them, whatever "
        "their end); slo: those that met the SLO (a good 200, first token within 2 s of the "
        "original arrival, retries included); attain: slo / req; xalone: attain over the same "
        f"tenant's with no flood (the light tenants alone, through {held}); good: complete 200s "
        "within the client timeout, tok/s: their output tokens per second; refused: final 429 "
        "or 5xx; ttft99: p99 TTFT of answered requests from the original arrival; all: jain = "
        "Jain's index over the light tenants' attainment"
    )
    return "\n\n".join(["noisy neighbour, per strategy and tenant:", *blocks, legend])
