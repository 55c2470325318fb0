"""Background loops that outlive a failed round, and a loop that ends anyway is noticed.

It imports nothing of extproc: the pool's loops and the app's run under it from above (the
bottom layer of tests/unit/test_imports.py), each counting its errors through ``on_error``.

The sidecar's long-running loops, by the name each is logged and counted under (``LOOPS``):
the lease manager's ticker ``shared-pool`` and its events listener ``shared-pool-events``
(``extproc.pool.shared.leases``), the adaptive limit's ``backend-poller``
(``extproc.pool.control.poller``), the ``overload`` tick (``extproc.pool.control.wiring``)
and the policy file's ``policy-watch`` (``extproc.app``). Each runs its rounds through one
``Guard``:

- A round that raises (anything but a cancellation) is logged with its traceback, counted
  (``on_error(name)``: ``llm_extproc_loop_errors_total{loop}``), and the loop goes on.
- The pause before the next round is the loop's own while its rounds succeed; after ``n``
  failed rounds in a row it is that pause doubled ``n - 1`` times, at most ``MAX_BACKOFF_S``
  (never less than the loop's own). A loop that fails every round logs one traceback per
  ``MAX_BACKOFF_S`` once there, and the first round that succeeds ends the backoff.
- The loops end only when cancelled (their owner's ``stop`` or ``close``). ``Guard.start``
  makes the task with a done-callback: a loop that ended otherwise (a ``BaseException`` that is
  not an ``Exception``, or a return) is logged at error and counted the same.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

__all__ = ["LOOPS", "MAX_BACKOFF_S", "Guard"]

LOOPS = ("shared-pool", "shared-pool-events", "backend-poller", "overload", "policy-watch")
MAX_BACKOFF_S = 5.0

# One round: returns the pause before the next one, or None for the loop's own.
Round = Callable[[], Awaitable[float | None]]


class Guard:
    """The guard of one loop named ``name`` (one of ``LOOPS``), logging to ``log``."""

    def __init__(
        self, name: str, log: logging.Logger, on_error: Callable[[str], None] | None = None
    ) -> None:
        self.name = name
        self._log = log
        self._on_error = on_error
        self.failures = 0  # failed rounds in a row
        self.errors = 0  # failed rounds and ends, in all

    def start(self, round_: Round, pause_s: float, *, first_s: float = 0.0) -> asyncio.Task[None]:
        """The loop as a task of the running loop, ``first_s`` before its first round; the
        caller owns it (cancels and awaits it)."""
        task = asyncio.get_running_loop().create_task(
            self.run(round_, pause_s, first_s=first_s), name=self.name
        )
        task.add_done_callback(self._ended)
        return task

    async def run(self, round_: Round, pause_s: float, *, first_s: float = 0.0) -> None:
        """``round_`` again and again, ``pause_s`` apart (or what it returns), until
        cancelled."""
        if first_s > 0:
            await asyncio.sleep(first_s)
        while True:
            try:
                wait = await round_()
            except Exception:
                wait = self.failed(pause_s)
            else:
                self.failures = 0
            await asyncio.sleep(pause_s if wait is None else wait)

    def failed(self, pause_s: float) -> float:
        """Log and count the round that raised (called in its ``except``); the backoff."""
        self.failures += 1
        doubled = pause_s * 2.0 ** min(self.failures - 1, 32)
        backoff = max(pause_s, min(MAX_BACKOFF_S, doubled))
        self._log.exception(
            "%s: a round failed (%d in a row); the loop goes on in %.2f s",
            self.name,
            self.failures,
            backoff,
        )
        self._count()
        return backoff

    def _count(self) -> None:
        self.errors += 1
        if self._on_error is not None:
            self._on_error(self.name)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        self._log.error("%s: the loop ended (%r); it no longer runs", self.name, exc, exc_info=exc)
        self._count()
