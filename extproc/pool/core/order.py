"""The pool's named decisions: the order within a bucket, and the choice across buckets.

Who gets a freed slot is decided in two steps, each a small class:

1. **Within a bucket** (``QueueOrder``): the order keeps the bucket's queue (``push`` a ticket
   that joins, ``head`` the next one). ``fifo`` and ``cost`` key each ticket once, when it
   joins (``key``), and the queue is a heap on it, so the head is the smallest key, in
   O(log n). The policy's ``order`` picks the class through one table, ``QUEUE_ORDERS``:

   - ``fifo`` (``FifoOrder``): the enqueue time.
   - ``cost`` (``CostOrder``): the enqueue time plus ``(timeout / 2) x c / (c + c0)``, where
     ``c`` is the request's cost (estimated prompt + max_tokens) and ``c0`` the bucket's
     running mean cost. A cheap request goes ahead of an expensive one that came a little
     earlier (shortest-job-first lowers the mean wait), but a large request is never put back
     by more than half its queue timeout: anything that arrived more than that after it goes
     behind it.

   - ``fair`` (``FairOrder``): fair between the bucket's tenants, start-time fair queueing
     (Goyal, Vin and Cheng, SIGCOMM 1996) on weighted tokens, and the ``cost`` order within
     each tenant. A tenant with waiters has a *turn*, tagged ``S = max(V, F)`` when it starts
     waiting; the head is the cost order's first waiter of the tenant whose turn has the
     smallest tag (two heaps, O(log n)). Serving it moves the tenant's finish tag to
     ``F = S + (prompt + 2 x max_tokens) / weight``, where its next turn starts; ``V`` is the
     start tag of the latest admission. Only service moves a tag: a request that leaves
     unserved (refused after it joined, evicted, cancelled: ``left``) charges its tenant
     nothing, so a flood refused at the door does not push the flooding tenant's next requests
     back. A tenant's backlog spreads its turns out, so another tenant's request, whose turn
     starts at ``V``, goes ahead of all but one request of it: a light tenant never waits
     behind a heavy tenant's queue, and two busy tenants share the slots in proportion to
     their weights, in tokens, not in requests. Within a tenant, its cheap requests go ahead of
     its own expensive ones (the cost order's bound: never put back by more than half the
     queue timeout behind later ones); which tenant is served next does not depend on it.
     Work-conserving: a tenant alone is served as ``cost`` serves, at full speed. No credit
     is banked: a tenant idle for a while starts again at ``V``, not before it (that is the
     "decay", immediate). Output tokens weigh twice: they hold the slot for the decode, one
     step each (llm-d weighs them 2x for the same reason).

     A full fair bucket keeps room for lighter tenants (``displace``): a newcomer whose
     tenant, once it joined, waits with fewer requests than the tenant with the most waiters
     takes the place of that tenant's newest waiter, which is refused ``queue_full`` in its
     stead (the core's rule 7); one as heavy as the heaviest is refused itself. Without it a
     heavy tenant's backlog filled the queue and a light tenant's first request was refused
     although the order would have served it next. O(1): the order keeps its tenants by
     number of waiters, and each tenant's waiters in the order they joined.

   What a newcomer waits for (``ahead``, for ``fail_fast``'s predicted wait): in ``fifo``
   every waiter that came before it; in ``cost`` only those whose key is smaller, counted
   over the heap while it holds at most ``AHEAD_SCAN`` entries (past that, every waiter, as
   ``fifo``: the count stays bounded in time). Counting every waiter of a cost-ordered queue
   refused the cheap requests the order would have served first, and kept the queue, which is
   what the order chooses from, short (docs/benchmarks.md, "`fail_fast` and the cost order").

   An order may keep state of its own (``CostOrder``'s running mean, ``FairOrder``'s tags and
   turns). One that sets ``observes`` also hears each admission (with its key), release and
   departure unserved of its bucket's tickets (``admitted``, ``released``, ``left``); the
   core calls nothing for the others. An order whose keys are not times says which time
   competes across buckets (``band_key``: ``FairOrder``'s is the ticket's arrival).

2. **Across buckets** (``BucketChoice.rank``): among the buckets of a pool whose head may take
   the slot (it has waiters and is below its cap), the one with the smallest rank wins.
   ``GuaranteeBandHead`` (the pool's rule): a bucket below its guaranteed share first, then the
   most urgent band, then the earliest head by the buckets' queue keys. ``pick`` (which the
   core's ``_fill`` calls) finds that bucket; it calls ``rank``, which must be pure, only when
   two buckets or more compete.

A new order (EDF, say) is a new class here and its test; the core's ``_fill`` does not
change. The choice reads a bucket through ``Contender``, what it needs of one
(``extproc.pool.core.state.BucketState`` is one): the state imports the orders, not back.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Mapping, Sequence, Sized
from typing import ClassVar, Final, Protocol, TypeVar

from extproc.config.policy import Order, TenantPolicy
from extproc.pool.core.values import Ticket

__all__ = [
    "COST_EWMA_ALPHA",
    "OUTPUT_WEIGHT",
    "QUEUE_ORDERS",
    "BucketChoice",
    "Contender",
    "CostOrder",
    "FairOrder",
    "FifoOrder",
    "GuaranteeBandHead",
    "QueueOrder",
]

# Weight of the newest cost in a bucket's running mean cost (the ``cost`` order's c0).
COST_EWMA_ALPHA: Final = 0.05
# A cost order counts who goes before a newcomer over at most this many heap entries.
AHEAD_SCAN: Final = 256
# How much more an output token weighs than a prompt token in the fair order.
OUTPUT_WEIGHT: Final = 2.0


class QueueOrder:
    """The order within one bucket's queue: smaller keys go first.

    The queue itself is the order's: ``push`` a ticket that joins, ``head`` the next one of
    the bucket's ``waiting`` tickets. Here a heap on ``key`` with lazy deletion (a ticket that
    left is dropped when it reaches the top; ``compact`` rebuilds once they outnumber the
    live ones)."""

    __slots__ = ("heap",)
    # True: the core calls ``admitted``, ``released`` and ``left`` for each of the bucket's
    # tickets.
    observes: ClassVar[bool] = False
    # True: the order serves tenants in turn (a prediction counts only who it puts ahead).
    by_tenant: ClassVar[bool] = False

    def __init__(self) -> None:
        self.heap: list[tuple[float, int]] = []  # (key, ticket id)

    def key(self, ticket: Ticket, timeout_s: float) -> float:
        """The key of a ticket joining the queue (``timeout_s``: its queue timeout)."""
        raise NotImplementedError

    def push(self, ticket: Ticket, timeout_s: float) -> None:
        """A ticket joins the queue."""
        heapq.heappush(self.heap, (self.key(ticket, timeout_s), ticket.id))

    def ahead(self, ticket: Ticket, waiting: Mapping[int, Ticket]) -> int | None:
        """How many of the ``waiting`` tickets (``ticket`` the last to join, among them) go
        before it; None: all that came before it, as in ``fifo``."""
        return None

    def head(self, waiting: Mapping[int, Ticket]) -> tuple[float, Ticket] | None:
        """The next of the ``waiting`` tickets and its key (None: nobody waits)."""
        heap = self.heap
        while heap:
            key, tid = heap[0]
            ticket = waiting.get(tid)
            if ticket is not None:
                return key, ticket
            heapq.heappop(heap)
        return None

    def compact(self, waiting: Mapping[int, Ticket]) -> None:
        """Drop the entries of tickets gone once they outnumber the live ones."""
        if len(self.heap) > 64 and len(self.heap) > 2 * len(waiting):
            self.heap = [(k, tid) for k, tid in self.heap if tid in waiting]
            heapq.heapify(self.heap)

    def band_key(self, key: float, ticket: Ticket) -> float:
        """The time the bucket's head competes with across buckets (``BucketChoice``): its
        key, for orders whose keys are times."""
        return key

    def tune(self, tenant: TenantPolicy | None) -> None:
        """The bucket's tenant policy, at configuration (orders that keep tenants read it)."""

    def tenants(self) -> int:
        """Tenants the order remembers (0: it keeps none)."""
        return 0

    def heaviest(self, k: int) -> list[tuple[str | None, float]]:
        """The ``k`` tenants with the most queued ahead of the others, and how much."""
        return []

    def admitted(self, ticket: Ticket, key: float, now: float) -> None:
        """One of the bucket's tickets, the head with ``key``, took a slot (only when
        ``observes``)."""

    def released(self, ticket: Ticket, now: float) -> None:
        """One of the bucket's tickets gave its slot back (only when ``observes``)."""

    def left(self, ticket: Ticket) -> None:
        """One of the bucket's waiters left without a slot: refused after it joined, evicted,
        cancelled (only when ``observes``)."""

    def displace(self, ticket: Ticket) -> int | None:
        """The bucket's queue is full and ``ticket`` just joined it: the id of the waiter to
        refuse in its stead, or None (the newcomer is refused: here, always)."""
        return None


class FifoOrder(QueueOrder):
    """First come, first served."""

    __slots__ = ()

    def key(self, ticket: Ticket, timeout_s: float) -> float:
        return ticket.enqueued_at


class CostOrder(QueueOrder):
    """Cheaper first, delayed by at most half the queue timeout (see the module docstring)."""

    __slots__ = ("mean_cost",)

    def __init__(self) -> None:
        super().__init__()
        self.mean_cost: float | None = None

    def ahead(self, ticket: Ticket, waiting: Mapping[int, Ticket]) -> int | None:
        heap = self.heap
        if len(heap) > AHEAD_SCAN:
            return None
        # Its own entry (a ticket is in a heap once): the heap's order is the key, then the
        # older ticket.
        mine = next((entry for entry in heap if entry[1] == ticket.id), None)
        if mine is None:
            return None
        return sum(1 for entry in heap if entry < mine and entry[1] in waiting)

    def key(self, ticket: Ticket, timeout_s: float) -> float:
        c = float(max(0, ticket.cost))
        c0 = self.mean_cost if self.mean_cost is not None else c
        self.mean_cost = c0 + COST_EWMA_ALPHA * (c - c0)
        delay = 0.5 * timeout_s * (c / (c + c0) if c + c0 > 0 else 0.0)
        return ticket.enqueued_at + delay


class _Backlog:
    """One tenant's waiters in the fair order: a heap on the cost order's keys, the live ones
    in the order they joined (``ids``, the newest last) and their weighted tokens, and its
    turn (start tag, and the sequence number of its one live entry in the order's heap of
    turns)."""

    __slots__ = ("heap", "ids", "seq", "start", "tokens")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int]] = []
        self.ids: dict[int, None] = {}
        self.tokens = 0.0
        self.start = 0.0
        self.seq = 0

    @property
    def n(self) -> int:
        """How many of its waiters are live."""
        return len(self.ids)


def weighted_tokens(ticket: Ticket) -> float:
    """What serving the ticket charges its tenant: (prompt + 2 x max_tokens) / weight."""
    cost = max(0, ticket.cost) + (OUTPUT_WEIGHT - 1.0) * max(0, ticket.output)
    return cost / ticket.weight


class FairOrder(QueueOrder):
    """Start-time fair queueing between tenants, the cost order within each (see the module
    docstring).

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
    observes: ClassVar[bool] = True
    by_tenant: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        self.virtual = 0.0
        self.tags: OrderedDict[str | None, tuple[float, float]] = OrderedDict()
        self.max_tracked, self.idle_s = _TENANT.max_tracked, _TENANT.idle_ttl_s
        self.queues: dict[str | None, _Backlog] = {}
        self.turns: list[tuple[float, int, str | None]] = []  # (start tag, seq, tenant)
        self.seq = 0
        self.stale = 0  # entries of tickets or turns gone, in the heaps
        self.within = CostOrder()  # the keys within a tenant (its running mean cost)
        self.sizes: dict[int, dict[str | None, None]] = {}
        self.most = 0

    def tune(self, tenant: TenantPolicy | None) -> None:
        if tenant is not None:
            self.max_tracked, self.idle_s = tenant.max_tracked, tenant.idle_ttl_s

    def key(self, ticket: Ticket, timeout_s: float) -> float:
        """Its key within its tenant's queue: the cost order's."""
        return self.within.key(ticket, timeout_s)

    def push(self, ticket: Ticket, timeout_s: float) -> None:
        tenant = ticket.tenant
        last = self.tags.get(tenant)
        finish = self.virtual if last is None else last[0]
        q = self.queues.get(tenant)
        if q is None:  # it had nobody waiting: its turn starts at max(V, F)
            q = self.queues[tenant] = _Backlog()
            self._turn(tenant, q, max(self.virtual, finish))
        heapq.heappush(q.heap, (self.key(ticket, timeout_s), ticket.id))
        q.ids[ticket.id] = None
        self._resize(tenant, len(q.ids) - 1, len(q.ids))
        q.tokens += weighted_tokens(ticket)
        self._seen(tenant, finish, ticket.enqueued_at)

    def head(self, waiting: Mapping[int, Ticket]) -> tuple[float, Ticket] | None:
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
        return ticket.enqueued_at

    def admitted(self, ticket: Ticket, key: float, now: float) -> None:
        """The head of the tenant whose turn it was: ``V`` moves to its start tag, the
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
        """No service, no charge: the tenant's tags stay where they were (a refused or
        evicted request does not push its tenant's later ones back)."""
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
        """The newest waiter of a tenant with the most waiters, when ``ticket``'s tenant
        (with it) has fewer (the module docstring); O(1)."""
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


_TENANT: Final = TenantPolicy()  # the defaults, until ``tune``

# The policy's ``order`` -> the class of each bucket's queue order.
QUEUE_ORDERS: Final[dict[Order, type[QueueOrder]]] = {
    Order.FIFO: FifoOrder,
    Order.COST: CostOrder,
    Order.FAIR: FairOrder,
}


class Contender(Protocol):
    """What the choice across buckets reads of a bucket."""

    @property
    def priority(self) -> int: ...
    @property
    def shared(self) -> bool: ...  # in a pool with other buckets (else its own slots)
    @property
    def running(self) -> Sized: ...  # its tickets holding a slot
    @property
    def order(self) -> QueueOrder: ...
    def head(self) -> tuple[float, Ticket] | None: ...
    def min_slots(self, limit: int) -> int: ...
    def max_slots(self, limit: int, cut_band: int | None) -> int: ...


_B = TypeVar("_B", bound=Contender)


class BucketChoice:
    """Which of the competing buckets a free slot goes to: the smallest rank."""

    __slots__ = ()

    def rank(self, bucket: Contender, head_key: float, limit: int) -> tuple[float, ...]:
        """The bucket's rank, given its head's queue key and the pool's limit."""
        raise NotImplementedError

    def pick(
        self, buckets: Sequence[_B], limit: int, band: int | None
    ) -> tuple[_B, float, Ticket] | None:
        """The bucket whose head takes the next free slot of a pool of ``limit`` (``band``: the
        band the pool's cut applies to, ``demand.cut_band``), the head's key and the head; None
        when no bucket with waiters is below its cap."""
        rank = self.rank
        best: _B | None = None
        best_key = 0.0
        ticket: Ticket | None = None
        best_rank: tuple[float, ...] | None = None
        for b in buckets:
            head = b.head()
            if head is None:
                continue
            if b.shared and len(b.running) >= b.max_slots(limit, band):
                continue
            if best is None:
                best, (best_key, ticket) = b, head  # alone so far: no rank needed
                continue
            if best_rank is None:
                assert ticket is not None
                best_rank = rank(best, best.order.band_key(best_key, ticket), limit)
            r = rank(b, b.order.band_key(*head), limit)
            if r < best_rank:
                best, best_rank = b, r
                best_key, ticket = head
        if best is None or ticket is None:
            return None
        return best, best_key, ticket


class GuaranteeBandHead(BucketChoice):
    """1. a bucket below its guaranteed share (``floor(min_share x limit)``): nothing starves;
    2. the most urgent band (lowest ``priority``); 3. the earliest head of queue across the
    band's buckets (by their queue keys)."""

    __slots__ = ()

    def rank(self, bucket: Contender, head_key: float, limit: int) -> tuple[float, ...]:
        below_min = 0 if len(bucket.running) < bucket.min_slots(limit) else 1
        return (below_min, bucket.priority, head_key)
