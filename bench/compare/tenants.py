"""Per-tenant figures, pure: what each tenant got over the measurement window, and how evenly
(Jain's index). The noisy-neighbour scenario (:mod:`.scenarios`) reads them; a run whose
requests carry no tenant has none.

A tenant's *attainment* is the share of its requests that met the SLO (:func:`.slo.meets_slo`:
a complete 200 within the client's timeout and, interactive, the first token within 2 s of the
original arrival, retries included), counted over every request of the tenant resolved in the
window, whatever its end (refused, timed out, late): what the tenant sent, not only what it was
answered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.common.stats import percentile
from bench.load.summary import RequestRecord

from .slo import Window, meets_slo

__all__ = ["TenantStats", "jain_index", "tenant_stats"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantStats:
    """One tenant over the window."""

    tenant: str
    resolved: int  # its requests whose final outcome fell in the window
    slo_met: int
    good: int  # complete 200s within the client's timeout
    good_tokens_per_s: float  # their output tokens per second of the window
    refused: int  # final 429 or 5xx, after the client's retries
    ttft_p99_s: float | None  # answered requests, from the original arrival

    @property
    def attainment(self) -> float | None:
        """SLO met over resolved; None without a request."""
        return self.slo_met / self.resolved if self.resolved else None


def tenant_stats(records: Sequence[RequestRecord], window: Window) -> dict[str, TenantStats]:
    """Each tenant's figures, by tenant name (records without a tenant are left out)."""
    by: dict[str, list[RequestRecord]] = {}
    for r in records:
        if r.tenant is not None and window.holds(r):
            by.setdefault(r.tenant, []).append(r)
    out = {}
    for tenant in sorted(by):
        rs = by[tenant]
        good = [r for r in rs if r.good]
        ttft = [r.ttft_s for r in rs if r.outcome == "ok" and r.ttft_s is not None]
        out[tenant] = TenantStats(
            tenant=tenant,
            resolved=len(rs),
            slo_met=sum(1 for r in rs if meets_slo(r)),
            good=len(good),
            good_tokens_per_s=sum(r.output_tokens for r in good) / window.span_s,
            refused=sum(
                1
                for r in rs
                if r.outcome == "http_error"
                and r.status is not None
                and (r.status == 429 or r.status >= 500)
            ),
            ttft_p99_s=percentile(ttft, 99),
        )
    return out


def jain_index(values: Sequence[float]) -> float | None:
    """Jain's fairness index, (sum x)^2 / (n sum x^2): 1 when all are equal, 1/n when one has
    everything (Jain, Chiu and Hawe, DEC-TR-301, 1984). None without values or when all are 0."""
    squares = sum(x * x for x in values)
    if not values or squares == 0:
        return None
    return sum(values) ** 2 / (len(values) * squares)
