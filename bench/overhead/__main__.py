"""The command line of ``python -m bench.overhead`` and the order of its steps (see
``bench/overhead/__init__.py`` for what each step measures)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from bench.micro.admission_cost import admission_costs
from bench.micro.tenant_cost import tenant_costs
from bench.overhead.h2load import closed_loop, h2load_binary, warm_up
from bench.overhead.held import held_queue
from bench.overhead.meters import CpuMeter, log
from bench.overhead.openloop import http_request, open_loop_runs
from bench.overhead.procs import Bench
from bench.overhead.profile import profile_sidecar, pyspy_binary
from bench.overhead.report import report, targets
from bench.overhead.ways import (
    CHAT_PATH,
    CLASS_HEADER,
    FLOOR,
    NAIVE,
    REDIS,
    SERVERS,
    SIDECAR,
    SIDECAR_REDIS,
    SIDECAR_RW,
    SIDECAR_SHARED,
    WAYS,
    chat_body,
    listener_of,
)
from testing.redis import redis_binary
from testing.stack import REPO, envoy_binary

__all__ = ["main", "run"]


def wait_for_first_grant(bench: Bench, bodies: dict[str, bytes], limit_s: float = 60.0) -> None:
    """A pool that starts on an empty Redis grants nothing for its first lease (the fence,
    docs/scaling.md): retry one request of the shared way until it is answered 200, so that
    no way is measured before its pool serves."""
    deadline = time.monotonic() + limit_s
    while True:
        req = urllib.request.Request(
            bench.url(listener_of(SIDECAR_REDIS)),
            data=bodies[SIDECAR_REDIS],
            headers={"content-type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=limit_s) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as e:  # 429 while the fence stands
            if time.monotonic() >= deadline:
                raise RuntimeError(f"{SIDECAR_REDIS}: no grant within {limit_s:.0f}s ({e})") from e
            time.sleep(0.5)


def sanity_check(bench: Bench, bodies: dict[str, bytes]) -> None:
    """Each way answers 200; the sidecar really runs (it echoes the effective max_tokens); the
    shared-pool sidecar is in shared mode (it reached Redis) and Redis served its scripts."""
    calls = bench.redis_script_calls()
    expect = {FLOOR: None, NAIVE: None, SIDECAR: "128", SIDECAR_RW: "256", SIDECAR_REDIS: "128"}
    wait_for_first_grant(bench, bodies)
    for way in WAYS:
        req = urllib.request.Request(
            bench.url(listener_of(way)),
            data=bodies[way],
            headers={"content-type": "application/json", CLASS_HEADER[0]: CLASS_HEADER[1]},
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            got = r.headers.get("x-llm-max-tokens") or None
            if r.status != 200 or got != expect[way]:
                raise RuntimeError(f"{way}: status {r.status}, x-llm-max-tokens {got!r}")
    state = bench.scrape(SIDECAR_SHARED).get("llm_extproc_shared_state")
    if state != 0:
        raise RuntimeError(f"{SIDECAR_REDIS}: llm_extproc_shared_state {state} (0: shared)")
    if bench.redis_script_calls() <= calls:
        raise RuntimeError(f"{SIDECAR_REDIS}: no script call reached Redis")


def run(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """Every step in order; all figures as one JSON-able dict."""
    bodies = {way: chat_body(with_max_tokens=way != SIDECAR_RW) for way in WAYS}
    body_files: dict[str, Path] = {}
    for way, body in bodies.items():
        body_files[way] = log_dir / f"body-{way.replace('+', '-')}.json"
        body_files[way].write_bytes(body)
    res: dict[str, Any] = {"config": vars(args).copy(), "log_dir": str(log_dir)}
    res["config"]["body_bytes"] = len(bodies[SIDECAR])
    res["config"]["body_bytes_rw"] = len(bodies[SIDECAR_RW])

    with Bench(log_dir, held_max_queue=max(args.held, args.held_burst) + 1000) as bench:
        port = {w: bench.ports.listeners[listener_of(w)] for w in WAYS}
        requests = {
            w: http_request(f"127.0.0.1:{port[w]}", CHAT_PATH, bodies[w], [CLASS_HEADER])
            for w in WAYS
        }
        pids = {"envoy": bench.pid("envoy"), **{s: bench.pid(s) for s in (*SERVERS, REDIS)}}
        sanity_check(bench, bodies)
        with CpuMeter(pids) as idle:
            time.sleep(2.0)
        res["idle_cpu_pct"] = {k: 100 * v / idle.wall_s for k, v in idle.delta.items()}
        res["other_cores_at_start"] = idle.other_cores()

        warm_up(bench, body_files, args.warmup)
        res["open_loop"] = open_loop_runs(
            bench,
            port,
            requests,
            pids,
            args.rates,
            args.open_seconds,
            args.rounds,
            redis_calls=bench.redis_script_calls,
        )
        res["closed_loop"] = closed_loop(
            bench, body_files, pids, args.connections, args.closed_seconds, log_dir
        )
        if args.profile:
            res["profile"] = profile_sidecar(
                bench, body_files, args.connections, args.profile_seconds, log_dir
            )
        if args.held:
            res["held"] = held_queue(
                bench,
                body_files[SIDECAR],
                bodies[SIDECAR],
                args.held,
                args.held_rate,
                args.held_burst,
                log_dir,
            )

    # In process, the servers stopped.
    log("admission cost against queue length (in process)")
    res.update(admission_costs(args.gate_ops))
    if args.tenant_ops:
        log("admission cost against tenants tracked (in process)")
        res["tenants"] = tenant_costs(args.tenant_ops)
    res["targets"] = targets(res)
    return res


def environment() -> dict[str, str]:
    """What the figures were measured on: commit, CPUs, Envoy, Python, grpcio, protobuf."""
    import google.protobuf
    import grpc

    def cmd(*argv: str) -> str:
        # Only labels the report (git may be missing, or this not be a checkout).
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            return subprocess.run(
                argv, capture_output=True, text=True, cwd=REPO, timeout=10
            ).stdout.strip()
        return "?"

    commit = cmd("git", "rev-parse", "--short", "HEAD")
    dirty = cmd("git", "status", "--porcelain", "--untracked-files=no", "extproc")
    envoy = cmd(envoy_binary(), "--version")
    m = re.search(r"version: \S+/(\d+\.\d+\.\d+)", envoy)
    return {
        "commit": commit + (" + uncommitted changes in extproc/" if dirty else ""),
        "cpus": str(os.cpu_count()),
        "envoy": m.group(1) if m else envoy[:60],
        "python": sys.version.split()[0],
        "grpcio": grpc.__version__,
        "protobuf": google.protobuf.__version__,
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.overhead",
        description="What Envoy ext_proc, a naive grpc.aio server and the sidecar add per request.",
    )
    parser.add_argument(
        "--rates",
        default="100,500,1000",
        help="open-loop rates, req/s, comma-separated (default 100,500,1000)",
    )
    parser.add_argument(
        "--open-seconds",
        type=float,
        default=12.0,
        help="open-loop seconds per way and rate, over all rounds (default 12)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="open-loop rounds, the order of the ways alternating (default 2)",
    )
    parser.add_argument(
        "--closed-seconds",
        type=float,
        default=10.0,
        help="closed-loop seconds per way (default 10)",
    )
    parser.add_argument(
        "--connections", type=int, default=32, help="closed-loop HTTP/1.1 connections (default 32)"
    )
    parser.add_argument("--warmup", type=int, default=2000, help="warm-up requests per way")
    parser.add_argument(
        "--held",
        type=int,
        default=10000,
        help="requests queued behind one held slot (0: skip; default 10000)",
    )
    parser.add_argument(
        "--held-rate",
        type=float,
        default=500.0,
        help="rate at which the held queue is filled, req/s (default 500)",
    )
    parser.add_argument(
        "--held-burst",
        type=int,
        default=10000,
        help="requests sent at once into the held queue afterwards (0: skip; default 10000)",
    )
    parser.add_argument(
        "--gate-ops",
        type=int,
        default=2000,
        help="operations per queue length in the in-process admission test",
    )
    parser.add_argument(
        "--tenant-ops",
        type=int,
        default=5000,
        help="requests per population in the in-process tenant test (1 tenant, 10,000 "
        "tracked, fresh keys; 0: skip)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also profile the sidecar under load with py-spy (needs py-spy in the venv)",
    )
    parser.add_argument("--profile-seconds", type=float, default=10.0)
    parser.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    parser.add_argument("--log-dir", type=Path, help="keep logs here (default: a temp dir)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.rates = [int(r) for r in str(args.rates).split(",") if r.strip()]
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="llm-extproc-overhead-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    # Fail early, before starting anything.
    h2load_binary()
    redis_binary()  # sidecar+redis's redis-server
    if args.profile:
        pyspy_binary()
    # SIGTERM (make, CI) unwinds like Ctrl-C, so every process started here is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.monotonic()
    res = run(args, log_dir)
    res["env"] = environment()
    res["config"].pop("json", None)
    res["config"].pop("log_dir", None)
    res["wall_s"] = time.monotonic() - t0
    print(report(res))
    print(f"\n(run took {res['wall_s']:.0f} s; logs in {log_dir})")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
