"""``python -m bench.compare.attain OUT...``: the load each strategy sustains with both classes
served (issue 20's DistServe figure), read from finished comparisons' output files.

The figure, its target and the latest results are in docs/benchmarks.md, "The load each
strategy sustains with both classes served". The counting rules it leaves to this module:

* Each request counts once, as its original request, in the window where its final outcome
  falls (``slo.Window``). Interactive meets its goal with a first token within
  :data:`~bench.compare.slo.SLO_TTFT_S` of its first attempt's scheduled send. Refused,
  given up and abandoned answers fail: the records keep a first token only for complete
  answers. Batch meets its goal with a good answer within its client timeout
  (``--batch-timeout``) from the original arrival.
* A run stops its clients one simulated second after the last arrival. Requests still open
  then end outside the window and are not counted. The ``open`` column counts those that
  arrived in the window, so a share that rests on survivors shows.
* Loads are scanned upwards, and the first load that fails decides (the lower crossing when
  both classes fail there). A higher load that passes again does not raise the figure. When
  the crossing is not bracketed, the figure reads ``< L`` or ``>= L``, and a ratio that such a
  bound leaves undecided reads ``?``.
* OUT directories of one seed (``compare.json``'s options) make one curve; a load measured
  twice keeps the later directory's. With several seeds the shares are averaged over the loads
  every seed measured (``+-`` half the spread), the figure is read from the mean shares, and
  each seed's own figure is printed beside it.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from bench.common.table import fmt_spread, format_table

from .options import CLASSES
from .slo import SLO_TTFT_S

__all__ = ["Figure", "figure_of", "main", "ratio_verdict", "shares_of"]

SHARE: Final = 0.9  # both classes' share that a load must meet
TARGET_RATIO: Final = 1.5  # the sidecar's figure over every other's

Shares = dict[str, float | None]  # class -> share in the window; None: no request of it


@dataclass(frozen=True, slots=True, kw_only=True)
class Figure:
    """The highest load with both shares met: ``exact`` (bracketed, interpolated), ``below``
    (the lowest load already fails: the figure is below ``load``) or ``at_least`` (the
    highest load still passes)."""

    load: float
    kind: Literal["exact", "below", "at_least"]

    def __str__(self) -> str:
        prefix = {"exact": "", "below": "< ", "at_least": ">= "}[self.kind]
        return f"{prefix}{self.load:.2f}"


def _met(r: Mapping[str, Any]) -> bool:
    """Interactive: first token within the SLO of the first attempt; batch: a good answer."""
    if not r["good"]:
        return False
    return r["cls"] != "interactive" or (r["ttft_s"] is not None and r["ttft_s"] <= SLO_TTFT_S)


def shares_of(
    records: Sequence[Mapping[str, Any]], window: tuple[float, float]
) -> tuple[Shares, dict[str, int]]:
    """Per class: the share of the window's requests that met their goal, and how many of the
    requests that arrived in the window were still open when the run stopped them."""
    lo, hi = window
    shares: Shares = {}
    open_at_cut: dict[str, int] = {}
    for cls in CLASSES:
        mine = [r for r in records if r["cls"] == cls]
        counted = [r for r in mine if lo <= r["arrival_s"] + r["e2e_s"] < hi]
        shares[cls] = sum(map(_met, counted)) / len(counted) if counted else None
        open_at_cut[cls] = sum(
            1 for r in mine if r["outcome"] == "cancelled" and lo <= r["arrival_s"] < hi
        )
    return shares, open_at_cut


def figure_of(curve: Mapping[float, Mapping[str, float | None]]) -> Figure:
    """The highest load at which every class's share is >= :data:`SHARE` (module docstring).
    A class without requests at a load does not hold it back."""
    loads = sorted(curve)
    if not loads:
        raise ValueError("no loads")

    def short(load: float) -> list[str]:
        return [c for c, s in curve[load].items() if s is not None and s < SHARE]

    if short(loads[0]):
        return Figure(load=loads[0], kind="below")
    for below, above in itertools.pairwise(loads):
        falling = short(above)
        if falling:
            crossings = []
            for c in falling:
                s0, s1 = curve[below][c], curve[above][c] or 0.0
                frac = 0.0 if s0 is None else (s0 - SHARE) / (s0 - s1)  # s0 >= SHARE > s1
                crossings.append(below + frac * (above - below))
            return Figure(load=min(crossings), kind="exact")
    return Figure(load=loads[-1], kind="at_least")


def ratio_verdict(mine: Figure, other: Figure) -> tuple[str, str]:
    """The sidecar's figure over another's, as text, and PASS / MISS / ``?`` against
    :data:`TARGET_RATIO`. A ``below`` other or an ``at_least`` sidecar makes the ratio a
    lower bound (PASS if it is already enough); the reverse an upper bound (MISS if short)."""
    ratio = mine.load / other.load
    low = mine.kind == "at_least" or other.kind == "below"
    high = mine.kind == "below" or other.kind == "at_least"
    if low and high:
        return "?", "?"
    if low:
        return f">= {ratio:.2f}", "PASS" if ratio >= TARGET_RATIO else "?"
    if high:
        return f"<= {ratio:.2f}", "MISS" if ratio < TARGET_RATIO else "?"
    return f"{ratio:.2f}", "PASS" if ratio >= TARGET_RATIO else "MISS"


Curves = dict[str, dict[float, tuple[Shares, dict[str, int]]]]  # strategy -> load -> ...


def curves_of(out: Path, into: Curves | None = None) -> Curves:
    """Strategy -> offered load -> (shares, open at the cut), of one output directory, added
    to ``into`` (another directory's of the same seed) when given."""
    doc = json.loads((out / "compare.json").read_text())
    records = json.loads((out / "records.json").read_text())
    curves: Curves = {} if into is None else into
    for r in doc["runs"]:
        if r["scenario"] != "steady":
            continue
        key = f"steady-{r['load']:g}x/{r['strategy']}"  # as ScenarioRun.key names the records
        window = (r["window_s"][0], r["window_s"][1])
        curves.setdefault(r["strategy"], {})[r["load"]] = shares_of(records[key], window)
    return curves


def _mean(values: Sequence[float | None]) -> float | None:
    nums = [v for v in values if v is not None]
    return sum(nums) / len(nums) if nums else None


def _pct(values: Sequence[float | None]) -> str:
    return fmt_spread([100 * v for v in values if v is not None], 1)


def report(seeds: Sequence[Curves], sidecar: str = "sidecar") -> str:
    """The shares table and the figures table of some seeds' curves (module docstring)."""
    strategies = [s for s in seeds[0] if all(s in c for c in seeds)]
    share_rows, figures = [], {}
    for s in strategies:
        loads = sorted(set.intersection(*(set(c[s]) for c in seeds)))
        mean_curve: dict[float, Shares] = {}
        for load in loads:
            per = [c[s][load] for c in seeds]
            mean_curve[load] = {k: _mean([p[0][k] for p in per]) for k in CLASSES}
            opened = "/".join(str(sum(p[1][k] for p in per)) for k in CLASSES)
            share_rows.append(
                [s, f"{load:g}", *(_pct([p[0][k] for p in per]) for k in CLASSES), opened]
            )
        per_seed = [str(figure_of({x: c[s][x][0] for x in loads})) for c in seeds]
        figures[s] = (figure_of(mean_curve), " / ".join(per_seed))
    fig_rows: list[list[str]] = []
    for s, (fig, each) in figures.items():
        verdict = ("-", "-")
        if s != sidecar and sidecar in figures:
            verdict = ratio_verdict(figures[sidecar][0], fig)
        fig_rows.append([s, str(fig), each, *verdict])
    return "\n\n".join(
        [
            format_table(
                ["strategy", "load", "interactive %", "batch %", "open int/batch"], share_rows
            ),
            format_table(
                ["strategy", "figure", "per seed", f"{sidecar} / it", f">= {TARGET_RATIO}x"],
                fig_rows,
            ),
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare.attain", description=__doc__)
    p.add_argument("outs", nargs="+", type=Path, help="bench.compare --out directories (seeds)")
    p.add_argument("--sidecar", default="sidecar", help="the strategy held to the target")
    args = p.parse_args(argv)
    seeds: dict[int, Curves] = {}
    for out in args.outs:  # the directories of one seed (their loads) make one curve
        seed = json.loads((out / "compare.json").read_text())["options"]["seed"]
        seeds[seed] = curves_of(out, seeds.get(seed))
    print(report(list(seeds.values()), sidecar=args.sidecar))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
