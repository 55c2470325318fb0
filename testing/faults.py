"""Fault injection against the shared pool, in the spirit of Jepsen: real parts, one invariant.

A :class:`Rig` is two (or three) gateways, each a real Envoy and a real sidecar
(``testing.gateways``), one real ``redis-server`` (and a second one, its replica, when a case
fails over), in front of the recording backend (``testing.recorder``), which keeps every
request's start and end: the backend's in-flight count at every instant is known exactly
(``testing.inflight``). A gateway's sidecar reaches Redis directly, or through a
``testing.tcp_proxy.TcpProxy`` of its own when the case cuts, slows or moves the network.

:class:`Load` (``testing.fault_load``) is the traffic: closed-loop clients, ``3 x`` the
pool's limit of them, split unevenly between the gateways (80/20 by default), each streaming
requests the backend holds for ``hold_ms``; bounded by a count and by the time the case runs.
A client whose gateway was retired (killed, shut down) sends to the next live one, as a load
balancer would.

:func:`run_case` runs one :class:`Case`: start the rig, start the load, wait until the backend
has the whole pool (``limit`` in flight), inject the fault (a blocking function, in a thread,
while the load goes on; it returns when the fault started and ended), keep the load on for two
leases and a window after the end, stop it, then wait (bounded) until nothing is held; the
history and the answers are kept in ``log_dir`` (``history.json``, ``answers.json``). The
:class:`Verdict` checks, per case:

1. **the limit**: the backend never had more than ``case.bound`` (the pool's limit unless the
   case states another) requests in flight, at any instant of the run;
2. **no failures**: every answer is a 200, or a 429 / 503 with ``retry-after``, except those of
   a retired gateway after it was retired;
3. **nothing held afterwards, everyone back**: every live sidecar's pool has nothing in flight
   and holds no lease, and Redis has no live lease (every ``*leases`` sorted set of databases
   0 and 1); every live sidecar is in shared mode again (none left degraded);
4. **use after the fault**: within two leases of the fault's end, a window of ``USAGE_WINDOW_S``
   averaged at least 90% of the limit in flight;
5. where the case says so (``stays_shared``), no sidecar went degraded at all.

The cases are in ``testing.fault_cases``; ``tests/shared/test_fault_injection.py`` runs each
as a test and ``python -m bench.faults`` prints them as a table.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from redis import Redis

from testing.fault_load import Answer, Load
from testing.gateways import Gateways
from testing.harness import scrape
from testing.inflight import Event, History, first_at, max_in_flight, time_to_usage
from testing.redis import RedisServer
from testing.tcp_proxy import TcpProxy
from testing.wait import until

__all__ = [
    "LEASE_S",
    "LIMIT",
    "PREFIX",
    "Answer",
    "Case",
    "Load",
    "Rig",
    "Verdict",
    "policy_text",
    "run_case",
]

LIMIT = 12
LEASE_S = 2.0
TIMEOUT_MS = 250
PREFIX = "faults"
USAGE = 0.9  # of the limit, within two leases of the fault's end
USAGE_WINDOW_S = 0.5
RECORDER = [sys.executable, "-m", "testing.recorder", "--port", "{port}"]


def policy_text(
    *,
    redis_url: str = "{redis}",
    limit: int = LIMIT,
    prefix: str = PREFIX,
    lease_s: float = LEASE_S,
    timeout_ms: int = TIMEOUT_MS,
    replicas: int = 2,
    adaptive: bool = False,
) -> str:
    """The suite's policy: one bucket on a shared pool (``adaptive``: a limit fixed at
    ``limit`` by ``min = max``, so that one replica leads, on the recorder's ``/metrics``)."""
    pool = f"""  max_concurrency: {limit}
  shared:
    redis: "{redis_url}"
    key_prefix: {prefix}
    lease: {int(lease_s * 1000)}ms
    timeout: {timeout_ms}ms
    replicas: {replicas}
"""
    if adaptive:
        pool += f"  adaptive: {{min: {limit}, max: {limit}, initial: {limit}}}\n"
    backend = 'backend: {metrics: ["{backend}/metrics"]}\n' if adaptive else ""
    return f"""{backend}pool:
{pool}buckets:
  - {{name: all, queue_timeout: 5s, max_queue: 500}}
"""


class Rig:
    """The parts (module docstring). ``proxied``: each sidecar reaches Redis through a proxy
    of its own (``proxies[i]``); ``replica``: a second ``redis-server``, replica of the
    first, for a failover."""

    def __init__(
        self,
        log_dir: Path,
        *,
        gateways: int = 2,
        proxied: bool = False,
        replica: bool = False,
        adaptive: bool = False,
        sidecar_args: Sequence[str] = (),
    ) -> None:
        self.log_dir = log_dir
        self.n = gateways
        self.adaptive = adaptive
        log_dir.mkdir(parents=True, exist_ok=True)
        self.g = Gateways(
            gateways,
            ["{redis}"] * gateways,  # replaced below, once the ports are known
            log_dir,
            backend_argv=RECORDER,
            sidecar_args=["--watch-interval", "0", *sidecar_args],
        )
        self.proxies = [TcpProxy(self.g.redis.port) for _ in range(gateways)] if proxied else []
        self.replica = RedisServer(log_dir / "replica") if replica else None
        self._probe: int | None = None  # replica_in_sync's probe, once written
        self.urls = [self.redis_url_of(i) for i in range(gateways)]
        self.g.policy = [
            policy_text(redis_url=u, adaptive=adaptive, replicas=gateways) for u in self.urls
        ]

    def redis_url_of(self, gateway: int, db: int = 0) -> str:
        port = self.proxies[gateway].port if self.proxies else self.g.redis.port
        return f"redis://127.0.0.1:{port}/{db}"

    @property
    def redis(self) -> RedisServer:
        return self.g.redis

    @property
    def backend_url(self) -> str:
        return self.g.backend_url

    def start(self) -> Rig:
        try:
            for proxy in self.proxies:
                proxy.start()
            if self.replica is not None:
                (self.log_dir / "replica").mkdir(exist_ok=True)
                self.replica.start()
            self.g.start()
            if self.replica is not None:
                for server in (self.redis, self.replica):
                    _diskless(self.client(server))
                self.client(self.replica).replicaof("127.0.0.1", self.redis.port)
                until(lambda: self.replica_in_sync(), "the replica in sync", limit_s=10)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self.g.stop()
        if self.replica is not None:
            self.replica.stop()
        for proxy in self.proxies:
            proxy.stop()

    def __enter__(self) -> Rig:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self.g.dump_logs()
        self.stop()

    # --- what the parts say --------------------------------------------------------------------

    def client(self, server: RedisServer | None = None, db: int = 0) -> Redis:
        port = (server or self.redis).port
        return Redis(host="127.0.0.1", port=port, db=db, socket_timeout=5)

    def replica_in_sync(self) -> bool:
        """The replica's link is up and the primary's writes reach it: a probe written on
        the primary is on the replica. The link alone is not enough: after a diskless full
        sync the primary streams nothing until the replica's first REPLCONF ACK, up to a
        second later (its log: "Waiting for REPLCONF ACK from slave to enable streaming"), so
        a failover in that second loses every write since the sync. That was the failover
        case's 17-19 on 12: the promoted replica's replication offset was 1, and the leases
        granted since the sync were not on it."""
        assert self.replica is not None
        info = self.client(self.replica).info("replication")
        if info.get("master_link_status") != "up":
            return False
        if self._probe is None:
            self._probe = int(self.client().incr(_SYNC_PROBE))
        return _int(self.client(self.replica).get(_SYNC_PROBE)) >= self._probe

    def debug(self, gateway: int) -> dict[str, Any]:
        url = self.g.stacks[gateway].metrics_url.removesuffix("/metrics") + "/debug/queues"
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())["/pool"]  # type: ignore[no-any-return]

    def backend_now(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.backend_url}/inflight", timeout=5) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    def history(self) -> History:
        with urllib.request.urlopen(f"{self.backend_url}/history", timeout=10) as r:
            events = json.loads(r.read())["events"]
        return History.of(Event(t=t, delta=d) for t, d in events)

    def live_leases(self, server: RedisServer | None = None) -> int:
        """Unexpired leases in every ``*leases`` sorted set of databases 0 and 1 (on Redis's
        clock)."""
        total = 0
        for db in (0, 1):
            r = self.client(server, db)
            try:
                sec, usec = r.time()
                now = sec * 1000 + usec // 1000
                for key in r.scan_iter(match="*leases"):
                    total += int(r.zcount(key, now + 1, "+inf"))
            finally:
                r.close()
        return total

    def last_renewal_ms(self, replica: str) -> int | None:
        """When ``replica`` last renewed its leases, on Redis's clock (ms): its leases'
        earliest expiry less the lease (a ``RENEW`` moves every one of them); None while it
        holds none."""
        r = self.client()
        try:
            pairs = cast(
                list[tuple[bytes, float]],
                r.zrange("{" + PREFIX + "}:leases", 0, -1, withscores=True),
            )
        finally:
            r.close()
        mine = [int(score) for lease, score in pairs if lease.startswith(replica.encode() + b":")]
        return min(mine) - int(LEASE_S * 1000) if mine else None

    def just_after_renewal(self, gateway: int, limit_s: float = 3 * LEASE_S) -> None:
        """Return the moment the gateway's sidecar renewed its leases (Redis polled every
        5 ms): a fault injected now comes a whole renewal interval before its next one, so
        every other replica renews (and hears what Redis then counts) first."""
        replica = str(self.debug(gateway)["shared"]["replica"])
        first = until(lambda: self.last_renewal_ms(replica), "leases held", limit_s=limit_s) or 0
        until(
            lambda: (self.last_renewal_ms(replica) or 0) > first,
            "a renewal",
            limit_s=limit_s,
            every=0.005,
        )

    def redis_errors(self, gateway: int) -> float:
        """The sidecar's failed Redis calls so far, every call together."""
        m = scrape(self.g.stacks[gateway])
        return sum(
            v for (name, _), v in m.items() if name == "llm_extproc_shared_redis_errors_total"
        )

    def reloads(self, gateway: int, result: str) -> float:
        key = ("llm_extproc_policy_reloads_total", (("result", result),))
        return scrape(self.g.stacks[gateway]).get(key, 0.0)

    def sidecar(self, gateway: int) -> Any:
        return self.g.stacks[gateway].procs["sidecar"]

    def signal(self, gateway: int, sig: int) -> None:
        self.sidecar(gateway).kill(sig)

    def reload_all(self, texts: Sequence[str], *, result: str = "ok") -> None:
        """Write each gateway's policy file and SIGHUP its sidecar, all at once (a ConfigMap
        edit reaching every replica); return once each counted the reload as ``result``."""
        before = [self.reloads(i, result) for i in range(self.n)]
        for path, text in zip(self.g.policy_paths, texts, strict=True):
            path.write_text(text)
        for i in range(self.n):
            self.signal(i, signal.SIGHUP)
        until(
            lambda: all(self.reloads(i, result) > before[i] for i in range(self.n)),
            f"every sidecar's reload counted as {result}",
        )


# A key of the rig's own (not under the pool's key_prefix): written on the primary, read on
# the replica, to see the stream flow.
_SYNC_PROBE = "rig:sync-probe"


def _int(value: object) -> int:
    return int(value) if isinstance(value, (bytes, str, int)) else 0


def _diskless(r: Redis) -> None:
    """Replication without files: a full sync's RDB goes over the socket and is loaded from
    it (else each server writes a dump.rdb into its working directory, the repository)."""
    r.config_set("repl-diskless-sync", "yes")
    r.config_set("repl-diskless-sync-delay", "0")
    r.config_set("repl-diskless-load", "swapdb")


Fault = Callable[[Rig, Load], tuple[float, float]]


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    """One fault: ``inject(rig, load)`` blocks while it happens and returns when it started
    and ended (``time.monotonic()``). ``xfail``: the part whose fix is missing, and why."""

    @property
    def doc(self) -> str:
        return (self.inject.__doc__ or "").strip()

    name: str
    inject: Fault
    gateways: int = 2
    clients: tuple[int, ...] = (29, 7)  # 3 x LIMIT, 80/20
    hold_ms: int = 300
    max_requests: int = 4000
    proxied: bool = False
    replica: bool = False
    adaptive: bool = False
    sidecar_args: tuple[str, ...] = ()
    bound: int = LIMIT
    stays_shared: bool = False  # no sidecar may go degraded (a fault Redis itself rides out)
    suite: bool = True  # False: measured by bench.faults only (today's outcome is chance)
    xfail: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    case: str
    bound: int
    max_in_flight: int  # the whole run
    max_in_fault: int  # from the fault's start to two leases after its end
    max_late: int  # from a lease after the fault's start on (a partition's second bound)
    answers: int
    failures: tuple[str, ...]  # a few, as "gateway status"
    failure_count: int
    held_after: tuple[str, ...]  # what was still held, if anything
    went_degraded: tuple[int, ...]  # live gateways that went degraded, where none may
    recovery_s: float | None  # to USAGE of the limit after the fault's end
    fault_s: float
    peak_at_s: float | None  # when the run's maximum was first reached, from the fault's start

    def findings(self) -> list[tuple[str, str]]:
        """What broke the invariant: (a few words, in full) each."""
        out = []
        if self.max_in_flight > self.bound:
            out.append(
                (
                    f"{self.max_in_flight} > {self.bound}",
                    f"{self.max_in_flight} in flight at once (bound {self.bound})",
                )
            )
        if self.failure_count:
            out.append(
                (
                    f"{self.failure_count} failed",
                    f"{self.failure_count} failed answers: {', '.join(self.failures)}",
                )
            )
        if self.held_after:
            out.append(("held after", "held afterwards: " + "; ".join(self.held_after)))
        if self.went_degraded:
            out.append(("went degraded", f"gateways {list(self.went_degraded)} went degraded"))
        if self.recovery_s is None:
            out.append(
                (
                    f"not {USAGE:.0%} used",
                    f"the pool not used at {USAGE:.0%} within 2 leases of the fault's end",
                )
            )
        return out

    def problems(self) -> list[str]:
        return [full for _, full in self.findings()]

    def misses(self) -> list[str]:
        """:meth:`problems`, a few words each (a table's cell)."""
        return [short for short, _ in self.findings()]

    @property
    def ok(self) -> bool:
        return not self.problems()

    def line(self) -> str:
        rec = "-" if self.recovery_s is None else f"{self.recovery_s:.2f}s"
        peak = "" if self.peak_at_s is None else f", first at {self.peak_at_s:+.2f}s"
        return (
            f"{self.case}: max in flight {self.max_in_flight}{peak} (during the fault "
            f"{self.max_in_fault}, from a lease into it {self.max_late}; bound {self.bound}), "
            f"{self.answers} answers, "
            f"{self.failure_count} failed, {'nothing' if not self.held_after else 'something'} "
            f"held after, {USAGE:.0%} use {rec} after the fault ({self.fault_s:.2f}s long)"
        )


def _held(rig: Rig, live: Sequence[int]) -> list[str]:
    out = []
    for i in live:
        pool = rig.debug(i)
        shared = pool.get("shared", {})
        if pool["in_flight"] or shared.get("held"):
            out.append(f"gateway {i}: {pool['in_flight']} running, {shared.get('held')} leases")
        if shared.get("state") != "shared":
            out.append(f"gateway {i}: {shared.get('state')} ({str(shared.get('last_error'))[:90]})")
    leases = rig.live_leases()
    if leases:
        out.append(f"redis: {leases} live leases")
    return out


async def _drive(case: Case, rig: Rig) -> tuple[Load, float, float]:
    load = Load(rig.g.urls, case.clients, hold_ms=case.hold_ms, max_requests=case.max_requests)
    task = asyncio.ensure_future(load.run())
    try:
        await asyncio.to_thread(
            until, lambda: rig.backend_now()["in_flight"] >= LIMIT, "the pool full", limit_s=20
        )
        start, end = await asyncio.to_thread(case.inject, rig, load)
        await asyncio.sleep(max(0.0, end + 2 * LEASE_S + USAGE_WINDOW_S - time.monotonic()))
    finally:
        load.stop()
        await task
    return load, start, end


def _keep(log_dir: Path, h: History, load: Load, start: float, end: float) -> None:
    """The run's record beside its logs, for a look afterwards: ``history.json`` (the
    in-flight count after each event, and the fault's start and end) and ``answers.json``."""
    (log_dir / "history.json").write_text(
        json.dumps({"fault": [start, end], "times": h.times, "counts": h.counts})
    )
    (log_dir / "answers.json").write_text(
        json.dumps([[a.gateway, a.sent, a.done, a.status] for a in load.answers])
    )


def run_case(case: Case, log_dir: Path) -> Verdict:
    """Run ``case`` on a fresh rig under ``log_dir`` (module docstring)."""
    with Rig(
        log_dir,
        gateways=case.gateways,
        proxied=case.proxied,
        replica=case.replica,
        adaptive=case.adaptive,
        sidecar_args=case.sidecar_args,
    ) as rig:
        load, start, end = asyncio.run(_drive(case, rig))
        live = [i for i in range(rig.n) if i not in load.retired]
        held: list[str] = []
        try:
            until(lambda: not _held(rig, live), "nothing held", limit_s=3 * LEASE_S, every=0.1)
        except AssertionError:
            held = _held(rig, live)
        h = rig.history()
        _keep(log_dir, h, load, start, end)
        failures = load.failures()
        peak = first_at(h, max_in_flight(h))
        degraded = ("llm_extproc_shared_degraded_transitions_total", ())
        went = [i for i in live if scrape(rig.g.stacks[i]).get(degraded, 0.0) > 0]
        return Verdict(
            case=case.name,
            bound=case.bound,
            max_in_flight=max_in_flight(h),
            max_in_fault=max_in_flight(h, start, end + 2 * LEASE_S),
            max_late=max_in_flight(h, start + LEASE_S),
            answers=len(load.answers),
            failures=tuple(f"gw{a.gateway} {a.status}" for a in failures[:5]),
            failure_count=len(failures),
            held_after=tuple(held),
            went_degraded=tuple(went) if case.stays_shared else (),
            recovery_s=time_to_usage(
                h,
                end,
                level=USAGE * LIMIT,
                window_s=USAGE_WINDOW_S,
                within_s=2 * LEASE_S,
            ),
            fault_s=end - start,
            peak_at_s=None if peak is None else peak - start,
        )
