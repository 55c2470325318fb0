"""What counts, pure: the measurement window a request is counted in, and the SLO it is held to.
:mod:`.measure` (per class) and :mod:`.tenants` (per tenant) count with these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from bench.load.summary import RequestRecord

__all__ = ["SLO_TTFT_S", "Window", "meets_slo"]

# SLO goodput: an interactive answer counts if its first token came within this of the
# original arrival (retries included), a batch answer if it completed within its timeout. It
# is also the TTFT the sidecar is held to and the one a strategy recovers to.
SLO_TTFT_S: Final = 2.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Window:
    """The measurement window, simulated seconds from the start of the arrivals. A request
    counts in it if its *final* outcome (last byte, last refusal, or giving up) falls inside."""

    start_s: float
    end_s: float

    @property
    def span_s(self) -> float:
        return self.end_s - self.start_s

    def holds(self, r: RequestRecord) -> bool:
        return self.start_s <= r.arrival_s + r.e2e_s < self.end_s


def meets_slo(r: RequestRecord) -> bool:
    """Good (a complete 200 within the client's timeout from the original arrival) and, for an
    interactive request, its first token within :data:`SLO_TTFT_S` of the original arrival."""
    if not r.good:
        return False
    if r.cls == "interactive":
        return r.ttft_s is not None and r.ttft_s <= SLO_TTFT_S
    return True
