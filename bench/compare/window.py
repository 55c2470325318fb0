"""What the pool let through over a finished run's window, read back from its files
(``compare.json``'s siblings, :mod:`bench.compare.__main__`), pure but for the reading:
``python -m bench.compare.window OUT --window 20,75``.

Per run and strategy: the sidecar's pool limit (``timelines.json``, sampled every
``--sample-every``) at p10 / p50 / p90 over the window, and of the 200s whose final outcome
fell in it (``records.json``) how many, their mean prompt and output tokens, and how many were
the heavy tenant's. It separates what a queue order changes upstream (which requests reach the
backend, hence how high the TTFT-bound adaptive limit climbs) from what the report already
shows (docs/benchmarks.md, "Why the fair pool admitted less").
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.common.stats import percentile
from bench.common.table import fmt, format_table

__all__ = ["window_rows"]

HEADERS = ("run", "limit p10/50/90", "200s", "prompt", "output", "heavy")


def _limits(samples: Sequence[Mapping[str, Any]], lo: float, hi: float) -> str:
    xs = [s["limit"] for s in samples if lo <= s["t_s"] < hi and s.get("limit") is not None]
    return "/".join(fmt(percentile(xs, q), 0) for q in (10, 50, 90))


def window_rows(
    timelines: Mapping[str, Sequence[Mapping[str, Any]]],
    records: Mapping[str, Sequence[Mapping[str, Any]]],
    lo: float,
    hi: float,
) -> list[list[str]]:
    """A row per ``run/strategy`` key of ``timelines`` (see the module docstring)."""
    rows = []
    for key, samples in timelines.items():
        ok = [
            r
            for r in records.get(key, ())
            if r.get("status") == 200 and lo <= r["arrival_s"] + r["e2e_s"] < hi
        ]
        mean = {
            f: fmt(statistics.fmean(r[f] for r in ok), 0) if ok else "-"
            for f in ("prompt_tokens", "output_tokens")
        }
        heavy = sum(1 for r in ok if r.get("tenant") == "heavy")
        rows.append(
            [key, _limits(samples, lo, hi), str(len(ok)), mean["prompt_tokens"],
             mean["output_tokens"], str(heavy)]
        )  # fmt: skip
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.compare.window", description=__doc__)
    p.add_argument("out", type=Path, help="a bench.compare --out directory")
    p.add_argument("--window", default="20,75", help="simulated s, from,to (the run's window)")
    args = p.parse_args(argv)
    lo, hi = (float(x) for x in args.window.split(","))
    timelines = json.loads((args.out / "timelines.json").read_text())
    records = json.loads((args.out / "records.json").read_text())
    print(format_table(HEADERS, window_rows(timelines, records, lo, hi)))


if __name__ == "__main__":
    main()
