"""The targets the sidecar is held to, checked per load from the run summaries."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from bench.common.table import fmt

from .summary import RunSummary, pct

# Goodput is checked at 2x and 4x, TTFT and wasted work at every load.
GOODPUT_VS_DIRECT: Final = 1.25
TTFT_TARGET_S: Final = 2.0
WASTE_TARGET: Final = 0.05


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetCheck:
    """One target at one load. ``primary``: the target as stated (goodput in req/s, TTFT from
    the original arrival); the others are the same target on a second reading, for context."""

    name: str
    load: float
    value: float | None
    threshold: float | None
    passed: bool
    detail: str
    primary: bool = True


def _goodput_rps(r: RunSummary) -> float:
    return r.overall.goodput_rps


def _goodput_tps(r: RunSummary) -> float:
    return r.overall.goodput_tokens_per_s


def check_targets(rows: Sequence[RunSummary]) -> list[TargetCheck]:
    """The sidecar's targets: goodput vs direct and envoy-cb at 2x and 4x; p99 TTFT
    and wasted work at every load that was run. Goodput is judged in req/s (primary) and in
    output tokens/s; TTFT from the original arrival (primary) and over first attempts."""
    by = {(r.strategy, r.load): r for r in rows}
    checks: list[TargetCheck] = []
    for load in sorted({r.load for r in rows}):
        side = by.get(("sidecar", load))
        if side is None:
            continue
        direct = by.get(("direct", load))
        cb = by.get(("envoy-cb", load))
        readings: tuple[tuple[str, bool, Callable[[RunSummary], float]], ...] = (
            ("req/s", True, _goodput_rps),
            ("tok/s", False, _goodput_tps),
        )
        for unit, primary, get in readings:
            mine = get(side)
            if load >= 2.0 and direct is not None:
                need = GOODPUT_VS_DIRECT * get(direct)
                checks.append(
                    TargetCheck(
                        name=f"goodput >= 1.25x direct ({unit})",
                        load=load,
                        value=mine,
                        threshold=need,
                        passed=mine >= need,
                        detail=f"{mine:.2f} vs 1.25 x {get(direct):.2f} = {need:.2f} {unit}",
                        primary=primary,
                    )
                )
            if load >= 2.0 and cb is not None:
                checks.append(
                    TargetCheck(
                        name=f"goodput > envoy-cb ({unit})",
                        load=load,
                        value=mine,
                        threshold=get(cb),
                        passed=mine > get(cb),
                        detail=f"{mine:.2f} vs {get(cb):.2f} {unit}",
                        primary=primary,
                    )
                )
        for what, primary, ttft in (
            ("from arrival", True, side.ttft_p99_s),
            ("first attempts", False, side.ttft_p99_first_attempt_s),
        ):
            checks.append(
                TargetCheck(
                    name=f"interactive p99 TTFT < 2 s ({what})",
                    load=load,
                    value=ttft,
                    threshold=TTFT_TARGET_S,
                    passed=ttft is not None and ttft < TTFT_TARGET_S,
                    detail=f"{fmt(ttft)} s",
                    primary=primary,
                )
            )
        waste = side.wasted_frac
        checks.append(
            TargetCheck(
                name="wasted work < 5%",
                load=load,
                value=waste,
                threshold=WASTE_TARGET,
                passed=waste is not None and waste < WASTE_TARGET,
                detail=f"{pct(waste)} of generated tokens",
            )
        )
    return checks
