"""``python -m bench.compare.classes OUT...``: the per-class figures of finished comparisons.

Reads what ``python -m bench.compare --out OUT`` wrote (``compare.json``, ``records.json``,
``timelines.json``) and prints, per run and strategy, what the table of issue 20 reports:
good req/s and tok/s, interactive and batch good req/s, the first-attempt interactive p99 TTFT,
the wasted share, the time per output token that interactive clients saw (p90 over the good
streamed answers of at least two tokens, each answer's mean: ``(e2e - ttft) / (tokens - 1)``),
and the sidecar's pool limit over the window (p10 / p50 / p90 of the samples), so that its
band shows, not only its mean. Several OUT directories (seeds) of the same runs print each
figure as the mean and, after ``+-``, half the spread (max - min).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common.stats import percentile
from bench.common.table import fmt_spread, format_table

__all__ = ["main", "rows_of"]

COLUMNS = (
    ("good/s", "good_rps", 2),
    ("tok/s", "tok_s", 0),
    ("int/s", "interactive_rps", 2),
    ("batch/s", "batch_rps", 2),
    ("1st99i", "first_p99_s", 2),
    ("tpot90i", "tpot_p90_ms", 0),
    ("waste%", "waste_pct", 1),
    ("limit p10/50/90", "limit", None),
)


def _tpot_p90_ms(records: list[dict[str, Any]], window: tuple[float, float]) -> float | None:
    """p90 of the mean time per output token of good interactive answers in the window."""
    lo, hi = window
    tpots = [
        1000 * (r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1)
        for r in records
        if r["cls"] == "interactive"
        and r["good"]
        and r["ttft_s"] is not None
        and r["output_tokens"] >= 2
        and lo <= r["arrival_s"] + r["e2e_s"] < hi
    ]
    return percentile(tpots, 90) if tpots else None


def _limit_band(samples: list[dict[str, Any]], window: tuple[float, float]) -> str:
    values = [s["limit"] for s in samples if s["limit"] is not None and window[0] <= s["t_s"]]
    if not values:
        return "-"
    return "/".join(f"{percentile(values, q):.0f}" for q in (10, 50, 90))


def rows_of(out: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """(run label, strategy) -> the figures of one comparison's output directory."""
    doc = json.loads((out / "compare.json").read_text())
    records = json.loads((out / "records.json").read_text())
    timelines = json.loads((out / "timelines.json").read_text())
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for r in doc["runs"]:
        run = f"steady-{r['load']:g}x" if r["scenario"] == "steady" else r["scenario"]
        key = f"{run}/{r['strategy']}"  # as ScenarioRun.key names the records
        window = (r["window_s"][0], r["window_s"][1])
        per = r["per_class"]
        waste = r["wasted_frac"]
        rows[(r["label"], r["strategy"])] = {
            "good_rps": r["goodput_rps"],
            "tok_s": r["goodput_tokens_per_s"],
            "interactive_rps": per.get("interactive", {}).get("goodput_rps"),
            "batch_rps": per.get("batch", {}).get("goodput_rps"),
            "first_p99_s": r["interactive_ttft_p99_first_attempt_s"],
            "tpot_p90_ms": _tpot_p90_ms(records.get(key, []), window),
            "waste_pct": None if waste is None else 100 * waste,
            "limit": _limit_band(timelines.get(key, []), window),
        }
    return rows


def _cell(values: Sequence[Any], digits: int | None) -> str:
    if digits is None:  # text: each seed's, joined
        return " ".join(str(v) for v in values)
    return fmt_spread(values, digits)


def main(argv: Sequence[str] | None = None) -> int:
    outs = [Path(a) for a in (sys.argv[1:] if argv is None else argv)]
    if not outs:
        print("usage: python -m bench.compare.classes OUT [OUT ...]", file=sys.stderr)
        return 2
    seeds = [rows_of(o) for o in outs]
    keys = [k for k in seeds[0] if all(k in s for s in seeds)]
    header = ["run", "strategy", *(c[0] for c in COLUMNS)]
    rows = [[*key, *(_cell([s[key][f] for s in seeds], d) for _, f, d in COLUMNS)] for key in keys]
    print(format_table(header, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
