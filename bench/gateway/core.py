"""The gateway's pool, pure: C workers, a short-request queue served first, a FIFO for the rest,
queue timeouts checked when a request is dequeued (see :mod:`bench.gateway`).

No clock and no event loop: the caller passes ``now`` and applies the :class:`Grants` each call
returns (wake these, answer 503 to those). Invariant after every call: a free worker implies
both queues are empty, so a newcomer never jumps the queue.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = ["Grants", "PoolStats", "PriorityPool", "Ticket"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Ticket:
    """One request waiting for a worker."""

    id: int
    short: bool  # prompt and max_tokens both under their thresholds: served first
    deadline_s: float  # its queue timeout, checked only when it is dequeued


@dataclass(frozen=True, slots=True, kw_only=True)
class Grants:
    """What the caller must do after one call."""

    run: tuple[int, ...] = ()  # these hold a worker now: forward them
    expired: tuple[int, ...] = ()  # dequeued past their deadline: 503 (late)
    rejected: tuple[int, ...] = ()  # the queue was full: 503 at once


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolStats:
    workers: int
    running: int
    queued_short: int
    queued_long: int


class PriorityPool:
    """``workers`` slots; two FIFO queues holding at most ``max_queue`` tickets together."""

    def __init__(self, workers: int, max_queue: int) -> None:
        if workers < 1 or max_queue < 0:
            raise ValueError("need workers >= 1 and max_queue >= 0")
        self.workers = workers
        self.max_queue = max_queue
        self.running = 0
        self._short: deque[Ticket] = deque()
        self._long: deque[Ticket] = deque()

    def enqueue(self, ticket: Ticket, now: float) -> Grants:
        """Queue ``ticket`` and hand free workers out (it runs at once if one is free)."""
        if len(self._short) + len(self._long) >= self.max_queue and self.running >= self.workers:
            return Grants(rejected=(ticket.id,))
        (self._short if ticket.short else self._long).append(ticket)
        return self._dispatch(now)

    def release(self, now: float) -> Grants:
        """A running request ended (whatever ended it): its worker takes the next one."""
        if self.running <= 0:
            raise RuntimeError("release without a running request")
        self.running -= 1
        return self._dispatch(now)

    def cancel(self, ticket_id: int) -> bool:
        """Drop a queued ticket whose client left; False if it is not queued (then it either
        holds a worker, which the caller releases, or was already answered)."""
        for q in (self._short, self._long):
            for t in q:
                if t.id == ticket_id:
                    q.remove(t)
                    return True
        return False

    def _dispatch(self, now: float) -> Grants:
        run: list[int] = []
        expired: list[int] = []
        while self.running < self.workers and (self._short or self._long):
            ticket = (self._short or self._long).popleft()
            if now > ticket.deadline_s:
                expired.append(ticket.id)  # the worker stays free for the next one
                continue
            self.running += 1
            run.append(ticket.id)
        return Grants(run=tuple(run), expired=tuple(expired))

    def statistics(self) -> PoolStats:
        return PoolStats(
            workers=self.workers,
            running=self.running,
            queued_short=len(self._short),
            queued_long=len(self._long),
        )

    def __repr__(self) -> str:
        return (
            f"pool {self.running}/{self.workers} +{len(self._short)} short "
            f"+{len(self._long)} long queued"
        )
