"""``python -m bench.faults``: the fault-injection suite's cases (``testing.fault_cases``) as a
table, each case run ``--repeat`` times on a fresh rig (``testing.faults``): the most requests
the backend had at once (exact, from its history), during the fault, from a lease into the
fault on ("late": a partition's second target), the bound, failed answers, whether anything
was still held, how soon the pool was used at 90% after the fault, and PASS / MISS (MISS names
the problems; each run's line above the table says them in full). ``--cases a,b`` runs those
only. A case marked as needing another part's fix names it after its MISS; a case that runs
here only (``suite=False``: today's outcome is chance) is measured like the others.

Exit status 0 when every run of every case PASSed, else 1.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.common.table import fmt, format_table
from testing.fault_cases import CASES, by_name
from testing.faults import Verdict, run_case

__all__ = ["main", "row"]

HEADERS = [
    "case",
    "max",
    "in fault",
    "late",
    "bound",
    "answers",
    "failed",
    "held",
    "90% after",
    "result",
]


def row(v: Verdict, needs: str | None) -> list[str]:
    result = "PASS" if v.ok else "MISS: " + ", ".join(v.misses())
    if needs:
        part = needs.split(":")[0]
        result += f" ({part})" if not v.ok else ""
        result += f" (marked xfail: {part}; its fix is in?)" if v.ok else ""
    return [
        v.case,
        str(v.max_in_flight),
        str(v.max_in_fault),
        str(v.max_late),
        str(v.bound),
        str(v.answers),
        str(v.failure_count),
        "no" if not v.held_after else "yes",
        fmt(v.recovery_s) + ("" if v.recovery_s is None else " s"),
        result,
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__)
    ap.add_argument("--cases", help="comma-separated case names (default: all)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each case")
    ap.add_argument("--log-dir", type=Path, help="where the rigs' logs go (default: a temp dir)")
    args = ap.parse_args(argv)
    cases = [by_name(n) for n in args.cases.split(",")] if args.cases else list(CASES)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="llm-extproc-faults-"))
    rows, ok = [], True
    for case in cases:
        for k in range(args.repeat):
            verdict = run_case(case, log_dir / f"{case.name}-{k}")
            print(verdict.line(), flush=True)
            for problem in verdict.problems():
                print(f"  {problem}", flush=True)
            ok = ok and verdict.ok
            rows.append(row(verdict, case.xfail))
    print(format_table(HEADERS, rows))
    print(f"logs: {log_dir}")
    return 0 if ok else 1
