"""``--profile``: py-spy on the sidecar under closed-loop load, once with the kept and once with
the rewritten body; self time by category and by line of ours, inclusive time of our
functions."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.overhead.h2load import h2load_args, run_h2load
from bench.overhead.meters import log
from bench.overhead.procs import Bench
from bench.overhead.ways import CLASS_HEADER, SIDECAR, SIDECAR_RW, listener_of
from testing.stack import REPO

__all__ = ["PROFILED", "analyse_pyspy", "profile_sidecar", "pyspy_binary"]

# The ways the sidecar is profiled on.
PROFILED = (SIDECAR, SIDECAR_RW)

# Self time by the file its leaf frame is in: the first key contained in the path wins.
_CATEGORIES = (
    ("extproc/transport/", "transport (extproc/transport/)"),
    ("hpack/", "transport (hpack)"),
    ("uvloop/", "event loop"),
    ("extproc/", "ours (extproc/)"),
    ("asyncio/", "asyncio loop"),
    ("selectors.py", "asyncio loop"),
    ("google/protobuf", "protobuf python"),
    ("json/", "json"),
    ("prometheus_client", "prometheus_client"),
)
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^():]+)(?::(?P<line>\d+))?\)$")


def pyspy_binary() -> str:
    """py-spy on PATH or beside this Python; FileNotFoundError when there is none."""
    path = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(path).exists():
        raise FileNotFoundError("--profile needs py-spy: pip install py-spy into the venv")
    return path


def _source_line(file: str, line: int) -> str:
    path = REPO / file
    with contextlib.suppress(OSError, IndexError):
        return path.read_text().splitlines()[line - 1].strip()
    return ""


def analyse_pyspy(raw: Path, top: int = 15) -> dict[str, Any]:
    """Self time by category and by line, inclusive time of our functions, from py-spy's raw
    (collapsed) output with --threads. Time spent in C (cygrpc, upb, the json scanner) shows up
    as self time of the Python line that called it; lines of ours that await ``context.read``
    or ``context.write`` are counted as grpc I/O, not as our code."""
    total = 0
    by_cat: Counter[str] = Counter()
    by_line: Counter[str] = Counter()
    ours_incl: Counter[str] = Counter()
    by_thread: Counter[str] = Counter()
    for text in raw.read_text().splitlines():
        stack, _, count = text.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        thread = frames[0].split(": ", 1)[-1] if frames[0].startswith("thread") else "?"
        by_thread["MainThread" if thread == "MainThread" else "other threads"] += n
        leaf = frames[-1]
        m = _FRAME.match(leaf)
        file = m.group("file") if m else leaf
        line = int(m.group("line")) if m and m.group("line") else 0
        cat = next((c for key, c in _CATEGORIES if key in file), "other")
        if cat.startswith("ours"):
            src = _source_line(file, line)
            if "context.read" in src or "context.write" in src:
                cat = "grpc I/O awaited by ours"
            by_line[f"{file}:{line} {m.group('func') if m else ''}: {src[:70]}"] += n
        by_cat[cat] += n
        seen: set[str] = set()
        for f in frames[1:]:
            fm = _FRAME.match(f)
            if fm and "extproc/" in fm.group("file"):
                key = f"{fm.group('func')} ({fm.group('file')})"
                if key not in seen:
                    seen.add(key)
                    ours_incl[key] += n

    def share(c: Counter[str], k: int | None = None) -> list[tuple[str, float]]:
        return [(name, 100 * v / total) for name, v in c.most_common(k)] if total else []

    return {
        "samples": total,
        "threads": share(by_thread),
        "categories": share(by_cat),
        "our_lines": share(by_line, top),
        "our_functions_inclusive": share(ours_incl, top),
    }


def profile_sidecar(
    bench: Bench,
    body_files: dict[str, Path],
    connections: int,
    seconds: float,
    log_dir: Path,
) -> dict[str, Any]:
    """py-spy (250 Hz, non-blocking) on the sidecar during ``seconds`` of closed loop, per
    profiled way; {way: analyse_pyspy's figures and the raw file's path}. A py-spy that
    records nothing fails the run."""
    pyspy = pyspy_binary()
    out: dict[str, Any] = {}
    for w in PROFILED:
        log(f"profile: py-spy on the sidecar, closed loop on {w}, {seconds:g} s")
        raw = log_dir / f"pyspy-{w.replace('+', '-')}.txt"
        spy = subprocess.Popen(
            [
                pyspy,
                "record",
                "--pid",
                str(bench.pid(SIDECAR)),
                "--duration",
                f"{seconds:g}",
                "--rate",
                "250",
                "--format",
                "raw",
                "--threads",
                "--nonblocking",
                "--output",
                str(raw),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(0.5)
        run_h2load(
            h2load_args(
                bench.url(listener_of(w)),
                body_files[w],
                [CLASS_HEADER],
                "--h1",
                "-c",
                str(connections),
                "-D",
                f"{seconds + 1:g}",
                log=None,
            ),
            None,
            seconds + 60,
        )
        _, err = spy.communicate(timeout=60)
        if not raw.exists():
            raise RuntimeError(f"py-spy recorded nothing (exit {spy.returncode}): {err[-500:]}")
        out[w] = analyse_pyspy(raw)
        out[w]["raw"] = str(raw)
    return out
