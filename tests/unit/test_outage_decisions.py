"""The tables of ``decide`` rule 10 (a failed call: degraded or alone; when a failed renewal
goes again); rule 7's phases are in test_lease_decisions.py."""

from __future__ import annotations

import pytest

from extproc.pool.shared import decide
from extproc.pool.shared.decide import POLL_S


@pytest.mark.parametrize(
    ("timed_out", "in_a_row", "degraded"),
    [
        (True, 1, False),  # one slow call after a success: that call alone
        (True, 2, True),  # slow again: Redis is slow (or cut off without a reset)
        (False, 1, True),  # an error, a lost node, a refused reply: at once
        (False, 3, True),
    ],
)
def test_which_failures_degrade(timed_out: bool, in_a_row: int, degraded: bool) -> None:
    assert decide.degrades(timed_out=timed_out, in_a_row=in_a_row) is degraded


@pytest.mark.parametrize(
    ("failed", "after"),
    [(1, POLL_S), (2, 2 * POLL_S), (3, 4 * POLL_S), (4, 8 * POLL_S), (5, 3.0), (40, 3.0)],
)
def test_a_failed_renewal_goes_again_a_poll_later_then_backs_off(failed: int, after: float) -> None:
    assert decide.retry_after(failed, 3.0) == pytest.approx(after)
