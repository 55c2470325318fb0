"""The lease decisions of one replica of a shared pool: a snapshot in, plain actions out.

Theory of operation
-------------------
Several gateway replicas draw one pool's slots from Redis as *leases* (the keys and the Lua
scripts: ``extproc.pool.shared.scripts``). Each replica's local admission core stays the authority
on local order (bands, shares, cost order, deadlines, eviction, disconnects); its local pool's
limit is the number of leases the replica holds (``LocalPool.set_leases``), so ``running <=
held`` on every replica and ``sum(held) <= limit`` in Redis: the pool is exact across replicas.
Waiters never leave their replica's queue; what moves between replicas is leases. Not shared:
``min_share`` is a fraction of the leases a replica holds, ``max_share`` and caps of the pool's
limit; ``max_tokens_in_flight`` bounds each replica's own requests; ``fail_fast`` is off (a
local release rate says nothing about the pool's).

*Demand* is, per band (a bucket priority, lower = more urgent), the local waiters that one
more lease each would let in (the gate's ``shared_view``). *Unmet* demand is that less the
spare leases (held, not running), taken from the most urgent bands first (``minus``): spares
serve those first. *Published* demand is the unmet demand as this replica's last call wrote
it to Redis; the others' demand is what their calls wrote, as the last reply or ``demand``
message told us (``View.others``, merged over replicas in ``View.theirs``).

Rules (each a function here, each with its table in ``tests/unit/test_lease_decisions.py``):

1. **Acquire** (``step``, shared mode only): with unmet demand and no ``ACQUIRE`` in flight,
   one ``ACQUIRE`` asks for all of it when the pool has not heard of some of it (a band with
   more waiters than published), when a lease was freed for us or for anyone (``force``), or
   at least every ``POLL_S`` (the fallback for lost messages). For one lease after a rejoin
   the ask stops at the rejoin cap (rule 9).
2. **Spares others want** (``step``): with no local demand and spares held, give back as many
   as the pool is above its limit or as the others wait for, whichever is more: for anyone
   when the pool is above its limit, else for the replica rule 4 picks with ``u = 0.5``.
3. **Release** (``on_release``): when a request ends while every lease is in use, the lease
   goes back for anyone if the pool is above its limit; else back for the replica rule 4 draws
   if ``return_decision`` says so: the others' most urgent band is more urgent than ours, or
   nobody waits here, or it is the same band, then with the probability of their part of
   that band's waiters, so replicas in one band are served in proportion to their waiters
   (keeping every lease while a local queue lasts would freeze the split forever). Otherwise
   the lease stays and the local core hands the slot on: no round trip. A request that ends
   while a spare is held only makes another spare (rule 2 and rule 5 deal with spares); one
   that ends while more run here than the leases held (after a rejoin) gives nothing back
   and lets nobody in: the over-admission drains, one request at a time.
4. **Recipient** (``recipient``): a lease given back while others wait is *for* one replica
   of the others' most urgent band, drawn in proportion to its waiters there; Redis keeps it
   for that replica for ``HANDOFF_S`` and tells it (``freed``). Given back for anyone, it
   would go to whichever ``ACQUIRE`` came first, and pub/sub delivers to the subscribers in
   the same order every time: one replica would win every race.
5. **Renew** (``renewal``, every lease / 3, one ``RENEW`` for all the leases): renew every id;
   give back the spares when nobody waits here (degraded: every lease beyond the running
   requests, since re-adding them would take what another replica's running requests need);
   claim one lease per running request that holds none (``RENEW_BATCH`` at most: the rest
   with the next renewals); write the unmet demand.
6. **Stale demand** (``step``): when the published demand overstates the unmet one (a band
   gone, or no more than half of it left), one ``RETURN`` without ids writes it again, so the
   others stop holding slots back for waiters we no longer have.
7. **Local limit** (``local_limit``): in shared mode, the leases held. Degraded, never more
   than the leases held while Redis still counts them (phase ``HOLDING``), and from the moment
   they expire none at all (phase ``EXPIRED``): the running requests run to their end, nobody
   new is admitted until a renewal succeeds. The expiry is this replica's, on its monotonic
   clock: the send time of the last successful renewal plus ``lease x 0.98`` less ``timeout``
   (``holding_until``): Redis, which scores a lease from its own clock when it runs the call,
   expires it no earlier, clock rates within 2% and a step of Redis's clock within ``timeout``.
   ``EXPIRED`` holds in shared mode too: leases not renewed in time count for nothing. A
   replica that has not reached Redis since it started runs on its local share (phase
   ``LOCAL_SHARE``, rule 8): it holds nothing to go by.
8. **Local share** (``share``, ``local_share``): ``limit // live`` plus one for the first
   ``limit % live`` live replicas by id, so the shares add up to the limit; a replica that
   never reached Redis takes ``limit // pool.shared.replicas``, at least 1, and with
   ``replicas`` unset 1: not knowing how many run, one is the most each may take that stays
   within its share for any number up to the limit (the whole limit, as a default of 1
   gave, made N replicas that never reached Redis run N x the limit). ``limit`` is the
   pool's as last heard; degraded, an adaptive pool's is what the replica's own controller
   finds (``extproc.pool.control.wiring``). Only a replica that never reached Redis runs on it.
9. **Rejoin** (``rejoin``): the first successful renewal while degraded ends degraded mode.
   For one lease after it, the replica acquires no more than ``max(held, share)``, counting
   its running requests that hold no lease (the next renewal claims them), the share
   as computed from the replicas seen before the outage (a restarted Redis knows only those
   that rejoined already): replicas still degraded run the leases they held, which a restarted
   Redis does not count, and replicas that never reached Redis run their shares.

10. **A failed call** (``degrades``, ``retry_after``): a call that failed otherwise than by its
   deadline (an error, the node lost, a reply refused), or the second failure in a row, makes
   the replica degraded. One call over ``timeout`` after a success fails alone: its ids are
   doubtful and go back with a renewal sent at once; acquisition goes on. A failed renewal is
   sent again ``POLL_S`` later, then after twice as long each time, at most the interval:
   the leases age meanwhile, and rule 7 stops admission at their expiry in either mode.

Slack: requests at the backend exceed the limit only (1) in a partition, where some replicas
reach Redis and others do not: once a cut-off replica's leases expire in Redis the others may
take them, while the requests it admitted before its own expiry still run (at most the leases
it held, and only for as long as those requests last: it admits nobody after its expiry),
(2) when a replica that never reached Redis runs its share, (3) after a Redis restarted empty,
for the leases the replicas still degraded hold. With Redis unreachable for every replica
(stopped, not restarted) there is none: each runs on leases Redis still counts, then on none.
``docs/scaling.md`` ("Redis unreachable: degraded mode") states the bound as a formula.

Nothing here reads a clock, draws a random number or does I/O: ``now`` and the uniforms ``u``
in [0, 1) come from the caller, the asyncio shell ``extproc.pool.shared.leases``, which does what
the actions say (the calls, their deadlines, pub/sub, the mode changes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

__all__ = [
    "NO_GRACE",
    "POLL_S",
    "RENEW_BATCH",
    "Acquire",
    "GiveBack",
    "Grace",
    "Mode",
    "Phase",
    "PublishDemand",
    "Renewal",
    "Step",
    "View",
    "degrades",
    "holding_until",
    "local_limit",
    "local_share",
    "merge",
    "minus",
    "on_release",
    "phase",
    "recipient",
    "rejoin",
    "renewal",
    "retry_after",
    "return_decision",
    "share",
    "step",
    "unmet",
    "wakes",
]

# A replica with unmet demand asks again at least this often (lost 'freed' messages).
POLL_S = 0.25
# At most this many ids claimed, and as many doubtful ones given back, in one renewal (the
# rest with the next ones): one RENEW stays short for Redis and within the call's timeout.
RENEW_BATCH = 256
# The leases' expiry as this replica sees it, a little early (clock rates differ; and the
# call's timeout less again: ``holding_until``).
_EXPIRY_MARGIN = 0.98

Demand = Mapping[int, int]  # band -> waiters


class Mode(StrEnum):
    SHARED = "shared"
    DEGRADED = "degraded"


class Phase(StrEnum):
    """Where a replica is that runs on something else than leases Redis counts (rule 7)."""

    HOLDING = "holding"  # degraded, on the leases held while Redis still counts them
    EXPIRED = "expired"  # the leases expired: nobody new admitted
    LOCAL_SHARE = "local_share"  # degraded, never reached Redis: on its local share


@dataclass(frozen=True, slots=True, kw_only=True)
class Grace:
    """After a rejoin: until ``until``, acquire only up to ``cap`` leases held (rule 9)."""

    until: float
    cap: int


NO_GRACE = Grace(until=float("-inf"), cap=0)


@dataclass(frozen=True, slots=True, kw_only=True)
class View:
    """What one replica knows between two events: its mode and clocks, the pool as last
    heard, the others' demand, its own calls. The decisions take it together with the
    moment's numbers (``now``, the leases ``held``, the local pool's ``running`` and
    ``demand``), which change with every request: the shell makes a view again only after
    something in it changed, so the request path copies nothing."""

    me: str
    mode: Mode
    # The pool as last heard: its limit, leases held by everyone, live replicas (by id).
    limit: int
    count: int
    replicas: Sequence[str]
    connected: bool  # a renewal succeeded since the start
    expected_replicas: int | None  # ``pool.shared.replicas``: the split before Redis was reached
    valid_until: float  # our leases are counted in Redis at least until then
    others: Mapping[str, Demand]  # the other replicas' demand, as last heard
    published: Demand  # our unmet demand as our last call wrote it
    grace: Grace = NO_GRACE
    acquiring: bool = False  # an ACQUIRE is in flight
    updating: bool = False  # a demand-only RETURN is in flight
    last_acquire: float = float("-inf")
    theirs: Demand = field(init=False)  # ``merge(others)``

    def __post_init__(self) -> None:
        object.__setattr__(self, "theirs", merge(self.others))


# --- actions -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Acquire:
    """One ``ACQUIRE`` for ``ask`` (per band)."""

    ask: Demand


@dataclass(frozen=True, slots=True, kw_only=True)
class GiveBack:
    """Give ``n`` leases back now, for replica ``to`` (None: for anyone)."""

    n: int
    to: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class PublishDemand:
    """One ``RETURN`` without ids: write the unmet demand as it is when the call goes out."""


Step = Acquire | GiveBack | PublishDemand


@dataclass(frozen=True, slots=True, kw_only=True)
class Renewal:
    """What one ``RENEW`` carries besides the ids held: ``back`` leases to give back,
    ``claim`` new ids for running requests that hold none, and the unmet demand."""

    back: int
    claim: int
    unmet: Demand


# --- demand tables -------------------------------------------------------------------------


def merge(others: Mapping[str, Demand]) -> dict[int, int]:
    """Everyone's waiters per band."""
    merged: dict[int, int] = {}
    for d in others.values():
        for band, n in d.items():
            merged[band] = merged.get(band, 0) + n
    return merged


def minus(demand: Demand, n: int) -> dict[int, int]:
    """``demand`` less ``n`` waiters, taken from the most urgent bands."""
    out: dict[int, int] = {}
    for band in sorted(demand):
        take = min(n, demand[band])
        n -= take
        if demand[band] - take > 0:
            out[band] = demand[band] - take
    return out


def _cap(demand: Demand, n: int) -> dict[int, int]:
    """The most urgent ``n`` waiters of ``demand``."""
    out: dict[int, int] = {}
    for band in sorted(demand):
        if n <= 0:
            break
        out[band] = min(n, demand[band])
        n -= out[band]
    return out


def _understated(unmet: Demand, published: Demand) -> bool:
    """Waiters the pool has not heard of: ask (the acquire tells the others too)."""
    return any(n > published.get(band, 0) for band, n in unmet.items())


def _overstated(unmet: Demand, published: Demand) -> bool:
    """Published demand makes others hold back for waiters we no longer have: a band gone,
    or no more than half of it left."""
    for band, n in published.items():
        now = unmet.get(band, 0)
        if now == 0 or 2 * now <= n:
            return True
    return False


def unmet(*, held: int, running: int, demand: Demand) -> dict[int, int]:
    """The local demand less the spare leases."""
    return minus(demand, max(0, held - running))


# --- who gets a lease ----------------------------------------------------------------------


def return_decision(mine: Demand, theirs: Demand, u: float) -> bool:
    """On a local release: give the lease back (True) or keep it for a local waiter (False).

    ``mine``, ``theirs``: waiters per band here and elsewhere. Back when the others' most
    urgent band is more urgent than ours, or nobody waits here; in the same band, back with
    the probability of their part of that band's waiters (rule 3)."""
    theirs_band = min((b for b, n in theirs.items() if n > 0), default=None)
    if theirs_band is None:
        return False
    mine_band = min((b for b, n in mine.items() if n > 0), default=None)
    if mine_band is None or theirs_band < mine_band:
        return True
    if theirs_band > mine_band:
        return False
    m, o = mine[mine_band], theirs[theirs_band]
    return u < o / (m + o)


def recipient(others: Mapping[str, Demand], u: float) -> str | None:
    """Who a lease given back is for: a replica waiting in the most urgent band of the
    others, drawn in proportion to its waiters there (rule 4); None when nobody waits."""
    band = min((b for d in others.values() for b, n in d.items() if n > 0), default=None)
    if band is None:
        return None
    weights = sorted((r, d[band]) for r, d in others.items() if d.get(band, 0) > 0)
    point = u * sum(n for _, n in weights)
    for replica, n in weights:
        point -= n
        if point < 0:
            return replica
    return weights[-1][0]


def on_release(
    v: View, *, held: int, running: int, demand: Demand, u_back: float, u_whom: float
) -> GiveBack | None:
    """A local slot is about to be freed (rule 3): None keeps its lease here. While more
    run here than the leases held (``running > held``: requests the pool had no room for at
    a rejoin), the request that ends is counted as one of those: its slot held no lease, and
    handing one on would keep the over-admission from draining."""
    if v.mode is not Mode.SHARED or held == 0 or running != held:
        return None
    if v.count > v.limit:
        return GiveBack(n=1, to=None)
    if return_decision(demand, v.theirs, u_back):
        return GiveBack(n=1, to=recipient(v.others, u_whom))
    return None


def step(
    v: View, *, now: float, held: int, running: int, demand: Demand, force: bool = False
) -> Step | None:
    """What to do for the demand now (rules 1, 2 and 6); ``force``: a lease was freed for
    us or for anyone, ask even if the pool has heard of every waiter."""
    if v.mode is not Mode.SHARED:
        return None
    spare = max(0, held - running)
    want = minus(demand, spare)
    if not demand and spare:
        wanted = max(v.count - v.limit, sum(v.theirs.values()))
        if wanted > 0:
            to = None if v.count > v.limit else recipient(v.others, 0.5)
            return GiveBack(n=min(spare, wanted), to=to)
    if v.acquiring:
        return None
    if want:
        if now < v.grace.until:  # the running requests without a lease claim one (rule 5)
            want = _cap(want, v.grace.cap - max(held, running))
        if want and (force or _understated(want, v.published) or now - v.last_acquire >= POLL_S):
            return Acquire(ask=want)
    if not v.updating and _overstated(want, v.published):
        return PublishDemand()
    return None


def renewal(v: View, *, held: int, running: int, demand: Demand) -> Renewal:
    """What the next ``RENEW`` gives back, claims and writes (rule 5)."""
    back = 0
    if (not demand or v.mode is Mode.DEGRADED) and held > running:
        back = held - running
    held -= back
    return Renewal(
        back=back,
        claim=min(RENEW_BATCH, max(0, running - held)),
        unmet=minus(demand, max(0, held - running)),
    )


def wakes(to: str, me: str) -> bool:
    """A ``freed`` message for ``to`` ('' anyone) is worth an ``ACQUIRE`` here: a lease
    handed to another replica is not ours to race for."""
    return to in ("", me)


# --- the local limit and degraded mode -----------------------------------------------------


def local_share(limit: int, replicas: Sequence[str], me: str) -> int:
    """This replica's part of ``limit`` when Redis is gone: the live replicas split it
    evenly, the remainder going to the first ones by id, so the parts add up to ``limit``."""
    everyone = sorted(set(replicas) | {me})
    base, extra = divmod(max(0, limit), len(everyone))
    return base + (1 if everyone.index(me) < extra else 0)


def share(v: View) -> int:
    """The local share (rule 8)."""
    if not v.connected:
        if v.expected_replicas is None:
            return min(1, v.limit)
        return max(1, v.limit // v.expected_replicas)
    return local_share(v.limit, v.replicas, v.me)


def phase(v: View, now: float) -> Phase | None:
    """None in shared mode while the leases count; else where the replica is (rule 7)."""
    if v.connected and now >= v.valid_until:
        return Phase.EXPIRED
    if v.mode is Mode.SHARED:
        return None
    return Phase.HOLDING if v.connected else Phase.LOCAL_SHARE


def local_limit(v: View, *, now: float, held: int) -> int:
    """What the local pool may run now (rule 7)."""
    match phase(v, now):
        case Phase.EXPIRED:
            return 0
        case Phase.LOCAL_SHARE:
            return share(v)
        case _:
            return held


def holding_until(sent: float, lease_s: float, timeout_s: float) -> float:
    """Leases renewed by a call sent at ``sent`` are counted in Redis at least until then
    (rule 7)."""
    return sent + lease_s * _EXPIRY_MARGIN - timeout_s


def rejoin(now: float, lease_s: float, held: int, share_before: int) -> Grace:
    """The grace after a rejoin (rule 9); ``share_before``: the share computed from the
    replicas seen before the rejoining renewal's answer."""
    return Grace(until=now + lease_s, cap=max(held, share_before))


def degrades(*, timed_out: bool, in_a_row: int) -> bool:
    """Whether a failed call makes the replica degraded (rule 10): ``timed_out``, it ran
    past its deadline; ``in_a_row``, the failed calls in a row, this one included."""
    return not timed_out or in_a_row > 1


def retry_after(failed: int, interval_s: float) -> float:
    """When the next renewal goes after ``failed`` ones in a row (rule 10)."""
    return min(interval_s, POLL_S * 2.0 ** min(failed - 1, 32))
