"""The targets the ``sidecar`` strategy (the adaptive pool) is held to, from the run summaries.

steady, loads >= 2x (checked against every other strategy that ran at that load):
  * good req/s above every other strategy's, and good output tokens/s above every other's;
  * SLO goodput (:func:`.summary.slo_goodput_rps`) at least 1.5x every other strategy's;
  * interactive p99 TTFT over requests answered at their first attempt under 2 s;
  * wasted work (tokens generated for requests their client abandoned) under 2 %.
steady, loads <= 1x: nobody refused who would have been served in time, operationalized as
  both: at most 1 % of the requests resolved in the window end refused (final 429 or 5xx, after
  the client's retries), and at least as many good answers as ``direct`` (no admission control
  at all) in the same window.
halve: the pool limit settles within 30 s of the change (:func:`.timeline.limit_settle_s`:
  within 20 % of its final value from then on) and interactive p99 TTFT is back under 2 s
  before the run ends (:func:`.timeline.recovery_s`).
shift: batch uses at least 90 % of the capacity interactive leaves idle, and interactive p99
  TTFT is back under 2 s within 10 s of its burst.

Context lines (``primary=False``) read a target another way: p99 TTFT from the original
arrival, retries included; the recovery and settle figures of the other strategies are in the
scenario table, not here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from bench.common.table import fmt

from .summary import RunSummary, pct

__all__ = ["TTFT_TARGET_S", "TargetCheck", "check_targets"]

HELD: Final = "sidecar"
TTFT_TARGET_S: Final = 2.0
WASTE_TARGET: Final = 0.02
SLO_VS_OTHERS: Final = 1.5
REFUSED_AT_LOW_LOAD: Final = 0.01
SETTLE_S: Final = 30.0
IDLE_USE: Final = 0.9
SHIFT_RECOVERY_S: Final = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetCheck:
    """One target on one run of a scenario."""

    name: str
    scenario: str
    label: str  # "2x" or the scenario's name
    value: float | None
    threshold: float | None
    passed: bool
    detail: str
    primary: bool = True


def _best_other(
    others: Sequence[RunSummary], get: Callable[[RunSummary], float]
) -> tuple[float, str]:
    best = max(others, key=get)
    return get(best), best.strategy


class _Checks(list[TargetCheck]):
    """The checks of one run of the held strategy."""

    def __init__(self, side: RunSummary) -> None:
        super().__init__()
        self.side = side

    def add(
        self,
        name: str,
        value: float | None,
        threshold: float | None,
        passed: bool,
        detail: str,
        *,
        primary: bool = True,
    ) -> None:
        self.append(
            TargetCheck(
                name=name,
                scenario=self.side.scenario,
                label=self.side.label,
                value=value,
                threshold=threshold,
                passed=passed,
                detail=detail,
                primary=primary,
            )
        )


def _steady(side: RunSummary, rows: Sequence[RunSummary]) -> list[TargetCheck]:
    others = [r for r in rows if r.strategy != HELD]
    out = _Checks(side)
    check = out.add

    if side.load >= 2.0:
        readings: tuple[tuple[str, str, Callable[[RunSummary], float]], ...] = (
            ("good req/s", "req/s", lambda r: r.overall.goodput_rps),
            ("good tok/s", "tok/s", lambda r: r.overall.goodput_tokens_per_s),
        )
        if others:
            for name, unit, get in readings:
                best, who = _best_other(others, get)
                check(
                    f"{name} above every other",
                    get(side),
                    best,
                    get(side) > best,
                    f"{get(side):.2f} vs {best:.2f} {unit} ({who})",
                )
            best, who = _best_other(others, lambda r: r.slo_goodput_rps)
            need = SLO_VS_OTHERS * best
            check(
                "SLO goodput >= 1.5x every other",
                side.slo_goodput_rps,
                need,
                side.slo_goodput_rps >= need,
                f"{side.slo_goodput_rps:.2f} vs 1.5 x {best:.2f} ({who}) = {need:.2f} req/s",
            )
        first = side.ttft_p99_first_attempt_s
        check(
            "interactive p99 TTFT < 2 s (first attempts)",
            first,
            TTFT_TARGET_S,
            first is not None and first < TTFT_TARGET_S,
            f"{fmt(first)} s",
        )
        whole = side.ttft_p99_s
        check(
            "interactive p99 TTFT < 2 s (from arrival)",
            whole,
            TTFT_TARGET_S,
            whole is not None and whole < TTFT_TARGET_S,
            f"{fmt(whole)} s",
            primary=False,
        )
        waste = side.wasted_frac
        check(
            "wasted work < 2%",
            waste,
            WASTE_TARGET,
            waste is not None and waste < WASTE_TARGET,
            f"{pct(waste)} of generated tokens",
        )
    if side.load <= 1.0:
        direct = next((r for r in rows if r.strategy == "direct"), None)
        ok_refused = side.refused_frac <= REFUSED_AT_LOW_LOAD
        ok_good = direct is None or side.overall.good >= direct.overall.good
        vs = "" if direct is None else f", good {side.overall.good} vs direct {direct.overall.good}"
        check(
            "nobody refused who would be served in time",
            side.refused_frac,
            REFUSED_AT_LOW_LOAD,
            ok_refused and ok_good,
            f"refused {pct(side.refused_frac)} (<= 1%){vs}",
        )
    return list(out)


def check_targets(rows: Sequence[RunSummary]) -> list[TargetCheck]:
    """Every target whose runs are there (see the module docstring)."""
    groups: dict[tuple[str, str], list[RunSummary]] = {}
    for r in rows:
        groups.setdefault((r.scenario, r.label), []).append(r)
    checks: list[TargetCheck] = []
    for (scenario, _label), group in groups.items():
        side = next((r for r in group if r.strategy == HELD), None)
        if side is None:
            continue
        f = side.scenario_figures
        out = _Checks(side)
        check = out.add
        if scenario == "steady":
            checks.extend(_steady(side, group))
        elif scenario == "halve":
            settle = f.get("limit_settle_s")
            check(
                "pool limit settles within 30 s",
                settle,
                SETTLE_S,
                settle is not None and settle <= SETTLE_S,
                "no llm_extproc_pool_limit samples"
                if f.get("limit_final") is None
                else f"{fmt(settle, 1)} s after the change, {fmt(f.get('limit_before'), 0)} -> "
                f"{fmt(f.get('limit_final'), 0)}",
            )
            rec = f.get("recovery_s")
            check(
                "interactive p99 TTFT < 2 s again",
                rec,
                None,
                rec is not None,
                "never" if rec is None else f"{rec:.0f} s after the change",
            )
        elif scenario == "shift":
            use = f.get("idle_use")
            check(
                "batch uses >= 90% of idle capacity",
                use,
                IDLE_USE,
                use is not None and use >= IDLE_USE,
                f"{pct(use)} of batch's saturation tokens/s (engine busy "
                f"{pct(f.get('busy_frac'))})",
            )
            rec = f.get("recovery_s")
            check(
                "interactive p99 TTFT < 2 s within 10 s of burst",
                rec,
                SHIFT_RECOVERY_S,
                rec is not None and rec <= SHIFT_RECOVERY_S,
                "never" if rec is None else f"{rec:.0f} s after the burst began",
            )
        checks.extend(out)
    return checks
