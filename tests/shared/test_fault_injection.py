"""The fault-injection suite (``testing.faults``): each case of ``testing.fault_cases``, and the
cases below, on a fresh rig of two gateways (three for the ``_3`` cases; real Envoy + sidecar
each), a real redis-server and the recording backend, at 3x overload split 80/20 (60/25/15);
the verdict's line (the most in flight at once, and the rest) is printed, its problems are the
failure.

A case that needs another part's fix is ``xfail(strict=True)`` with the reason the case gives:
it must fail today, and the mark goes when the fix is merged. A case whose outcome today is
chance (``suite=False``; none today) is left to ``python -m bench.faults``."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from testing.fault_cases import CASES
from testing.faults import LEASE_S, LIMIT, PREFIX, TIMEOUT_MS, Case, Load, Rig, run_case
from testing.leases import replica, until

pytestmark = [pytest.mark.envoy, pytest.mark.redis, pytest.mark.slow]


# The sidecars' commands are held this long while the fault and the newcomer's first call
# land (their calls stay well within the 250 ms timeout): the newcomer's comes first, every run.
HOLD_S = 0.05


def _newcomer_after_flushall(rig: Rig, load: Load) -> tuple[float, float]:
    """FLUSHALL just after the busy gateway renewed, then a replica that has just started (a
    rollout, a restart, a scale-up: a lease manager of the pool's, running nothing, that
    reaches Redis directly) sends the first script after the loss, its first ``RENEW``: it
    knows of nobody, and the gateways' requests still run on the leases Redis lost. It stays
    a lease, renewing, then leaves."""

    async def newcomer() -> tuple[float, float]:
        url = f"redis://127.0.0.1:{rig.redis.port}/0"
        timeout_s = TIMEOUT_MS / 1000
        m, _ = replica(
            url,
            "newcomer",
            LIMIT,
            lease_s=LEASE_S,
            timeout_s=timeout_s,
            key_prefix=PREFIX,
            fresh=True,
        )
        flush = rig.client()
        flush.ping()  # (connected before the fault)
        rig.just_after_renewal(0)
        for proxy in rig.proxies:
            proxy.delay(HOLD_S)
        t = time.monotonic()
        flush.flushall()
        m.start()
        try:
            await until(lambda: m.ledger.connected, "the newcomer renewed")
            for proxy in rig.proxies:
                proxy.delay(0)
            await asyncio.sleep(LEASE_S)  # (the subject: a live replica of the pool)
        finally:
            end = time.monotonic()
            await m.close()
            flush.close()
        return t, end

    return asyncio.run(newcomer())


# Issue 31: the fence after a state loss must hold for a replica that has never renewed.
NEWCOMER_CASES = (Case(name="flushall_newcomer", inject=_newcomer_after_flushall, proxied=True),)


def _param(case: Case) -> object:
    marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
    return pytest.param(case, id=case.name, marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in (*CASES, *NEWCOMER_CASES) if c.suite])
def test_fault(case: Case, tmp_path: Path) -> None:
    verdict = run_case(case, tmp_path / case.name)
    print(verdict.line())
    assert verdict.ok, verdict.problems()
