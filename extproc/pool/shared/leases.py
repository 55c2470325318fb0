"""The lease manager: the asyncio shell that does what one replica's lease decisions say.

The theory of operation and the decisions are in ``decide`` (``extproc.pool.shared.decide``);
what the replica knows (its ids, the pool as last heard, its mode) in a ``Ledger``, which
``LeaseManager`` owns (``ledger``, changed only through its methods); the calls in ``client``
(replies decoded by ``replies``; keys and scripts in ``scripts``). This module owns what waits:
the clock, the calls in flight, pub/sub, the changes of mode, the tasks.

When it decides
---------------
- The gate's ``on_change`` (waiters or slots changed): one ``decide.step`` per loop turn
  (``call_soon``); so does a ``demand`` message, once the others' demand is updated.
- The gate's ``on_release`` (a slot is about to be freed): ``decide.on_release`` at once, so
  that a lease given back lowers the local limit before the core hands the slot on.
- A ``freed`` message for this replica or for anyone: ``decide.step`` with ``force``; when
  it comes while an ``ACQUIRE`` is in flight, the forced step follows that call's answer.
- Every ``TICK_S``: a ``RENEW`` when one is due (every ``lease / 3``; at once after a new
  static limit or a leader's new limit); in shared mode a step once ``POLL_S`` has passed
  since the last acquire; degraded, the local limit again.

At most one ``ACQUIRE``, one ``RENEW`` and one demand-only ``RETURN`` are in flight at once.

The limit: a static pool's is the policy's ``max_concurrency``. In an adaptive pool one leader
(elected and renewed in ``RENEW`` with ``SET NX PX lease``) runs the adaptive controller on
the pool's whole demand (``pool_demand``) and publishes its limit (``publish_limit``, sent
with the next renewal); every script reads it from Redis, so nobody acquires above a fresh
limit. If the leader dies, another replica takes over within the lease from the limit in
force; ``on_leader`` hears of every change.

Redis unreachable: a failed call makes the replica **degraded** unless it only ran past its
deadline once (``decide`` rule 10; the changes of mode, their log and the expiry timer:
``extproc.pool.shared.outage``); the ids it carried may be held and go back with the next
renewal. It runs on the leases it holds, from their expiry on none (rule 7). Renewals go on
as probes (rule 10's pace); the first that succeeds rejoins (rules 5 and 9).

Untrusted input (``extproc.pool.shared.replies``): what is refused is logged and counted
(``on_error("events")``, ``on_error("demand")``), a message dropped, a table taken as none.

Tasks: the ticker and the listener run under guards (``extproc.loops``: a failed round
is logged and counted, ``on_loop_error``, and the loop goes on) and are cancelled by
``close``; every call runs in a task kept until it ends (an error other than a failed call
is logged then). ``close`` waits for the calls up to the timeout, cancels what is left, then
gives every lease back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import secrets
import socket
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, TypeVar

from extproc.config.policy import SharedPolicy
from extproc.loops import Guard
from extproc.pool.shared import decide, replies
from extproc.pool.shared.client import CallFailed, PoolClient
from extproc.pool.shared.decide import POLL_S, Acquire, GiveBack, Mode, PublishDemand
from extproc.pool.shared.ledger import UNBOUNDED, Ledger, LocalPool
from extproc.pool.shared.outage import Outage

__all__ = ["HANDOFF_S", "POLL_S", "TICK_S", "LeaseManager", "LocalPool", "Mode"]

log = logging.getLogger("extproc.shared")  # the logger name operators filter on

_T = TypeVar("_T")

# How often the manager looks at its clocks (renewals, phases, polling).
TICK_S = 0.05
# A lease given back for one replica waits this long for it, then is free for anyone.
HANDOFF_S = 3 * POLL_S


class _Unreachable(Exception):
    """A Redis call failed; the manager has counted it (and is degraded, if rule 10 says)."""


class LeaseManager:
    def __init__(
        self,
        pool: LocalPool,
        policy: SharedPolicy,
        *,
        limit: int,
        adaptive: bool = False,
        bounds: tuple[int, int] = UNBOUNDED,
        replica: str | None = None,
        rand: Callable[[], float] = random.random,
        on_mode: Callable[[Mode], None] | None = None,
        on_error: Callable[[str], None] | None = None,
        on_leader: Callable[[bool], None] | None = None,
        on_loop_error: Callable[[str], None] | None = None,
    ) -> None:
        """``limit``: the policy's (a static pool) or the one to fall back to (adaptive: the
        leader's limit is used while one publishes). ``adaptive``: this replica would lead;
        ``bounds``: then its policy's ``min`` and ``max``. Made on the event loop it runs on."""
        me = replica or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.ledger = ledger = Ledger(policy, me, limit=limit, adaptive=adaptive, bounds=bounds)
        self._loop = asyncio.get_running_loop()
        self._client = PoolClient(policy, me)  # (logs a URL it cannot use)
        self.keys = self._client.keys
        self._pool = pool
        self._rand = rand
        self._on_error = on_error
        self._outage = Outage(ledger, self._apply, log, on_mode=on_mode, on_error=on_error)
        self._on_leader = on_leader
        self._guards = (
            Guard("shared-pool", log, on_loop_error),
            Guard("shared-pool-events", log, on_loop_error),
        )
        self._refused = replies.Refusals(log, on_error)
        self._leader_limit: int | None = None  # what we publish while we lead
        self._applied: tuple[int, int] | None = None  # (local limit, pool limit) as set
        # The calls in flight (an ACQUIRE's and a demand update's: the ledger's), the clocks.
        self._rewake = False  # a lease was freed while we were acquiring: ask again after
        self._renewing = False
        self._next_renew = 0.0
        self._pump_handle: asyncio.Handle | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # the calls in flight
        self._runner: asyncio.Task[None] | None = None
        self._listener: asyncio.Task[None] | None = None
        self._closed = False

    # --- life --------------------------------------------------------------------------------

    @property
    def interval_s(self) -> float:
        """Between renewals (and, at most, probes while degraded: ``decide.retry_after``)."""
        return self.ledger.policy.lease_s / 3

    def start(self) -> None:
        self._apply()
        ticker, listener = self._guards
        self._runner = ticker.start(self._tick, TICK_S)
        self._listener = listener.start(self._listen, self.interval_s)

    async def close(self, give_back: bool = True) -> None:
        """Stop; give every lease back but those of the requests still running, and leave the
        pool (when Redis answers). Without ``give_back`` the leases are left to expire, as
        when the process dies."""
        self._closed = True
        self._outage.close()
        if self._pump_handle is not None:
            self._pump_handle.cancel()
        for task in (self._runner, self._listener):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._tasks:
            _, late = await asyncio.wait(self._tasks, timeout=self.ledger.policy.timeout_s)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late)
        ids = self.ledger.take_all()
        if give_back:
            # Past a shutdown's grace, requests may still run (Envoy goes on relaying a
            # stream): their leases are left to expire, the others go back.
            running, _ = self._pool.shared_view()
            with contextlib.suppress(_Unreachable):
                await self._call(self._client.leave(ids[running:], limit=self.ledger.limit_arg))
        await self._client.aclose()

    def set_limits(self, limit: int, *, adaptive: bool, bounds: tuple[int, int]) -> None:
        """A reload's pool, ``pool.shared`` as it was: its limit (a static pool's, or the one
        to fall back to), whether it is adaptive, its bounds; a renewal says so now."""
        self.ledger.set_adaptive(adaptive, bounds)
        self.ledger.set_static_limit(limit)
        self._kick()

    def publish_limit(self, limit: int) -> None:
        """The leader's adaptive controller found a limit: published with the next renewal,
        which goes out now. Degraded, it is the limit the local share is of, and goes out
        with the next probe (every interval)."""
        self._leader_limit = limit
        ledger = self.ledger
        if ledger.mode is Mode.SHARED:
            self._kick()
        elif ledger.clamped(limit) != ledger.limit:
            ledger.computed_limit(limit)
            self._apply()

    # --- what the gate tells us (synchronous, no I/O) -----------------------------------------

    def on_change(self) -> None:
        """Waiters or slots of the local pool changed: look again soon (once per loop turn)."""
        if self._pump_handle is None and not self._closed:
            self._pump_handle = asyncio.get_running_loop().call_soon(self._pump)

    def on_release(self) -> None:
        """A local slot is about to be freed: keep its lease for a local waiter, or give it
        back now because someone elsewhere is more urgent (or the pool is above its limit)."""
        ledger = self.ledger
        if ledger.mode is not Mode.SHARED or not ledger.held:
            return  # nothing to decide: no view to take
        running, demand = self._pool.shared_view()
        known, held = ledger.known(), ledger.held
        give = decide.on_release(
            known,
            held=held,
            running=running,
            demand=demand,
            u_back=self._rand(),
            u_whom=self._rand(),
        )
        if give is not None:
            self._give_back(give.n, give.to)

    # --- views -------------------------------------------------------------------------------

    def pool_demand(self) -> tuple[int, int]:
        """(leases held in the pool, waiters of every replica) for the adaptive limit.
        Degraded, this replica's running requests and waiters stand for each live replica's
        (they run their shares too): the pool's count as last heard is out of date."""
        running, mine = self._pool.shared_view()
        ledger = self.ledger
        if ledger.mode is Mode.DEGRADED:
            n = max(1, len(ledger.replicas)) if ledger.connected else ledger.policy.replicas or 1
            return running * n, sum(mine.values()) * n
        return ledger.count, sum(mine.values()) + sum(ledger.known().theirs.values())

    def local_limit(self) -> int:
        """What the local pool may run now."""
        return decide.local_limit(self.ledger.known(), now=self._loop.time(), held=self.ledger.held)

    def debug(self) -> dict[str, Any]:
        running, demand = self._pool.shared_view()
        return self.ledger.debug_view(self._loop.time(), running, demand)

    def __repr__(self) -> str:
        m = self.ledger
        return f"<LeaseManager {m.replica} {m.mode} {m.held}/{m.limit}>"

    # --- internals: doing what the decisions say ---------------------------------------------

    def _apply(self) -> None:
        """Give the local pool its limit when it changed."""
        wanted = (self.local_limit(), self.ledger.limit)
        if wanted != self._applied:
            self._applied = wanted
            self._pool.set_leases(*wanted)

    def _kick(self) -> None:
        self._next_renew = 0.0

    def _pump(self, force: bool = False) -> None:
        """Take a step for the demand: acquire, give spares back, correct stale demand."""
        self._pump_handle = None
        ledger = self.ledger
        if self._closed or ledger.mode is not Mode.SHARED:
            return
        known = ledger.known()
        if force and known.acquiring:
            self._rewake = True
        running, demand = self._pool.shared_view()
        held, now = ledger.held, self._loop.time()
        match decide.step(known, now=now, held=held, running=running, demand=demand, force=force):
            case GiveBack(n=n, to=to):
                self._give_back(n, to)
            case Acquire(ask=ask):
                self._spawn(self._acquire(ask), "acquire")
            case PublishDemand():
                self._spawn(self._update_demand(), "demand")
            case None:
                pass

    def _give_back(self, n: int, to: str | None) -> None:
        """Give ``n`` leases back now, for replica ``to`` (None: for anyone)."""
        ids = self.ledger.pop_ids(n)
        if not ids:
            return
        self.ledger.gave_back(ids, to)
        self._apply()
        self._spawn(self._return(ids, to or ""), "return")

    def _spawn(self, coro: Coroutine[Any, Any, None], call: str) -> None:
        """Run one call in a task the manager keeps until it ends."""
        task = self._loop.create_task(coro, name=f"shared-pool-{call}")
        self._tasks.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("shared pool: %s failed", task.get_name(), exc_info=exc)

    # --- internals: calls --------------------------------------------------------------------

    async def _call(self, call: Awaitable[_T]) -> _T:
        """One call; a failure makes us degraded and raises ``_Unreachable``."""
        try:
            reply = await call
        except CallFailed as e:
            if self._outage.failed(e):
                self._kick()  # it failed alone: its ids, doubtful, go back with a renewal now
            raise _Unreachable from e
        self._outage.succeeded()
        return reply

    async def _acquire(self, ask: Mapping[int, int]) -> None:
        ledger = self.ledger
        ledger.set_acquiring(True, self._loop.time())
        ids = ledger.new_ids(sum(ask.values()))
        try:
            reply = await self._call(self._client.acquire(ask, ids, limit=ledger.limit_arg))
        except _Unreachable:
            ledger.doubt(ids, self._loop.time())
            return
        finally:
            ledger.set_acquiring(False)
        self._heard(reset=ledger.acquired(ids, ask, reply))
        self._refused("demand", reply.refused)
        self._apply()
        rewake, self._rewake = self._rewake, False
        self._pump(force=rewake)

    async def _return(self, ids: list[str], to: str) -> None:
        hold_ms = int(HANDOFF_S * 1000)
        ledger = self.ledger
        try:
            reply = await self._call(
                self._client.give_back(ids, to=to, hold_ms=hold_ms, limit=ledger.limit_arg)
            )
        except _Unreachable:
            ledger.doubt(ids, self._loop.time())
            return
        self._heard(reset=ledger.returned(reply))

    async def _update_demand(self) -> None:
        ledger = self.ledger
        ledger.set_updating(True)
        try:
            running, demand = self._pool.shared_view()
            unmet = decide.unmet(held=ledger.held, running=running, demand=demand)
            await self._call(self._client.write_demand(unmet, limit=ledger.limit_arg))
            ledger.wrote_demand(unmet)
        except _Unreachable:
            pass
        finally:
            ledger.set_updating(False)

    async def _renew(self) -> None:
        self._renewing = True
        ledger, sent = self.ledger, self._loop.time()
        running, demand = self._pool.shared_view()
        plan = decide.renewal(ledger.known(), held=ledger.held, running=running, demand=demand)
        back = ledger.pop_ids(plan.back)
        if back:
            self._apply()
        claim = ledger.new_ids(plan.claim)
        doubtful = ledger.doubtful(sent)
        call = self._client.renew(
            demand=plan.unmet,
            volunteer=ledger.adaptive,
            publish=self._leader_limit,
            term=ledger.term,
            renew=ledger.ids,
            back=[*back, *doubtful],
            claim=claim,
            known=ledger.named,
            fresh=ledger.fresh,
            limit=ledger.limit_arg,
        )
        try:
            reply = await self._call(call)
        except _Unreachable:
            ledger.doubt([*back, *claim], sent)
            self._next_renew = self._outage.renewal_failed(self.interval_s)
            return
        finally:
            self._renewing = False
        # The share from the replicas seen before: a restarted Redis knows only those that
        # rejoined already.
        share = decide.share(ledger.known())
        ledger.cleared(doubtful)
        after = ledger.renewed(sent, claim, plan.unmet, reply)
        self._heard(renewed=True)
        self._refused("demand", reply.refused)
        if ledger.mode is Mode.DEGRADED:
            self._outage.rejoin(running, after.uncovered, share)
        self._outage.renewed()
        self._apply()
        if after.leader_changed:  # a new term starts from the limit in force
            self._leader_limit = None
            if self._on_leader is not None:
                self._on_leader(ledger.is_leader)
        self._pump(force=after.raised)

    def _heard(self, *, reset: bool = False, renewed: bool = False) -> None:
        """A reply applied: log the ledger's notices; a new epoch: re-register at once."""
        for text in self.ledger.take_notices():
            log.warning("shared pool: %s", text)
        if reset:
            self._kick()
        if renewed and self.ledger.other_policies and self._on_error is not None:
            self._on_error("policy")

    # --- internals: the clock and the events -------------------------------------------------

    async def _tick(self) -> None:
        """One round of the ticker (every ``TICK_S``)."""
        now = self._loop.time()
        if not self._renewing and now >= self._next_renew:
            self._next_renew = now + self.interval_s
            self._spawn(self._renew(), "renew")
        known = self.ledger.known()
        if known.mode is Mode.DEGRADED:
            self._apply()  # (the expiry has its timer; a local share follows the limit)
        elif not known.acquiring and now - known.last_acquire >= POLL_S:
            self._pump()

    async def _listen(self) -> float | None:
        """One subscription, until a refresh drops it (again at once) or it fails (again an
        interval later: polling carries on, renewals tell whether Redis is back)."""
        try:
            await self._client.listen(self._on_message)
        except CallFailed as e:
            if self._on_error is not None:
                self._on_error(e.call)
            return None
        return 0.0

    def _on_message(self, data: str | bytes) -> None:
        event = replies.event(data)
        if isinstance(event, replies.Refused):
            self._refused("events", (event.why,))
            return
        me = self.ledger.replica
        if event is None or event.replica == me or self.ledger.mode is not Mode.SHARED:
            return
        if isinstance(event, replies.Freed):
            if decide.wakes(event.to, me):
                self._pump(force=True)
        else:
            self.ledger.heard_demand(event.replica, event.demand)
            self.on_change()
