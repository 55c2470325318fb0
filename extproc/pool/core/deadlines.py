"""The waiters' deadlines across every bucket: one heap, lazy deletion, compaction.

A ticket's deadline goes in when it queues and is never taken out early: a ticket admitted
or cancelled leaves a stale entry, skipped when it reaches the top (``due``, ``next``) and
dropped by ``compact`` once stale entries outnumber the live tickets, so memory stays
O(tickets) at O(1) amortised cost. ``waiting(ticket id)`` says whether a ticket still waits.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator

__all__ = ["Deadlines"]


class Deadlines:
    __slots__ = ("heap", "waiting")

    def __init__(self, waiting: Callable[[int], bool]) -> None:
        self.heap: list[tuple[float, int]] = []  # (deadline, ticket id)
        self.waiting = waiting

    def push(self, deadline: float, ticket_id: int) -> None:
        heapq.heappush(self.heap, (deadline, ticket_id))

    def due(self, now: float) -> Iterator[int]:
        """The waiting tickets whose deadline is at or before ``now``, earliest first, each
        taken off the heap as it is yielded."""
        heap, waiting = self.heap, self.waiting
        while heap and heap[0][0] <= now:
            _, tid = heapq.heappop(heap)
            if waiting(tid):
                yield tid

    def next(self) -> float | None:
        """The earliest deadline of a ticket still waiting."""
        heap, waiting = self.heap, self.waiting
        while heap:
            deadline, tid = heap[0]
            if waiting(tid):
                return deadline
            heapq.heappop(heap)
        return None

    def compact(self, live: int) -> None:
        """Drop the stale entries once they outnumber ``live`` tickets (and there are > 64)."""
        if len(self.heap) > 64 and len(self.heap) > 2 * live:
            self.heap = [(d, tid) for d, tid in self.heap if self.waiting(tid)]
            heapq.heapify(self.heap)
