"""Outcomes and the one table that turns them into HTTP answers.

Every admitted-path request ends in exactly one ``Outcome``, recorded once by the server when its
stream ends (see ``extproc.server``). Errors found in a request carry the status they deserve
(``RequestError``); queue outcomes get their status here. Bodies are OpenAI-style:
``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Outcome", "Rejection", "RequestError", "queue_code", "queue_rejection"]


class Outcome(StrEnum):
    # Admitted, then its stream ended (response finished, or the client left mid-response).
    ADMITTED = "admitted"
    # Answered by the sidecar without reaching the backend.
    REJECTED_INVALID = "rejected_invalid"  # 400 / 415: the body or a field is wrong
    REJECTED_TOO_LARGE = "rejected_too_large"  # 413: prompt over max_prompt_tokens
    REJECTED_QUEUE_FULL = "rejected_queue_full"  # 429 at once
    EVICTED_TIMEOUT = "evicted_timeout"  # 429 when the queue deadline passed
    REJECTED_SHUTTING_DOWN = "rejected_shutting_down"  # 503: the sidecar is stopping
    # The stream ended before an answer: the client left.
    CANCELLED_WHILE_QUEUED = "cancelled_while_queued"
    CANCELLED_BEFORE_BODY = "cancelled_before_body"


class RequestError(Exception):
    """A problem with the client's request, with the status it deserves."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param

    @property
    def outcome(self) -> Outcome:
        return Outcome.REJECTED_TOO_LARGE if self.status == 413 else Outcome.REJECTED_INVALID

    def rejection(self) -> Rejection:
        return Rejection(
            status=self.status,
            code=self.code,
            body=_error_body(self.message, "invalid_request_error", self.code, self.param),
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


# The one table from a queue outcome to its answer: status, error type, code, message.
_QUEUE_ANSWERS = {
    Outcome.REJECTED_QUEUE_FULL: (
        429,
        "rate_limit_error",
        "queue_full",
        "The {bucket} queue is full ({queued} waiting). Retry after {retry:.0f}s.",
    ),
    Outcome.EVICTED_TIMEOUT: (
        429,
        "rate_limit_error",
        "queue_timeout",
        "Waited {waited:.1f}s in the {bucket} queue without a free slot (limit {limit:g}s). "
        "Retry after {retry:.0f}s.",
    ),
    Outcome.REJECTED_SHUTTING_DOWN: (
        503,
        "service_unavailable_error",
        "shutting_down",
        "The admission sidecar is shutting down. Retry after {retry:.0f}s.",
    ),
}


def queue_code(outcome: Outcome) -> str:
    return _QUEUE_ANSWERS[outcome][2]


def queue_rejection(
    outcome: Outcome,
    *,
    bucket: str,
    retry_after_s: float,
    queued: int = 0,
    waited_s: float = 0.0,
    limit_s: float = 0.0,
) -> Rejection:
    status, type_, code, template = _QUEUE_ANSWERS[outcome]
    message = template.format(
        bucket=bucket,
        queued=queued,
        waited=waited_s,
        limit=limit_s,
        retry=max(1, math.ceil(retry_after_s)),
    )
    return Rejection(
        status=status,
        code=code,
        body=_error_body(message, type_, code),
        retry_after_s=retry_after_s,
    )
