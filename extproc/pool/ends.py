"""How admitted requests ended lately: how many, and what share of their slot time went to
answers whose client had gone.

The sidecar cannot see how a response ended: with the request body BUFFERED and the response
path skipped, Envoy 1.40 resets the ext_proc stream at the end of every HTTP stream, whether
the last byte reached the client, the client left in the middle, or the upstream reset
(pinned in ``tests/e2e/test_envoy_facts.py``). What it does know is the request's deadline
(``extproc.request.deadline``: the client's stated timeout, or the route's): a stream that
ends at or after it (less the margin, the tolerance) was answered for nobody (the client gave
up, or Envoy cut the answer at the route's timeout), and the backend's work on it was wasted.
The servicer records each admitted request's end here (``Gate.ends``), with how long it held
its slot; the adaptive limit's ``slo.abandoned`` compares the abandoned share of the slot time
of the requests that ended in its window with its objective (``extproc.pool.control.adaptive``).
Weighed by time, not counted: an answer abandoned after 30 s of decoding wasted ten times the
work of a 3 s one, and the backend's wasted work, not the number of unhappy clients, is what
the objective bounds (the benchmark's "wasted work" is the share of generated tokens).

Left out, ended or abandoned alike: the requests whose deadline was their client's own and
sooner than their bucket's queue timeout (``Ticket.client_deadline``: say an
``x-stainless-timeout`` shorter than the policy lets anyone wait). Such a client chose to
leave early; its answer ending past that deadline is its own choice, not the backend's
slowness, and counting it let a few impatient clients cut the limit for everyone (32 -> 4 in
80 s). The servicer still counts them as abandoned (``llm_extproc_abandoned_total``).

Counted in bins of ``BIN_S`` (one second), kept for ``KEEP_S`` or the longest window asked,
whichever is longer: memory is a few hundred small lists whatever the request rate. A window
is counted in whole bins, so it covers up to one bin more than asked. Pure: ``now`` comes
from the caller.
"""

from __future__ import annotations

from collections import deque
from typing import Final

__all__ = ["Ends"]

BIN_S: Final = 1.0
KEEP_S: Final = 60.0


class Ends:
    def __init__(self) -> None:
        # [bin index, ended, slot seconds, abandoned slot seconds], oldest first
        self._bins: deque[list[float]] = deque()
        self._keep_s = KEEP_S

    def record(
        self, now: float, held_s: float, abandoned: bool, *, client_deadline: bool = False
    ) -> None:
        """One admitted request's stream ended at ``now`` after holding its slot ``held_s``;
        ``abandoned``: after its deadline; ``client_deadline``: that deadline was its client's
        own, sooner than its queue timeout (left out, module docstring)."""
        if client_deadline:
            return
        index = int(now // BIN_S)
        if not self._bins or self._bins[-1][0] != index:
            self._bins.append([index, 0, 0.0, 0.0])
            self._prune(now)
        last = self._bins[-1]
        last[1] += 1
        last[2] += held_s
        if abandoned:
            last[3] += held_s

    def count(self, now: float, window_s: float) -> tuple[int, float]:
        """(ended, the abandoned share of their slot time) over the last ``window_s``; the
        share is 0.0 when nothing held a slot for any time."""
        self._keep_s = max(self._keep_s, window_s)
        self._prune(now)
        first = int((now - window_s) // BIN_S)
        ended, held, gone = 0, 0.0, 0.0
        for index, n, h, g in self._bins:
            if index >= first:
                ended += int(n)
                held += h
                gone += g
        return ended, (gone / held if held > 0 else 0.0)

    def _prune(self, now: float) -> None:
        oldest = int((now - self._keep_s) // BIN_S)
        while self._bins and self._bins[0][0] < oldest:
            self._bins.popleft()

    def __repr__(self) -> str:
        return f"<Ends {len(self._bins)} bins>"
