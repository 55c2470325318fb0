"""How fast: the latency bounds of the end-to-end and shared-pool tests, timed on the tests'
own scenarios.

Why, how to run it and the latest figures: docs/performance.md, "Latency bounds of the
end-to-end scenarios (`bench.bounds`)". Each row: the bound, the figure in seconds, the target,
PASS / MISS (``n/a`` with the reason when the scenario did not produce the figure), and the
test whose scenario it times. The leases group runs no stack: lease managers on
``testing.leases``' fake local pool and a redis-server of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.bounds.scenarios import (
    BODIES_POLICY,
    FAULTS_POLICY,
    LOCKOUT_POLICY,
    ONE_SLOT,
    POOL_POLICY,
    QUEUE_POLICY,
    QUEUED_BYTES_POLICY,
    RELOAD_POLICY,
    SLOW_POLICY,
    Figures,
    bodies_group,
    leases_group,
    lockout_group,
    pool_group,
    queue_group,
    queued_bytes_group,
    reload_group,
    restart_group,
    scale_down_breakers,
    shutdown_group,
    slow_group,
    stall_group,
    timers,
    timers_group,
)
from bench.common.table import fmt, format_table
from testing.harness import running_stack
from testing.stack import Stack

__all__ = ["BOUNDS", "GROUPS", "Bound", "main", "report"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Bound:
    name: str
    group: str  # the scenario (one stack) that produces it
    target_s: float
    test: str  # the test whose scenario this is, and which keeps the functional fact


def _b(name: str, group: str, target_s: float, test: str) -> Bound:
    return Bound(name=name, group=group, target_s=target_s, test=test)


E2E, POOL, RELOAD = "test_e2e.py", "test_pool_through_envoy.py", "test_reload.py"
LEASES = "test_leases.py"
BOUNDS = [
    _b("slot_freed_after_stream", "queue", 0.5, f"{E2E}::test_slot_is_held_through_sse..."),
    _b("queue_timeout_eviction", "queue", 2.5, f"{E2E}::test_queue_timeout_evicts_with_429..."),
    _b("queue_full_refusal", "queue", 0.5, f"{E2E}::test_full_queue_rejects_at_once"),
    _b("leaver_dropped", "queue", 0.5, f"{E2E}::test_client_leaving_the_queue_frees_its_place"),
    _b("stayer_moves_up", "queue", 1.4, f"{E2E}::test_client_leaving_the_queue_frees_its_place"),
    _b("client_deadline", "pool", 1.3, f"{POOL}::test_a_stated_client_deadline_caps..."),
    _b("wait_too_long_refusal", "pool", 0.3, f"{POOL}::test_a_wait_that_cannot_fit..."),
    _b("route_share_eviction", "reload", 1.2, f"{RELOAD}::test_route_metadata_sets..."),
    _b("other_route_during_share", "reload", 1.0, f"{RELOAD}::test_route_metadata_sets..."),
    _b("free_share_slot", "reload", 1.0, f"{RELOAD}::test_route_metadata_sets..."),
    _b("sigterm_refuses_queued", "shutdown", 1.0, "test_failure.py::test_sigterm_drains..."),
    _b("sigterm_exit", "shutdown", 5.0, "test_failure.py::test_sigterm_drains..."),
    _b("sidecar_restart_recovery", "restart", 2.0, "test_faults.py::test_sidecar_killed..."),
    _b("stalled_upload_bystanders", "stall", 3.0, "test_corpus.py::test_stalled_chunked..."),
    _b("message_timeout_504", "timers", 5.0, "test_envoy_answers.py::test_a_sidecar_that..."),
    _b("backend_timeout_504", "timers", 3.0, "test_envoy_answers.py::test_envoys_own..."),
    _b("request_timeout_408", "timers", 3.5, "test_envoy_answers.py::test_envoys_own..."),
    _b("request_headers_timeout_408", "timers", 2.5, "test_envoy_answers.py::test_envoys_own..."),
    _b("route_timeout_stream_cut", "timers", 3.6, f"{POOL}::test_the_route_timeout_does_not..."),
    _b("worst_bodies_bystanders_p99", "bodies", 0.1, "test_large_bodies.py::test_a_burst..."),
    _b("queued_bytes_refusal", "bodies", 1.0, "test_large_bodies.py::test_bytes_held..."),
    _b("slow_uploads_bystanders_p99", "slow", 1.0, "test_slow_clients.py::test_slow_bodies..."),
    _b("dead_replica_leases_gone", "leases", 1.3, f"{LEASES}::test_a_dead_replicas_leases..."),
    _b("dead_replica_takeover", "leases", 1.3, f"{LEASES}::test_a_dead_replicas_leases..."),
    _b("leader_takeover", "leases", 1.63, f"{LEASES}::test_one_leader_publishes..."),
    _b("new_call_beside_idle_strangers", "lockout", 0.1, "test_h2_hostile.py::test_idle_str..."),
    _b("envoy_beside_idle_strangers", "lockout", 0.1, "test_idle_strangers.py::test_envoy_s..."),
]


# --- running them ------------------------------------------------------------------------------

# A group: its scenarios, each (policy, running_stack's keywords, the scenario on that stack);
# or, for a group without a stack, one scenario that gets a folder.
Group = tuple[str | None, dict[str, Any], Callable[[Stack], Awaitable[Figures]]]
GROUPS: dict[str, list[Group] | Callable[[Path], Awaitable[Figures]]] = {
    "queue": [(QUEUE_POLICY, {}, queue_group)],
    "pool": [(POOL_POLICY, {}, pool_group)],
    "reload": [(RELOAD_POLICY, {"rds": True}, reload_group)],
    "shutdown": [(ONE_SLOT, {}, shutdown_group)],
    "restart": [(FAULTS_POLICY, {}, restart_group)],
    "stall": [(None, {}, stall_group)],
    "timers": [(None, {"envoy_patch": timers}, timers_group)],
    "bodies": [(BODIES_POLICY, {}, bodies_group), (QUEUED_BYTES_POLICY, {}, queued_bytes_group)],
    "slow": [(SLOW_POLICY, {"envoy_patch": scale_down_breakers}, slow_group)],
    "leases": leases_group,  # no stack
    "lockout": [(LOCKOUT_POLICY, {"start_envoy": False}, lockout_group)],
}


def run_group(name: str, tmp: Path) -> tuple[Figures, str]:
    """The group's figures, and why some are missing ("" when none is)."""
    figures: Figures = {}
    group = GROUPS[name]
    try:
        if callable(group):  # no stack: the scenario gets a folder of its own
            return asyncio.run(asyncio.wait_for(group(tmp / name), 120)), ""
        for i, (policy, kwargs, scenario) in enumerate(group):
            with running_stack(tmp / f"{name}-{i}", policy, **kwargs) as stack:
                figures |= asyncio.run(asyncio.wait_for(scenario(stack), 120))
    except Exception as e:  # a scenario that breaks is reported, the others still run
        return figures, f"{type(e).__name__}: {e}"[:200]
    return figures, ""


def report(figures: Figures, reasons: dict[str, str]) -> tuple[str, int]:
    """The table, and how many bounds were missed."""
    rows, missed = [], 0
    for b in BOUNDS:
        if b.group not in reasons:
            continue
        got = figures.get(b.name)
        verdict = "n/a" if got is None else "PASS" if got < b.target_s else "MISS"
        missed += verdict == "MISS"
        note = b.test if got is not None else reasons[b.group] or "not measured"
        rows.append([b.name, fmt(got, 3), f"< {b.target_s:g}", verdict, note])
    return format_table(["bound", "seconds", "target", "verdict", "test"], rows), missed


@contextlib.contextmanager
def _tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="bench-bounds-") as d:
        yield Path(d)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bounds", description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="groups or bounds, comma-separated")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a bound is missed")
    args = ap.parse_args(argv)
    wanted = {w for w in args.only.split(",") if w}
    unknown = wanted - set(GROUPS) - {b.name for b in BOUNDS}
    if unknown:
        ap.error(f"unknown: {', '.join(sorted(unknown))}")
    groups = [g for g in GROUPS if not wanted or g in wanted or any(
        b.group == g and b.name in wanted for b in BOUNDS)]  # fmt: skip
    figures: Figures = {}
    reasons: dict[str, str] = {}
    with _tmp() as tmp:
        for name in groups:
            print(f"{name} ...", file=sys.stderr, flush=True)
            got, reasons[name] = run_group(name, tmp)
            figures |= got
    table, missed = report(figures, reasons)
    print(table)
    print(f"\n{missed} missed" if missed else "\nevery bound met")
    return 1 if args.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main())
