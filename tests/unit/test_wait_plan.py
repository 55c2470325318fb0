"""How a classified request waits (``extproc.request.deadline.plan``, rule 7): pure,
table-driven. Its queue timeout, cut by a slow parse's ``answer_by`` and capped by its own
deadline; the ``Entry`` it enters its bucket with (its own deadline for a relegation: the
sooner of its deadline and ``answer_by``); and the longest it may wait, relegation included
unless the wait ends at its client's own deadline. Times are binary fractions: exact."""

from __future__ import annotations

import pytest

from extproc.config.policy import policy_from_yaml
from extproc.pool.core.values import Entry
from extproc.request.classify import Classification, MaxTokensAction
from extproc.request.deadline import NO_DEADLINE, Deadline, WaitPlan, plan
from extproc.request.tenant import NO_TENANT, Tenant

POLICY = policy_from_yaml("""
pool: {max_concurrency: 4}
buckets:
  - {name: chat, match: {headers: {x: chat}}, queue_timeout: 1s, relegate_to: late}
  - {name: late, priority: 1, queue_timeout: 4s}
""")
NOW = 100.0
CLIENT_SOON = Deadline(at=NOW + 0.5, stated=True)
CLIENT_LATE = Deadline(at=NOW + 2.0, stated=True)
CLIENT_GONE = Deadline(at=NOW - 0.5, stated=True)
ROUTE_SOON = Deadline(at=NOW + 0.5)


def classified(bucket: str) -> Classification:
    b = POLICY.bucket(bucket)
    return Classification(
        bucket=b,
        prompt_tokens=200,
        max_tokens=50,
        max_tokens_action=MaxTokensAction.KEPT,
        sequences=2,
        new_body=None,
        queue_timeout_s=b.queue_timeout_s,
    )


@pytest.mark.parametrize(
    ("bucket", "deadline", "answer_by", "timeout", "own", "limit", "own_deadline"),
    [
        # Nothing stated: the queue timeout, plus the relegation's 4 s.
        ("chat", NO_DEADLINE, None, 1.0, False, 5.0, None),
        ("late", NO_DEADLINE, None, 4.0, False, 4.0, None),  # it relegates nowhere
        # The client's deadline, sooner: the wait ends there, expired, never relegated.
        ("chat", CLIENT_SOON, None, 0.5, True, 0.5, (0.5, True)),
        ("chat", CLIENT_GONE, None, 0.0, True, 0.0, (-0.5, True)),
        # The route's, sooner: capped, but evicted as usual, and relegated within it.
        ("chat", ROUTE_SOON, None, 0.5, False, 4.5, (0.5, False)),
        # Later than the queue timeout: only a relegation's bound.
        ("chat", CLIENT_LATE, None, 1.0, False, 5.0, (2.0, True)),
        # A slow parse used some of the wait: what is left, and its answer is due by then.
        ("chat", NO_DEADLINE, NOW + 0.25, 0.25, False, 4.25, (0.25, False)),
        ("chat", NO_DEADLINE, NOW - 1.0, 0.0, False, 4.0, (-1.0, False)),
        ("chat", CLIENT_LATE, NOW + 0.25, 0.25, False, 4.25, (0.25, False)),
        ("chat", CLIENT_SOON, NOW + 0.75, 0.5, True, 0.5, (0.5, True)),
    ],
)
def test_the_plan_of_a_wait(
    bucket: str,
    deadline: Deadline,
    answer_by: float | None,
    timeout: float,
    own: bool,
    limit: float,
    own_deadline: tuple[float, bool] | None,
) -> None:
    got = plan(classified(bucket), deadline, answer_by, 1_000, Tenant("t", 2.0), POLICY, NOW)
    at, stated = (None, False) if own_deadline is None else (NOW + own_deadline[0], own_deadline[1])
    entry = Entry(
        bucket=bucket,
        timeout_s=timeout,
        held_bytes=1_000,
        cost=200 + 2 * 50,
        client_deadline=own,
        tenant="t",
        weight=2.0,
        output=2 * 50,
        own_deadline=at,
        own_stated=stated,
    )
    assert got == WaitPlan(entry=entry, until=NOW + timeout, limit_s=limit)


def test_after_a_route_share_the_bucket_gets_what_is_left_of_the_wait() -> None:
    wait = plan(classified("chat"), NO_DEADLINE, None, 0, NO_TENANT, POLICY, NOW)
    assert wait.remaining(NOW + 0.25) == Entry(bucket="chat", timeout_s=0.75, cost=300, output=100)
    assert wait.remaining(NOW + 3.0).timeout_s == 0.0
