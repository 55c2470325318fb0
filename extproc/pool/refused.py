"""What the gate answers instead of a slot: ``Refused``, with the Retry-After it carries.

A refusal at once (the queue full, a wait that cannot fit, a tenant over its bounds) or at the
deadline (evicted, or expired at the client's own deadline) is one ``Refused`` exception with
its ``Outcome``; ``extproc.outcome`` says what each answers (429 or 503, the code, the text).
"""

from __future__ import annotations

from extproc.outcome import OUTCOMES, Outcome
from extproc.pool.core.values import Verdict

__all__ = ["EXPIRED", "REFUSED", "Refused", "retry_after_s"]

REFUSED = {
    Verdict.QUEUE_FULL: Outcome.REJECTED_QUEUE_FULL,
    Verdict.WAIT_TOO_LONG: Outcome.REJECTED_WAIT_TOO_LONG,
    Verdict.TENANT_QUEUE_FULL: Outcome.REJECTED_TENANT_QUEUE_FULL,
    Verdict.TENANT_OVER_SHARE: Outcome.REJECTED_TENANT_OVER_SHARE,
}
EXPIRED = {False: Outcome.EVICTED_TIMEOUT, True: Outcome.EXPIRED_CLIENT_DEADLINE}


def retry_after_s(estimate_s: float, min_s: float, max_s: float, jitter: float, u: float) -> float:
    """Retry-After in seconds: the drain estimate times a random factor in [1, 1 + jitter]
    (``u`` uniform in [0, 1)), clamped to [min_s, max_s]."""
    return min(max_s, max(min_s, estimate_s * (1.0 + jitter * u)))


class Refused(Exception):
    """Refused at once (queue full, a wait too long, a tenant over its bounds) or at the
    deadline (evicted, expired); carries what the 429 or 503 needs."""

    def __init__(
        self,
        outcome: Outcome,
        bucket: str,
        retry_after_s: float,
        queued: int,
        waited_s: float,
        relegated_from: str | None = None,
    ) -> None:
        """``relegated_from``: evicted (or expired) after a relegation from that bucket."""
        super().__init__(f"{outcome} in {bucket}")
        self.relegated_from = relegated_from
        self.outcome = outcome
        self.code = OUTCOMES[outcome].code
        self.bucket = bucket
        self.retry_after_s = retry_after_s
        self.queued = queued
        self.waited_s = waited_s
