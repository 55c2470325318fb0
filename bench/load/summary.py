"""What a run produced, pure: per-request records."""

from __future__ import annotations

from dataclasses import dataclass, field

from .client import Outcome


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestRecord:
    """What happened to one planned request (times in simulated seconds from its arrival)."""

    index: int
    cls: str
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    outcome: Outcome
    status: int | None  # final HTTP status; None for timeout / connection error / cancelled
    ttft_s: float | None  # streamed requests: first content chunk of the final attempt
    e2e_s: float  # arrival to the end of the final attempt (retries and backoffs included)
    output_tokens: int  # tokens received by the final attempt
    attempts: int
    gave_up: bool  # the client timed out and disconnected on its final attempt
    good: bool  # complete 200 within the class timeout
    tenant: str | None = None  # the x-tenant-id it was sent with; None: none


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadResult:
    """Everything a run produced: its records, and how late the sender was at worst."""

    loadgen_lag_s_max: float
    records: tuple[RequestRecord, ...] = field(repr=False)
