"""Outcomes, and the one table that says what each means.

Every admitted-path request ends in exactly one ``Outcome``, assigned by
``RequestRecord.decide`` and counted once when its stream ends (``extproc.service``). The table
``OUTCOMES`` gives, for each outcome, the HTTP status the sidecar answers with, the OpenAI-style
error type and code, the message template, the level of the request's log line and its metric
label; nothing else in the package maps an outcome to any of these.

Errors found in a request are ``RequestError``: each carries its ``Outcome`` (400/415 problems
are ``REJECTED_INVALID``, an oversize prompt ``REJECTED_TOO_LARGE``) and its own code and
message; its status comes from the table unless the error names another (415). Queue outcomes
(full, evicted, expired at the client's own deadline, a wait too long, shutting down, too many
large bodies, a tenant over its bounds) are answered by
``queue_rejection`` from the table's templates.
Bodies are ``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from enum import StrEnum

__all__ = [
    "OUTCOMES",
    "Outcome",
    "OutcomeInfo",
    "Rejection",
    "RequestError",
    "queue_rejection",
]


class Outcome(StrEnum):
    # Admitted, then its stream ended (response finished, or the client left mid-response).
    ADMITTED = "admitted"
    # Answered by the sidecar without reaching the backend.
    REJECTED_INVALID = "rejected_invalid"  # 400 / 415: the body or a field is wrong
    REJECTED_TOO_LARGE = "rejected_too_large"  # 413: prompt over max_prompt_tokens
    REJECTED_QUEUE_FULL = "rejected_queue_full"  # 429 at once
    EVICTED_TIMEOUT = "evicted_timeout"  # 429 when the queue deadline passed
    # 429 when the client's own deadline passed, sooner than the queue deadline
    EXPIRED_CLIENT_DEADLINE = "expired_client_deadline"
    REJECTED_WAIT_TOO_LONG = "rejected_wait_too_long"  # 429 at once: the wait would pass it
    REJECTED_SHUTTING_DOWN = "rejected_shutting_down"  # 503: the sidecar is stopping
    REJECTED_BUSY = "rejected_busy"  # 429: too many large bodies being parsed
    # 429 at once: the request's tenant has its bucket's per-tenant max_queue waiting, or its
    # max_share of the bucket waiting and running (extproc.pool.core.tenants)
    REJECTED_TENANT_QUEUE_FULL = "rejected_tenant_queue_full"
    REJECTED_TENANT_OVER_SHARE = "rejected_tenant_over_share"
    # The stream ended before an answer: the client left.
    CANCELLED_WHILE_QUEUED = "cancelled_while_queued"
    CANCELLED_BEFORE_BODY = "cancelled_before_body"


@dataclass(frozen=True, slots=True, kw_only=True)
class OutcomeInfo:
    """What an outcome means outside the sidecar."""

    # The sidecar's own answer; None when the backend answers or nobody is left to answer.
    status: int | None
    error_type: str | None
    # The error code; None where the request's error carries its own (``RequestError.code``).
    code: str | None
    # Message of a queue refusal, formatted with bucket, queued, waited, limit and retry.
    message: str | None
    # Level of the request's log line in ``extproc.requests``.
    log_level: int
    # The ``outcome`` label of llm_extproc_requests_total and llm_extproc_queue_wait_seconds.
    label: str


_INVALID = "invalid_request_error"
_RATE = "rate_limit_error"
_INFO, _DEBUG = logging.INFO, logging.DEBUG

# The one table. Refusals and evictions are logged at INFO, everything else at DEBUG.
OUTCOMES: dict[Outcome, OutcomeInfo] = {
    Outcome.ADMITTED: OutcomeInfo(
        status=None, error_type=None, code=None, message=None, log_level=_DEBUG, label="admitted"
    ),
    Outcome.REJECTED_INVALID: OutcomeInfo(
        status=400,
        error_type=_INVALID,
        code=None,
        message=None,
        log_level=_INFO,
        label="rejected_invalid",
    ),
    Outcome.REJECTED_TOO_LARGE: OutcomeInfo(
        status=413,
        error_type=_INVALID,
        code=None,
        message=None,
        log_level=_INFO,
        label="rejected_too_large",
    ),
    Outcome.REJECTED_QUEUE_FULL: OutcomeInfo(
        status=429,
        error_type=_RATE,
        code="queue_full",
        message="The {bucket} queue is full ({queued} waiting). Retry after {retry:.0f}s.",
        log_level=_INFO,
        label="rejected_queue_full",
    ),
    Outcome.EVICTED_TIMEOUT: OutcomeInfo(
        status=429,
        error_type=_RATE,
        code="queue_timeout",
        message="Waited {waited:.1f}s in the {bucket} queue without a free slot "
        "(limit {limit:g}s). Retry after {retry:.0f}s.",
        log_level=_INFO,
        label="evicted_timeout",
    ),
    Outcome.EXPIRED_CLIENT_DEADLINE: OutcomeInfo(
        status=429,
        error_type=_RATE,
        code="client_deadline",
        message="Waited {waited:.1f}s in the {bucket} queue, as long as the request's own "
        "deadline allowed (limit {limit:g}s). Retry after {retry:.0f}s.",
        log_level=_INFO,
        label="expired_client_deadline",
    ),
    Outcome.REJECTED_WAIT_TOO_LONG: OutcomeInfo(
        status=429,
        error_type=_RATE,
        code="queue_wait_too_long",
        message="The {bucket} queue would take about {waited:.1f}s to reach this request, "
        "longer than its deadline ({limit:g}s). Retry after {retry:.0f}s.",
        log_level=_INFO,
        label="rejected_wait_too_long",
    ),
    Outcome.REJECTED_SHUTTING_DOWN: OutcomeInfo(
        status=503,
        error_type="service_unavailable_error",
        code="shutting_down",
        message="The admission sidecar is shutting down. Retry after {retry:.0f}s.",
        log_level=_DEBUG,
        label="rejected_shutting_down",
    ),
    Outcome.REJECTED_BUSY: OutcomeInfo(
        status=429,
        error_type=_RATE,
        code="busy",
        message="The gateway is reading {queued} other large request bodies. "
        "Retry after {retry:.0f}s.",
        log_level=_INFO,
        label="rejected_busy",
    ),
    Outcome.REJECTED_TENANT_QUEUE_FULL: OutcomeInfo(
        status=429,
        error_type=_RATE,
        code="tenant_queue_full",
        message="Your requests fill your share of the {bucket} queue. Retry after {retry:.0f}s.",
        log_level=_INFO,
        label="rejected_tenant_queue_full",
    ),
    Outcome.REJECTED_TENANT_OVER_SHARE: OutcomeInfo(
        status=429,
        error_type=_RATE,
        code="tenant_over_share",
        message="Your requests hold your share of the {bucket} slots. Retry after {retry:.0f}s.",
        log_level=_INFO,
        label="rejected_tenant_over_share",
    ),
    Outcome.CANCELLED_WHILE_QUEUED: OutcomeInfo(
        status=None,
        error_type=None,
        code=None,
        message=None,
        log_level=_DEBUG,
        label="cancelled_while_queued",
    ),
    Outcome.CANCELLED_BEFORE_BODY: OutcomeInfo(
        status=None,
        error_type=None,
        code=None,
        message=None,
        log_level=_DEBUG,
        label="cancelled_before_body",
    ),
}


class RequestError(Exception):
    """A problem with the client's request: its outcome, code, message and the field at fault.

    The status is the outcome's (400 for ``REJECTED_INVALID``, 413 for ``REJECTED_TOO_LARGE``)
    unless ``status`` names another one of the same outcome (415 for a body that is not JSON).
    """

    def __init__(
        self,
        code: str,
        message: str,
        param: str | None = None,
        *,
        outcome: Outcome = Outcome.REJECTED_INVALID,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        info = OUTCOMES[outcome]
        if info.error_type != _INVALID:
            raise ValueError(f"{outcome} is not an outcome of a bad request")
        self.outcome = outcome
        self.status = status if status is not None else info.status
        self.code = code
        self.message = message
        self.param = param

    def rejection(self) -> Rejection:
        return Rejection(
            status=self.status or 400,
            code=self.code,
            body=_error_body(self.message, _INVALID, self.code, self.param),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Rejection:
    """An answer the sidecar gives in place of the backend."""

    status: int
    code: str
    body: bytes
    retry_after_s: float | None = None

    def headers(self) -> list[tuple[str, str]]:
        out = [("content-type", "application/json")]
        if self.retry_after_s is not None:
            out.append(("retry-after", str(max(1, math.ceil(self.retry_after_s)))))
            out.append(("retry-after-ms", str(max(1, round(self.retry_after_s * 1000)))))
        return out


def _error_body(message: str, type_: str, code: str, param: str | None = None) -> bytes:
    err = {"message": message, "type": type_, "param": param, "code": code}
    return json.dumps({"error": err}, separators=(",", ":")).encode()


def queue_rejection(
    outcome: Outcome,
    *,
    bucket: str,
    retry_after_s: float,
    queued: int = 0,
    waited_s: float = 0.0,
    limit_s: float = 0.0,
) -> Rejection:
    """The answer to a queue outcome (full, evicted, shutting down), from the table."""
    info = OUTCOMES[outcome]
    if info.status is None or info.code is None or info.message is None:
        raise ValueError(f"{outcome} is not answered by a queue refusal")
    message = info.message.format(
        bucket=bucket,
        queued=queued,
        waited=waited_s,
        limit=limit_s,
        retry=max(1, math.ceil(retry_after_s)),
    )
    return Rejection(
        status=info.status,
        code=info.code,
        body=_error_body(message, info.error_type or _RATE, info.code),
        retry_after_s=retry_after_s,
    )
