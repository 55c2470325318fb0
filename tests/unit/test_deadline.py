"""A request's own deadline (``extproc.request.deadline``): pure, table-driven.

The rules: a header holds milliseconds left; 0 means no deadline, in a header as in a route's
``timeout`` (Envoy's meaning of 0, and Envoy never writes 0 in the header itself); negative,
NaN and text are ignored and reported; a huge value is a deadline like any other, so the queue
timeout applies; ``stated`` tells a header's deadline from the route's; a seconds header
(the SDKs' ``x-stainless-timeout``) counts like a milliseconds one; an admitted request whose
stream ends at or after the deadline (less the margin) was abandoned.
"""

from __future__ import annotations

import math

import pytest

from extproc.config.policy import ClientDeadlinePolicy
from extproc.request.deadline import NO_DEADLINE, Deadline, abandoned, deadline_of, header_ms

HEADER = "x-envoy-expected-rq-timeout-ms"
SECONDS = "x-stainless-timeout"
POLICY = ClientDeadlinePolicy(
    headers=(HEADER, "x-deadline-ms"), seconds_headers=(SECONDS,), margin_s=0.5
)
NOW = 100.0


@pytest.mark.parametrize(
    ("value", "ms"),
    [
        ("1200", 1200.0),
        ("1200.5", 1200.5),
        (" 30000 ", 30000.0),
        ("0", None),  # no deadline, as a route's timeout: 0s
        ("0.0", None),
        ("-0", None),
        ("99999999999999999999", 1e20),  # huge: a deadline the queue timeout caps
        ("1e400", math.inf),
    ],
)
def test_a_header_holds_milliseconds_and_0_means_none(value: str, ms: float | None) -> None:
    assert header_ms(value) == ms


@pytest.mark.parametrize("value", ["-1", "-1e400", "nan", "NaN", "soon", "", "12ms", "0x10"])
def test_negative_nan_and_text_are_not_a_deadline(value: str) -> None:
    with pytest.raises(ValueError):
        header_ms(value)


@pytest.mark.parametrize(
    ("headers", "route_s", "want"),
    [
        ({}, None, NO_DEADLINE),
        ({}, 0.0, NO_DEADLINE),  # route timeout 0s: Envoy's "none"
        ({HEADER: "0"}, None, NO_DEADLINE),  # header 0: the same
        ({HEADER: "0"}, 0.0, NO_DEADLINE),
        ({HEADER: "1200"}, None, Deadline(at=NOW + 0.7, stated=True)),
        ({}, 30.0, Deadline(at=NOW + 29.5, stated=False)),
        # The earliest wins; a tie goes to the route (the operator's, not the client's).
        ({HEADER: "1200"}, 30.0, Deadline(at=NOW + 0.7, stated=True)),
        ({HEADER: "30000"}, 2.0, Deadline(at=NOW + 1.5, stated=False)),
        ({HEADER: "2000"}, 2.0, Deadline(at=NOW + 1.5, stated=False)),
        ({HEADER: "5000", "x-deadline-ms": "3000"}, None, Deadline(at=NOW + 2.5, stated=True)),
        ({HEADER: "0", "x-deadline-ms": "3000"}, None, Deadline(at=NOW + 2.5, stated=True)),
        # Ignored values are reported; the other header still counts.
        (
            {HEADER: "-5", "x-deadline-ms": "3000"},
            None,
            Deadline(at=NOW + 2.5, stated=True, invalid=((HEADER, "-5"),)),
        ),
        ({HEADER: "nan"}, None, Deadline(invalid=((HEADER, "nan"),))),
        ({HEADER: "soon"}, 30.0, Deadline(at=NOW + 29.5, invalid=((HEADER, "soon"),))),
        # A header the policy does not name is not read.
        ({"x-other-ms": "10"}, None, NO_DEADLINE),
        # Seconds: the SDK's per-attempt timeout, against milliseconds and the route's.
        ({SECONDS: "600"}, None, Deadline(at=NOW + 599.5, stated=True)),
        ({SECONDS: "2", HEADER: "3000"}, None, Deadline(at=NOW + 1.5, stated=True)),
        ({SECONDS: "5", HEADER: "3000"}, None, Deadline(at=NOW + 2.5, stated=True)),
        ({SECONDS: "1.5"}, 30.0, Deadline(at=NOW + 1.0, stated=True)),
        ({SECONDS: "0"}, 30.0, Deadline(at=NOW + 29.5, stated=False)),
        ({SECONDS: "60s"}, None, Deadline(invalid=((SECONDS, "60s"),))),
    ],
)
def test_the_deadline_is_the_earliest_stated_less_the_margin(
    headers: dict[str, str], route_s: float | None, want: Deadline
) -> None:
    got = deadline_of(headers, POLICY, route_s, NOW)
    assert got.stated == want.stated and got.invalid == want.invalid
    if want.at is None:
        assert got.at is None
    else:
        assert got.at == pytest.approx(want.at)


def test_nothing_stated_allocates_nothing() -> None:
    assert deadline_of({}, POLICY, None, NOW) is NO_DEADLINE
    assert deadline_of({HEADER: "0"}, POLICY, 0.0, NOW) is NO_DEADLINE


@pytest.mark.parametrize(
    ("deadline", "timeout_s", "want"),
    [
        (NO_DEADLINE, 3.0, (3.0, False)),
        (Deadline(at=NOW + 0.7, stated=True), 3.0, (0.7, True)),  # the client's, sooner
        (Deadline(at=NOW + 0.7, stated=False), 3.0, (0.7, False)),  # the route's, sooner
        (Deadline(at=NOW + 5.0, stated=True), 3.0, (3.0, False)),  # later: the queue timeout
        (Deadline(at=NOW + 3.0, stated=True), 3.0, (3.0, False)),  # the same: not shortened
        (Deadline(at=math.inf, stated=True), 3.0, (3.0, False)),  # huge: capped
        (Deadline(at=NOW - 0.4, stated=True), 3.0, (0.0, True)),  # already past: now
    ],
)
def test_a_deadline_only_shortens_the_queue_timeout(
    deadline: Deadline, timeout_s: float, want: tuple[float, bool]
) -> None:
    timeout, own = deadline.cap(timeout_s, NOW)
    assert timeout == pytest.approx(want[0]) and own == want[1]


def test_a_huge_header_is_capped_by_the_queue_timeout() -> None:
    for value in ("99999999999999999999", "1e400"):
        d = deadline_of({HEADER: value}, POLICY, None, NOW)
        assert d.invalid == () and d.cap(3.0, NOW) == (3.0, False)


def test_an_answer_is_abandoned_when_its_stream_ends_within_the_margin_of_the_deadline() -> None:
    """The margin is the tolerance: a client that leaves at its deadline may be seen leaving a
    little before it (its clock started before ours)."""
    d = deadline_of({HEADER: "30000"}, POLICY, None, NOW)
    assert not abandoned(d, NOW + 29.4)  # in time
    assert abandoned(d, NOW + 29.5) and abandoned(d, NOW + 31.0)
    assert not abandoned(NO_DEADLINE, NOW + 1e9)  # nobody said when they would leave
