"""Degraded mode's shell: what one replica does when its Redis calls fail and when a renewal
succeeds again.

Which failure degrades and when a failed renewal goes again are ``decide`` rule 10; what a
degraded replica runs on is rule 7 (the leases it holds, then none) and rule 9 (the rejoin);
the mode and its clocks are the ledger's (``Ledger.degrade``, ``Ledger.rejoin``). An
``Outage`` keeps what those rules count (failed calls in a row, failed renewals in a row),
changes the mode when they say so and says it (logged once per change, every failure counted
by ``on_error``, each change of mode told to ``on_mode``), and owns the timer that gives the
local pool its limit again when the leases expire (rule 7), set at each renewal's answer.
The lease manager (``extproc.pool.shared.leases``) owns one and tells it of every call's end.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from extproc.pool.shared import decide
from extproc.pool.shared.client import CallFailed
from extproc.pool.shared.decide import Mode
from extproc.pool.shared.ledger import Ledger

__all__ = ["Outage"]


class Outage:
    def __init__(
        self,
        ledger: Ledger,
        apply: Callable[[], None],
        log: logging.Logger,
        *,
        on_mode: Callable[[Mode], None] | None = None,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        """``apply``: give the local pool its limit (the manager's). Made on the event loop
        it runs on."""
        self._ledger = ledger
        self._apply = apply
        self._log = log
        self._on_mode = on_mode
        self._on_error = on_error
        self._loop = asyncio.get_running_loop()
        self.failures = 0  # failed calls in a row
        self.failed_renewals = 0  # failed renewals in a row
        self._expiry: asyncio.TimerHandle | None = None
        self._closed = False

    def succeeded(self) -> None:
        """A call succeeded."""
        self.failures = 0

    def failed(self, failure: CallFailed) -> bool:
        """A call failed: counted, and degraded if rule 10 says so. True when it failed
        alone (the replica stays shared: the ids it carried should go back soon)."""
        ledger = self._ledger
        ledger.set_error(str(failure))
        self.failures += 1
        if self._on_error is not None:
            self._on_error(failure.call)
        if ledger.mode is Mode.DEGRADED or self._closed:
            return False
        if not decide.degrades(timed_out=failure.timed_out, in_a_row=self.failures):
            self._log.info("shared pool: %s; that call alone failed", ledger.last_error)
            return True
        ledger.degrade(now := self._loop.time())
        if self._on_mode is not None:
            self._on_mode(Mode.DEGRADED)
        self._log.warning(
            "shared pool degraded (%s): %s", ledger.last_error, ledger.outage_plan(now)
        )
        self._apply()
        return False

    def renewal_failed(self, interval_s: float) -> float:
        """A renewal failed: when the next one goes (rule 10), on the loop's clock."""
        self.failed_renewals += 1
        return self._loop.time() + decide.retry_after(self.failed_renewals, interval_s)

    def renewed(self) -> None:
        """A renewal's answer was applied: the leases' expiry timer set again (rule 7)."""
        self.failed_renewals = 0
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry = self._loop.call_at(self._ledger.known().valid_until, self._apply)

    def rejoin(self, running: int, uncovered: int, share: int) -> None:
        """The first successful renewal while degraded: shared again (rule 9)."""
        ledger = self._ledger
        took = ledger.rejoin(self._loop.time(), share)
        self._log.warning(
            "shared pool rejoined after %.1f s: %d lease(s) for %d running request(s)%s",
            took,
            ledger.held,
            running,
            f", {uncovered} not covered (no new admissions until they end)" if uncovered else "",
        )
        if self._on_mode is not None:
            self._on_mode(Mode.SHARED)

    def close(self) -> None:
        """The manager stops: no change of mode, no timer from here."""
        self._closed = True
        if self._expiry is not None:
            self._expiry.cancel()
