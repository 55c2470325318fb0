"""The one outcome table: complete, consistent, and what requests and refusals read from it."""

from __future__ import annotations

import json
import logging

import pytest

from extproc.outcome import OUTCOMES, Outcome, RequestError, queue_rejection


def test_every_outcome_has_one_row_whose_label_is_its_value() -> None:
    assert set(OUTCOMES) == set(Outcome)
    for outcome, info in OUTCOMES.items():
        assert info.label == outcome.value
    assert len({info.label for info in OUTCOMES.values()}) == len(Outcome)


def test_refusals_and_evictions_log_at_info_the_rest_at_debug() -> None:
    info_level = {o for o, i in OUTCOMES.items() if i.log_level == logging.INFO}
    assert info_level == {
        Outcome.REJECTED_INVALID,
        Outcome.REJECTED_TOO_LARGE,
        Outcome.REJECTED_QUEUE_FULL,
        Outcome.EVICTED_TIMEOUT,
        Outcome.EXPIRED_CLIENT_DEADLINE,
        Outcome.REJECTED_BUSY,
        Outcome.REJECTED_WAIT_TOO_LONG,
        Outcome.REJECTED_TENANT_QUEUE_FULL,
        Outcome.REJECTED_TENANT_OVER_SHARE,
    }


@pytest.mark.parametrize(
    ("error", "status", "outcome"),
    [
        (RequestError("invalid_json", "bad"), 400, Outcome.REJECTED_INVALID),
        (RequestError("unsupported_media_type", "x", status=415), 415, Outcome.REJECTED_INVALID),
        (
            RequestError("prompt_too_long", "x", "messages", outcome=Outcome.REJECTED_TOO_LARGE),
            413,
            Outcome.REJECTED_TOO_LARGE,
        ),
    ],
)
def test_a_request_error_carries_its_outcome_and_status(
    error: RequestError, status: int, outcome: Outcome
) -> None:
    assert (error.status, error.outcome) == (status, outcome)
    rejection = error.rejection()
    assert rejection.status == status and rejection.code == error.code
    body = json.loads(rejection.body)["error"]
    assert body["type"] == "invalid_request_error" and body["code"] == error.code


def test_a_request_error_cannot_claim_a_queue_outcome() -> None:
    with pytest.raises(ValueError, match="not an outcome of a bad request"):
        RequestError("queue_full", "x", outcome=Outcome.REJECTED_QUEUE_FULL)


@pytest.mark.parametrize(
    ("outcome", "status", "code"),
    [
        (Outcome.REJECTED_QUEUE_FULL, 429, "queue_full"),
        (Outcome.EVICTED_TIMEOUT, 429, "queue_timeout"),
        (Outcome.EXPIRED_CLIENT_DEADLINE, 429, "client_deadline"),
        (Outcome.REJECTED_SHUTTING_DOWN, 503, "shutting_down"),
        (Outcome.REJECTED_BUSY, 429, "busy"),
    ],
)
def test_queue_refusals_come_from_the_table(outcome: Outcome, status: int, code: str) -> None:
    r = queue_rejection(outcome, bucket="b", retry_after_s=2.2, queued=3, waited_s=1.0, limit_s=1)
    assert (r.status, r.code) == (status, code)
    assert ("retry-after", "3") in r.headers() and ("retry-after-ms", "2200") in r.headers()
    assert json.loads(r.body)["error"]["code"] == code


def test_outcomes_without_an_answer_of_ours_cannot_be_queue_refusals() -> None:
    for outcome in (Outcome.ADMITTED, Outcome.CANCELLED_WHILE_QUEUED, Outcome.REJECTED_INVALID):
        with pytest.raises(ValueError):
            queue_rejection(outcome, bucket="b", retry_after_s=1.0)
