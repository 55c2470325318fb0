"""Fairness between the tenants of a bucket: the ``fair`` order (``FairOrder``).

It decides which waiter of a bucket goes next, by start-time fair queueing (Goyal, Vin and
Cheng, SIGCOMM 1996) on weighted tokens between the bucket's tenants, and which waiter a full
bucket refuses to keep room for a lighter tenant (``displace``). Which of one tenant's waiters
goes first is the order within's (``Within``: the ``cost`` order's key, ``CostKey``).

A tenant with waiters has a *turn*, tagged ``S = max(V, F)`` when it starts waiting; the head
is the first waiter, by the order within, of the tenant whose turn has the smallest tag (two
heaps, O(log n)). Serving it moves the tenant's finish tag to
``F = S + (prompt + 2 x max_tokens) / weight``, where its next turn starts; ``V`` is the start
tag of the latest admission. Only service moves a tag: a request that leaves unserved (refused
after it joined, evicted, cancelled: ``left``) charges its tenant nothing, so a flood refused
at the door does not push the flooding tenant's next requests back. A tenant's backlog spreads
its turns out, so another tenant's request, whose turn starts at ``V``, goes ahead of all but
one request of it: a light tenant never waits behind a heavy tenant's queue, and two busy
tenants share the slots in proportion to their weights, in tokens, not in requests. Within a
tenant, its cheap requests go ahead of its own expensive ones (the cost order's bound: never
put back by more than half the queue timeout behind later ones); which tenant is served next
does not depend on it. Work-conserving: a tenant alone is served as ``cost`` serves, at full
speed. No credit is banked: a tenant idle for a while starts again at ``V``, not before it
(that is the "decay", immediate). Output tokens weigh twice: they hold the slot for the
decode, one step each (llm-d weighs them 2x for the same reason).

A full fair bucket keeps room for lighter tenants (``displace``): a newcomer whose tenant, once
it joined, waits with fewer requests than the tenant with the most waiters takes the place of
that tenant's newest waiter, which is refused ``queue_full`` in its stead (the core's rule 7);
one as heavy as the heaviest is refused itself. Without it a heavy tenant's backlog filled the
queue and a light tenant's first request was refused although the order would have served it
next. O(1): the order keeps its tenants by number of waiters, and each tenant's waiters in the
order they joined.

What it reads: the bucket's waiters (the mapping ``head`` and ``compact`` are given); from the
bucket (``BucketState.fair``), its tenant policy (``tune``) and each admission and departure
unserved of its tickets (``admitted``, ``left``); of the order within, ``key`` alone.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Mapping
from typing import Final, Protocol

from extproc.config.policy import TenantPolicy
from extproc.pool.core.values import Ticket

__all__ = ["OUTPUT_WEIGHT", "FairOrder", "Within"]

# How much more an output token weighs than a prompt token.
OUTPUT_WEIGHT: Final = 2.0
_TENANT: Final = TenantPolicy()  # the defaults, until ``tune``


class Within(Protocol):
    """What it reads of the order within a tenant: a ticket's key, as it joins (smaller first)."""

    def key(self, ticket: Ticket, timeout_s: float) -> float: ...


class _Backlog:
    """One tenant's waiters: a heap on their keys within the tenant, the live ones in the order
    they joined (``ids``, the newest last) and their weighted tokens, and its turn (start tag,
    and the sequence number of its one live entry in the order's heap of turns)."""

    __slots__ = ("heap", "ids", "seq", "start", "tokens")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int]] = []
        self.ids: dict[int, None] = {}
        self.tokens = self.start = 0.0
        self.seq = 0


def weighted_tokens(ticket: Ticket) -> float:
    """What serving the ticket charges its tenant: (prompt + 2 x max_tokens) / weight."""
    cost = max(0, ticket.cost) + (OUTPUT_WEIGHT - 1.0) * max(0, ticket.output)
    return cost / ticket.weight


class FairOrder:
    """Start-time fair queueing between tenants, ``within`` within each (the module docstring):
    ``queues`` holds each tenant with waiters (``_Backlog``) and ``turns`` a heap of their
    start tags, one live entry a tenant (the others are stale: dropped at the top, or by
    ``compact``). ``tags`` holds each tenant's finish tag (its latest admission's) and when it
    was last seen, least recently seen first: at most ``max_tracked`` tenants, and none idle
    past ``idle_s`` (each push or admission forgets from the old end, O(1) amortised). A
    forgotten tenant starts again at ``V``. ``sizes`` holds the tenants with waiters by their
    number of waiters, ``most`` the largest (for ``displace``; each move is one up or one
    down, so O(1))."""

    __slots__ = ("idle_s", "max_tracked", "most", "queues", "seq", "sizes", "stale", "tags",
                 "turns", "virtual", "within")  # fmt: skip

    def __init__(self, within: Within) -> None:
        self.within = within
        self.virtual = 0.0
        self.tags: OrderedDict[str | None, tuple[float, float]] = OrderedDict()
        self.max_tracked, self.idle_s = _TENANT.max_tracked, _TENANT.idle_ttl_s
        self.queues: dict[str | None, _Backlog] = {}
        self.turns: list[tuple[float, int, str | None]] = []  # (start tag, seq, tenant)
        self.seq = 0
        self.stale = 0  # entries of tickets or turns gone, in the heaps
        self.sizes: dict[int, dict[str | None, None]] = {}
        self.most = 0

    def tune(self, tenant: TenantPolicy | None) -> None:
        """The bucket's tenant policy, at configuration (None: as it was)."""
        if tenant is not None:
            self.max_tracked, self.idle_s = tenant.max_tracked, tenant.idle_ttl_s

    def push(self, ticket: Ticket, timeout_s: float) -> None:
        """A ticket joins the queue: into its tenant's, keyed by the order within."""
        tenant = ticket.tenant
        last = self.tags.get(tenant)
        finish = self.virtual if last is None else last[0]
        q = self.queues.get(tenant)
        if q is None:  # it had nobody waiting: its turn starts at max(V, F)
            q = self.queues[tenant] = _Backlog()
            self._turn(tenant, q, max(self.virtual, finish))
        heapq.heappush(q.heap, (self.within.key(ticket, timeout_s), ticket.id))
        q.ids[ticket.id] = None
        self._resize(tenant, len(q.ids) - 1, len(q.ids))
        q.tokens += weighted_tokens(ticket)
        self._seen(tenant, finish, ticket.enqueued_at)

    def ahead(self, ticket: Ticket, waiting: Mapping[int, Ticket]) -> int | None:
        """None: all before it (its bucket's tenant counts bound it: ``TenantCounts.ahead``)."""
        return None

    def head(self, waiting: Mapping[int, Ticket]) -> tuple[float, Ticket] | None:
        """The first waiter of the tenant whose turn has the smallest tag, and that tag."""
        turns = self.turns
        while turns:
            start, seq, tenant = turns[0]
            q = self.queues.get(tenant)
            if q is None or q.seq != seq:
                heapq.heappop(turns)
                self.stale -= 1
                continue
            heap = q.heap
            while heap[0][1] not in waiting:  # q.ids: a live one is below
                heapq.heappop(heap)
                self.stale -= 1
            return start, waiting[heap[0][1]]
        return None

    def compact(self, waiting: Mapping[int, Ticket]) -> None:
        if self.stale <= 64 or self.stale <= len(waiting):
            return
        for q in self.queues.values():
            q.heap = [(k, tid) for k, tid in q.heap if tid in waiting]
            heapq.heapify(q.heap)
        self.turns = [(q.start, q.seq, t) for t, q in self.queues.items()]
        heapq.heapify(self.turns)
        self.stale = 0

    def band_key(self, key: float, ticket: Ticket) -> float:
        """Its head competes across buckets by its arrival (its keys are tokens)."""
        return ticket.enqueued_at

    def admitted(self, ticket: Ticket, key: float, now: float) -> None:
        """The head of the tenant whose turn it was: ``V`` moves to its start tag (``key``), the
        tenant's finish tag to ``start + tokens``, its next waiter's turn starts there."""
        self.virtual = max(self.virtual, key)
        tenant = ticket.tenant
        q = self.queues[tenant]
        tokens = weighted_tokens(ticket)
        # The head ``head`` returned, and its tenant's turn: at the top of their heaps.
        if q.heap[0][1] == ticket.id:
            heapq.heappop(q.heap)
        else:
            self.stale += 1
        if self.turns[0][1] == q.seq:
            heapq.heappop(self.turns)
        else:
            self.stale += 1
        finish = q.start + tokens
        del q.ids[ticket.id]
        self._resize(tenant, len(q.ids) + 1, len(q.ids))
        q.tokens -= tokens
        self._seen(tenant, finish, now)
        if q.ids:
            self._turn(tenant, q, finish)
        else:
            self._forget_queue(tenant, q)

    def left(self, ticket: Ticket) -> None:
        """No service, no charge: the tenant's tags stay where they were (a refused or evicted
        request does not push its tenant's later ones back)."""
        q = self.queues.get(ticket.tenant)
        if q is None or ticket.id not in q.ids:
            return
        del q.ids[ticket.id]
        self._resize(ticket.tenant, len(q.ids) + 1, len(q.ids))
        q.tokens -= weighted_tokens(ticket)
        self.stale += 1  # its entry in its tenant's heap
        if not q.ids:
            self.stale += 1  # its tenant's turn
            self._forget_queue(ticket.tenant, q)

    def displace(self, ticket: Ticket) -> int | None:
        """The id of the waiter a full bucket refuses in ``ticket``'s stead (None: ``ticket``):
        the newest of a tenant with the most, when ``ticket``'s (with it) has fewer; O(1)."""
        q = self.queues.get(ticket.tenant)
        if q is None or len(q.ids) >= self.most:
            return None
        heaviest = self.queues[next(iter(self.sizes[self.most]))]
        return next(reversed(heaviest.ids))

    def tenants(self) -> int:
        return len(self.tags)

    def heaviest(self, k: int) -> list[tuple[str | None, float]]:
        """The ``k`` tenants furthest ahead of ``V`` (their backlog, in weighted tokens: the
        finish tag they will have once their waiters are served): for /debug/queues,
        O(tenants)."""
        v = self.virtual
        ahead = {t: f - v for t, (f, _) in self.tags.items() if f > v}
        ahead.update((t, q.start + q.tokens - v) for t, q in self.queues.items())
        return heapq.nlargest(k, ahead.items(), key=lambda x: x[1])

    def _resize(self, tenant: str | None, before: int, after: int) -> None:
        """``tenant`` now has ``after`` waiters, one more or one fewer than ``before``."""
        sizes = self.sizes
        if before:
            group = sizes[before]
            del group[tenant]
            if not group:
                del sizes[before]
                if self.most == before:
                    self.most = after  # it was alone with the most: now one fewer
        if after:
            sizes.setdefault(after, {})[tenant] = None
            self.most = max(self.most, after)

    def _turn(self, tenant: str | None, q: _Backlog, start: float) -> None:
        self.seq += 1
        q.start, q.seq = start, self.seq
        heapq.heappush(self.turns, (start, self.seq, tenant))

    def _forget_queue(self, tenant: str | None, q: _Backlog) -> None:
        """A tenant with nobody waiting: its heap (every entry stale) goes."""
        del self.queues[tenant]
        self.stale -= len(q.heap)

    def _seen(self, tenant: str | None, finish: float, now: float) -> None:
        tags = self.tags
        tags.pop(tenant, None)
        tags[tenant] = (finish, now)
        while len(tags) > self.max_tracked or next(iter(tags.values()))[1] < now - self.idle_s:
            tags.popitem(last=False)
