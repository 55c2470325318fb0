"""A request's own deadline: how long its client, or its route, lets it wait.

Read once, at the request headers (``ExtProcService._handle``): the policy's
``client_deadline.headers`` and the route's ``timeout`` (route metadata, ``RouteOverride``).
The earliest of them, less ``client_deadline.margin``, caps the request's queue deadline when
it enters a queue (``Deadline.cap``), so the 429 reaches the client before it gives up.

Rules (``tests/unit/test_deadline.py`` pins each):

1. A header of ``client_deadline.headers`` holds the milliseconds left, as Envoy's router
   writes ``x-envoy-expected-rq-timeout-ms`` (an integer); one of
   ``client_deadline.seconds_headers`` holds seconds, as the Stainless-generated SDKs (OpenAI's
   and Anthropic's) send their per-attempt timeout in ``x-stainless-timeout``. Any number
   ``float`` reads is taken.
2. ``0`` means no deadline, in a header as in the route's ``timeout``. That is Envoy's meaning
   of 0 for every request timeout (a route's ``timeout: 0s``, a client's
   ``x-envoy-upstream-rq-timeout-ms: 0``), and Envoy never writes 0 into
   ``x-envoy-expected-rq-timeout-ms``: for a route without a timeout it sends no header at all
   (pinned through the real Envoy: ``tests/e2e/test_pool_through_envoy.py``), and for a request
   already out of time it writes 1 (its router's source: "0 would be an infinite timeout").
3. A negative value, NaN, or anything that is not a number is ignored (that header gives no
   deadline) and named in ``Deadline.invalid``: the servicer counts each
   (``llm_extproc_client_deadline_invalid_total``) and logs the first per header name.
4. A huge value (up to what reads as +inf, e.g. ``1e400``) is a deadline like any other, and
   like any other it only ever shortens the wait: beyond the queue timeout it changes nothing,
   the bucket's ``queue_timeout`` applies.
5. ``stated``: the earliest deadline is a header's (the client's own, or a front proxy's on its
   behalf), not the route's, which the operator set. A request that waits until a stated
   deadline sooner than its queue timeout leaves as ``expired_client_deadline``, not as an
   eviction, so short deadlines of a client's choosing do not look like overload
   (``extproc.pool.core.admission``, ``extproc.pool.control.overload``).

6. An admitted request whose stream ends at or after ``at`` (the deadline less the margin)
   was answered for nobody, or nearly (``abandoned``): its client gave up, or Envoy cut the
   answer at the route's timeout. The margin is the tolerance: the client's clock starts a
   little before ours (the request's way to the sidecar), and its leaving reaches us a little
   after it left, so a stream cut at the deadline itself may end on either side of it; an
   answer that completes within the margin of its deadline counts too. The adaptive limit's
   ``slo.abandoned`` reads the share of them (``extproc.pool.ends``).
7. A classified request's wait (``plan``): its queue timeout, cut to what a slow parse left
   (``answer_by``) and capped by its deadline (``Deadline.cap``); its own deadline (a
   relegation's bound): the sooner of the two; ``limit_s``: the timeout, plus its bucket's
   relegation unless the wait ends at its client's own deadline.

Pure: ``now`` comes from the caller. A request that states nothing (the common case) gets the
shared ``NO_DEADLINE``, without allocating.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple

from extproc.config.policy import ClientDeadlinePolicy, Policy
from extproc.pool.core.values import Entry
from extproc.request.classify import Classification
from extproc.request.tenant import Tenant

__all__ = ["NO_DEADLINE", "Deadline", "WaitPlan", "abandoned", "deadline_of", "header_ms", "plan"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Deadline:
    # Loop time at which the request stops waiting (the earliest deadline less the margin);
    # None: nobody states one.
    at: float | None = None
    # ``at`` is a header's, not the route's timeout (rule 5).
    stated: bool = False
    # (header, value) of each header whose value was ignored (rule 3).
    invalid: tuple[tuple[str, str], ...] = ()

    def cap(self, timeout_s: float, now: float) -> tuple[float, bool]:
        """``timeout_s`` (a queue timeout) capped by this deadline, and whether the cap is a
        stated deadline: the client's own, sooner than the queue timeout."""
        if self.at is None:
            return timeout_s, False
        left = max(0.0, self.at - now)
        if left < timeout_s:
            return left, self.stated
        return timeout_s, False


NO_DEADLINE = Deadline()


def header_ms(value: str) -> float | None:
    """A header's milliseconds left: None for 0 (no deadline, rule 2); ValueError for a value
    that is not a number of milliseconds >= 0 (rule 3)."""
    ms = float(value)
    if math.isnan(ms) or ms < 0:
        raise ValueError(f"not a number of milliseconds >= 0: {value!r}")
    return ms if ms > 0 else None


def abandoned(deadline: Deadline, ended_at: float) -> bool:
    """Whether a stream that ended at ``ended_at`` outlived its deadline (rule 6)."""
    return deadline.at is not None and ended_at >= deadline.at


def deadline_of(
    headers: Mapping[str, str],
    policy: ClientDeadlinePolicy,
    route_timeout_s: float | None,
    now: float,
) -> Deadline:
    """The request's deadline from its ``headers`` (the policy's names) and its route's
    ``timeout`` (None or 0: none)."""
    left_s: float | None = route_timeout_s or None
    stated = False
    invalid: list[tuple[str, str]] | None = None
    for names, unit_s in ((policy.headers, 0.001), (policy.seconds_headers, 1.0)):
        for name in names:
            value = headers.get(name)
            if value is None:
                continue
            try:
                left = header_ms(value)  # a number >= 0, in the header's own unit
            except ValueError:
                invalid = invalid or []
                invalid.append((name, value))
                continue
            if left is not None and (left_s is None or left * unit_s < left_s):
                left_s, stated = left * unit_s, True
    if left_s is None and invalid is None:
        return NO_DEADLINE
    return Deadline(
        at=None if left_s is None else now + left_s - policy.margin_s,
        stated=stated,
        invalid=tuple(invalid or ()),
    )


class WaitPlan(NamedTuple):
    """How a classified request waits (rule 7); a tuple: a third of a frozen dataclass's cost."""

    entry: Entry  # what it enters its bucket with
    until: float  # loop time its wait ends: now + ``entry.timeout_s``
    limit_s: float  # the longest it may wait, relegation included

    def remaining(self, now: float) -> Entry:
        """``entry`` with what is left of the wait at ``now`` (after a route share's)."""
        return replace(self.entry, timeout_s=max(0.0, self.until - now))


def plan(
    cls: Classification,
    deadline: Deadline,
    answer_by: float | None,
    held_bytes: int,
    tenant: Tenant,
    policy: Policy,
    now: float,
) -> WaitPlan:
    """The wait of a request classified ``cls`` entering a queue at ``now`` (rule 7)."""
    timeout = cls.queue_timeout_s
    if answer_by is not None:  # a slow parse already used some of the wait
        timeout = max(0.0, min(timeout, answer_by - now))
    own, at, stated = False, deadline.at, deadline.stated
    if at is not None:  # nobody waits past their client (own: expired there, not evicted)
        timeout, own = deadline.cap(timeout, now)
    if answer_by is not None and (at is None or answer_by < at):
        at, stated = answer_by, False  # a relegation's bound
    output = cls.output_tokens
    entry = Entry(
        bucket=cls.bucket.name,
        timeout_s=timeout,
        held_bytes=held_bytes,
        cost=cls.prompt_tokens + output,
        client_deadline=own,
        tenant=tenant.key,
        weight=tenant.weight,
        output=output,
        own_deadline=at,
        own_stated=stated and at is not None,
    )
    limit = timeout + (0.0 if own else policy.relegation_s(cls.bucket))
    return WaitPlan(entry, now + timeout, limit)
