"""h2load runs: the warm-up and the closed loop (the maximum sustainable rate of each way).

Closed loop: h2load over HTTP/1.1, ``--connections`` connections with one request each at a
time, for ``--closed-seconds``; latency from h2load's per-request log, CPU per request of the
ext_proc server and of Envoy from /proc.
"""

from __future__ import annotations

import re
import resource
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common.stats import percentile_scaled
from bench.overhead.meters import CpuMeter, log
from bench.overhead.procs import Bench
from bench.overhead.ways import CLASS_HEADER, WAYS, listener_of, metered_of, server_of

__all__ = [
    "H2Load",
    "closed_loop",
    "h2load_args",
    "h2load_binary",
    "parse_h2load",
    "run_h2load",
    "warm_up",
]


def h2load_binary() -> str:
    path = shutil.which("h2load")
    if path is None:
        raise FileNotFoundError(
            "h2load not found: install nghttp2-client (apt-get install -y nghttp2-client)"
        )
    return path


@dataclass(slots=True)
class H2Load:
    requests: int
    succeeded: int
    failed: int
    status_2xx: int
    rate: float
    wall_s: float
    cpu_s: float  # h2load's own CPU
    latency_s: list[float]
    output: str


_H2_REQUESTS = re.compile(
    r"requests: (\d+) total, \d+ started, (\d+) done, (\d+) succeeded, (\d+) failed"
)
_H2_STATUS = re.compile(r"status codes: (\d+) 2xx")
_H2_RATE = re.compile(r"finished in ([\d.]+)(?:m?s), ([\d.]+) req/s")


def h2load_args(
    url: str, body_file: Path, headers: Sequence[tuple[str, str]], *args: str, log: Path | None
) -> list[str]:
    """h2load's command line: POST ``body_file`` (JSON) to ``url`` with ``headers``;
    ``log``: h2load's per-request log file (for latencies)."""
    argv = [h2load_binary(), *args, "-d", str(body_file), "-H", "content-type: application/json"]
    for k, v in headers:
        argv += ["-H", f"{k}: {v}"]
    if log is not None:
        argv += ["--log-file", str(log)]
    return [*argv, url]


def parse_h2load(out: str, wall: float, cpu: float, log: Path | None) -> H2Load:
    m = _H2_REQUESTS.search(out)
    s = _H2_STATUS.search(out)
    r = _H2_RATE.search(out)
    if not (m and s and r):
        raise RuntimeError(f"unexpected h2load output:\n{out}")
    latency: list[float] = []
    if log is not None and log.exists():
        with open(log) as f:
            for line in f:
                parts = line.split("\t")
                if len(parts) >= 3 and parts[1] == "200":
                    latency.append(int(parts[2]) / 1e6)
    return H2Load(
        requests=int(m.group(2)),
        succeeded=int(m.group(3)),
        failed=int(m.group(4)),
        status_2xx=int(s.group(1)),
        rate=float(r.group(2)),
        wall_s=wall,
        cpu_s=cpu,
        latency_s=latency,
        output=out,
    )


def run_h2load(argv: list[str], log: Path | None, timeout: float) -> H2Load:
    """Run h2load to the end; its figures, and its own CPU (RUSAGE_CHILDREN)."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    wall = time.monotonic() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return parse_h2load(proc.stdout + proc.stderr, wall, cpu, log)


def warm_up(bench: Bench, body_files: dict[str, Path], n: int) -> None:
    """``n`` requests per way (8 connections); every one must be answered 2xx."""
    log(f"warm-up: {n} requests per way")
    for w in WAYS:
        warm = run_h2load(
            h2load_args(
                bench.url(listener_of(w)),
                body_files[w],
                [CLASS_HEADER],
                "--h1",
                "-c",
                "8",
                "-n",
                str(n),
                log=None,
            ),
            None,
            120,
        )
        if warm.status_2xx != n:
            raise RuntimeError(f"warm-up of {w} failed:\n{warm.output}")


def closed_loop(
    bench: Bench,
    body_files: dict[str, Path],
    pids: dict[str, int],
    connections: int,
    seconds: float,
    log_dir: Path,
) -> dict[str, dict[str, Any]]:
    """Every way under h2load's closed loop; {way: figures}."""
    out: dict[str, dict[str, Any]] = {}
    for w in WAYS:
        log(f"closed loop: {w}, {connections} connections, {seconds:g} s")
        lf = log_dir / f"h2load-closed-{w.replace('+', '-')}.log"
        with CpuMeter(pids) as m:
            r = run_h2load(
                h2load_args(
                    bench.url(listener_of(w)),
                    body_files[w],
                    [CLASS_HEADER],
                    "--h1",
                    "-c",
                    str(connections),
                    "-D",
                    f"{seconds:g}",
                    log=lf,
                ),
                lf,
                seconds + 60,
            )
        bench.check_alive()
        lf.unlink(missing_ok=True)
        server = server_of(w)
        # The way's server CPU: its ext_proc server's (and sidecar+redis's redis-server's).
        server_cpu = sum(m.delta[x] for x in metered_of(w))
        out[w] = {
            "rate": r.rate,
            "requests": r.succeeded,
            "failed": r.failed,
            "non_2xx": r.requests - r.status_2xx,
            "p50_ms": percentile_scaled(r.latency_s, 50, 1e3),
            "p99_ms": percentile_scaled(r.latency_s, 99, 1e3),
            "envoy_cpu_us": 1e6 * m.delta["envoy"] / max(1, r.succeeded),
            "server_cpu_us": (1e6 * server_cpu / max(1, r.succeeded)) if server else None,
            "server_cores": (server_cpu / m.wall_s) if server else None,
            "envoy_cores": m.delta["envoy"] / m.wall_s,
            "h2load_cores": r.cpu_s / m.wall_s,
            "other_cores": m.other_cores(r.cpu_s),
        }
    return out
