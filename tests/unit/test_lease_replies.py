"""Tier 1: the scripts' replies decoded (``extproc.pool.shared.replies``) and applied to what one
replica knows (``extproc.pool.shared.ledger``). No Redis, no event loop."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from extproc.config.policy import SharedPolicy
from extproc.pool.shared import replies
from extproc.pool.shared.decide import RENEW_BATCH, Grace, Mode, View
from extproc.pool.shared.ledger import MAX_DOUBTFUL, Ledger, Renewed
from extproc.pool.shared.replies import DemandChanged, Freed, ReplyError


def test_replies_decode_as_redis_py_reads_them() -> None:
    reply = [2, 5, 8, [b"a", b"0:1,5:2", b"c", b""], 7, 0]
    assert replies.acquired(reply, asked=2) == replies.Acquired(
        granted=2, count=5, limit=8, others={"a": {0: 1, 5: 2}}, epoch=7
    )
    assert replies.returned([1, 4, 8, 7, 0], sent=1) == replies.Returned(
        given=1, count=4, limit=8, epoch=7
    )
    reply = [3, 8, b"a", [b"b:7"], 1, [b"c", b"a"], [], 7, 1, 5, 2]
    assert replies.renewed(reply, renewing=1, claiming=1) == replies.Renewed(
        count=3,
        limit=8,
        leader="a",
        lost=("b:7",),
        claimed=1,
        live=("c", "a"),
        others={},
        epoch=7,
        fenced=True,
        term=5,
        policies=2,
    )


def _returned(reply: object) -> object:
    return replies.returned(reply, sent=1)


def _acquired(reply: object) -> object:
    return replies.acquired(reply, asked=1)


def _renewed(reply: object) -> object:
    return replies.renewed(reply, renewing=2, claiming=0)


@pytest.mark.parametrize(
    ("decode", "reply", "error"),
    [
        (_returned, None, "RETURN reply: expected a list, got NoneType"),
        (
            _returned,
            [1, 2, 7, 0],
            r"RETURN reply: expected 5 items \(given, count, limit, epoch, fenced\), got 4",
        ),
        (_returned, [1, b"x", 3, 7, 0], "RETURN reply: count should be an integer, got b'x'"),
        (_returned, [1, True, 3, 7, 0], "RETURN reply: count should be an integer, got True"),
        (_acquired, [1, 2, 3, [b"a"], 7, 0], "ACQUIRE reply: others' demand has an odd length 1"),
        (_acquired, [1, 2, 3, b"a", 7, 0], "ACQUIRE reply: others' demand should be a list"),
        (
            _renewed,
            [3, 8, None, [], 0, [], [], 7, 0, 3, 0],
            "RENEW reply: leader should be a string, got None",
        ),
        (
            _renewed,
            [3, 8, b"", [b"x", 7], 0, [], [], 7, 0, 3, 0],
            r"RENEW reply: lost\[1\] should be a string, got 7",
        ),
    ],
)
def test_a_malformed_reply_says_what_is_wrong(
    decode: Callable[[object], object], reply: object, error: str
) -> None:
    with pytest.raises(ReplyError, match=error):
        decode(reply)


@pytest.mark.parametrize(
    ("text", "event"),
    [
        (b"freed a 2", Freed(replica="a", to="")),
        ("freed a 2 b", Freed(replica="a", to="b")),
        (b"demand a 0:1,5:2", DemandChanged(replica="a", demand={0: 1, 5: 2})),
        (b"demand a ", DemandChanged(replica="a", demand={})),
        (b"hello a", None),
        (b"", None),
    ],
)
def test_events(text: bytes | str, event: object) -> None:
    assert replies.event(text) == event


# --- untrusted input: what Redis (anyone who can write the pool's keys) may hold -------------

HUGE = b"9" * 5000  # more digits than int() reads (4,300)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (
            b"demand a 0:" + HUGE,
            "a demand message from 'a' refused: a table of 5002 bytes (at most 4096)",
        ),
        (
            b"demand a 0:" + b"9" * 19,
            "a demand message from 'a' refused: the item '0:9999999999999999999' has a number "
            "of more than 18 digits",
        ),
        (
            b"demand a 0:1,x:2",
            "a demand message from 'a' refused: the item 'x:2' is not band:count",
        ),
        (
            "demand a 0:\u0663".encode(),
            "a demand message from 'a' refused: the item '0:\u0663' is not",
        ),
        (
            b"demand a 0:\xff",
            "a message not UTF-8 (invalid start byte at byte 11): b'demand a 0:\\xff'",
        ),
        (b"demand a " + b"0:1," * 3000, "a message of 12009 bytes (at most 8192)"),
        (b"freed " + b"a" * 9000, "a message of 9006 bytes (at most 8192)"),
    ],
)
def test_a_hostile_event_is_refused_with_the_reason(text: bytes, why: str) -> None:
    """A count of 5,000 digits made ``int()`` raise and ended the listener; a non-UTF-8 message
    the same; a message of any size was read whole."""
    event = replies.event(text)
    assert isinstance(event, replies.Refused), event
    assert event.why.startswith(why)


def test_a_hostile_demand_table_in_a_reply_counts_as_none_and_is_reported() -> None:
    flat = [b"evil", b"0:" + HUGE, b"odd", b"0:1,,", b"b", b"0:2"]
    reply = replies.renewed([3, 8, b"", [], 0, [b"b"], flat, 7, 0, 3, 0], renewing=0, claiming=0)
    assert reply.others == {"b": {0: 2}}
    assert reply.refused == (
        "RENEW reply: the demand of 'evil' refused (as none): a table of 5002 bytes (at most 4096)",
        "RENEW reply: the demand of 'odd' refused (as none): the item '' is not band:count",
    )


@pytest.mark.parametrize(
    ("decode", "reply", "error"),
    [
        (
            _returned,
            [1, HUGE, 8, 7, 0],
            r"RETURN reply: count should be an integer, got b'9{24}'\.\.\. \(5000 bytes\)",
        ),
        (_returned, [1, -1, 8, 7, 0], "RETURN reply: count should be at least 0, got -1"),
        (_returned, [1, 2, b"-4", 7, 0], "RETURN reply: limit should be at least 0, got -4"),
        (_returned, [2, 2, 8, 7, 0], "RETURN reply: given should be between 0 and 1, got 2"),
        (_acquired, [3, 5, 8, [], 7, 0], "ACQUIRE reply: granted should be between 0 and 1, got 3"),
        (
            _renewed,
            [3, 8, b"\xff", [], 0, [], [], 7, 0, 3, 0],
            r"RENEW reply: leader is not UTF-8 \(invalid start byte at byte 0\)",
        ),
        (
            _renewed,
            [3, 8, b"x" * 600, [], 0, [], [], 7, 0, 3, 0],
            "RENEW reply: leader is longer than 512",
        ),
        (
            _renewed,
            [3, 8, b"", [b"a:1"] * 3, 0, [], [], 7, 0, 3, 0],
            r"RENEW reply: lost has 3 items \(at",
        ),
        (
            _renewed,
            [3, 8, b"", [], 1, [], [], 7, 0, 3, 0],
            "RENEW reply: claimed should be between 0 and 0",
        ),
        (
            _renewed,
            [3, 8, b"", [], 0, [b"r"] * 1025, [], 7, 0, 3, 0],
            r"live has 1025 items \(at most 1024",
        ),
        (_renewed, [3, 8, b"", [], 0, [], [b"r", b""] * 1025, 7, 0, 3, 0], "has 1025 entries"),
        (
            _renewed,
            [3, 8, b"", [], 0, [], [b"r", 7], 7, 0, 3, 0],
            "the demand of 'r' should be a string",
        ),
    ],
)
def test_a_reply_no_script_returns_is_refused(
    decode: Callable[[object], object], reply: object, error: str
) -> None:
    with pytest.raises(ReplyError, match=error):
        decode(reply)


def test_a_limit_read_from_redis_is_clamped_to_the_replicas_bounds() -> None:
    """A static pool's limit is its own; an adaptive pool's stays within its ``min`` and
    ``max``; every call tells the scripts so (ARGV 3), and they clamp it the same way."""
    static = ledger(8)
    assert static.limit_arg == "8:8:8"
    for limit in (10**12, 0, 9):
        static.returned(replies.Returned(given=0, count=0, limit=limit))
        assert static.known().limit == 8
    policy = SharedPolicy(redis="redis://x", lease_s=3.0)
    adaptive = Checked(policy, "me", limit=5, adaptive=True, bounds=(2, 16))
    for limit, clamped in ((10**12, 16), (0, 2), (7, 7)):
        adaptive.returned(replies.Returned(given=0, count=0, limit=limit))
        assert adaptive.known().limit == clamped
    assert adaptive.limit_arg == "7:2:16"


class Checked(Ledger):
    """A ledger whose ``known`` is checked against a view made afresh on every read: a
    method that changes a field of the view without saying so fails here."""

    def known(self) -> View:
        known = super().known()
        assert known == self._make_view()
        return known


def ledger(limit: int = 8, adaptive: bool = False) -> Checked:
    policy = SharedPolicy(redis="redis://x", lease_s=3.0, replicas=2)
    book = Checked(policy, "me", limit=limit, adaptive=adaptive)
    book.known()
    return book


def test_ids_go_back_newest_first_and_failed_ones_stay_doubtful() -> None:
    book = ledger()
    ids = book.new_ids(3)
    assert ids == ["me:1", "me:2", "me:3"]
    book.acquired(ids, {0: 3}, replies.Acquired(granted=3, count=3, limit=8, others={}))
    assert book.pop_ids(2) == ["me:3", "me:2"] and book.held == 1
    assert book.pop_ids(5) == ["me:1"] and book.pop_ids(1) == []
    book.doubt(["me:9"], 10.0)
    assert book.doubtful(12.9) == ["me:9"]  # until a call gave it back
    book.cleared(["me:9"])
    assert book.doubtful(12.9) == []


def test_doubtful_ids_are_bounded_and_go_back_in_batches() -> None:
    """Degraded, every failed renewal carried new claims: the list grew without bound (60 ->
    200 ids in 2 s with a short lease) and went back in one RENEW. An id is forgotten a lease
    after the call that carried it (Redis dropped it by then), the oldest past
    ``MAX_DOUBTFUL``, and a renewal carries ``RENEW_BATCH`` at most."""
    book = ledger()  # lease 3 s
    book.doubt([f"old:{i}" for i in range(50)], 0.0)
    book.doubt([f"new:{i}" for i in range(MAX_DOUBTFUL)], 1.0)
    assert len(book._doubtful) == MAX_DOUBTFUL  # the oldest forgotten
    batch = book.doubtful(3.5)
    assert batch == [f"new:{i}" for i in range(RENEW_BATCH)]
    book.doubt(batch, 3.5)  # carried by a call that failed too: no longer kept for that
    book.cleared(batch[:10])
    assert book.doubtful(3.5)[0] == "new:10"  # the rest of the batch next time
    assert book.doubtful(4.0) == []  # a lease after: Redis holds none of them


def test_an_acquire_keeps_the_granted_ids_and_publishes_the_rest() -> None:
    book = ledger(9)
    ids = book.new_ids(4)
    others = {"a": {0: 2}}
    book.acquired(ids, {0: 1, 5: 3}, replies.Acquired(granted=2, count=7, limit=9, others=others))
    assert book.held == 2 and (book.count, book.limit) == (7, 9)
    v = book.known()
    assert v.published == {5: 2} and v.others == others and v.theirs == {0: 2}
    assert (v.count, v.limit) == (7, 9)
    book.heard_demand("c", {0: 1})
    book.heard_demand("a", {})
    assert book.known().theirs == {0: 1}
    assert v.theirs == {0: 2}  # a view made before stays as it was
    book.returned(replies.Returned(given=1, count=6, limit=9))
    assert book.known().count == 6
    book.wrote_demand({5: 1})
    assert book.known().published == {5: 1}
    book.set_static_limit(12)
    assert book.known().limit == 12


def test_a_renewal_drops_lost_ids_keeps_claims_and_rejoins() -> None:
    book = ledger(adaptive=True)  # (a leader's limit: 9, raised)
    held = book.new_ids(2)
    book.acquired(held, {0: 2}, replies.Acquired(granted=2, count=2, limit=8, others={}))
    book.degrade(10.0)
    assert book.known().mode is Mode.DEGRADED and book.degraded_transitions == 1
    claim = book.new_ids(3)
    reply = replies.Renewed(
        count=4, limit=9, leader="me", lost=("me:1",), claimed=2, live=("x", "me"), others={}
    )
    share = 4
    after = book.renewed(20.0, claim, {0: 1}, reply)
    assert after == Renewed(raised=True, leader_changed=True, uncovered=2)
    assert book.held == 3 and book.replicas == ["me", "x"] and book.is_leader
    # lease x 0.98 less the timeout (decide rule 7)
    assert book.known().valid_until == pytest.approx(20.0 + 3.0 * 0.98 - book.policy.timeout_s)
    assert book.known().replicas == ["me", "x"]
    assert book.rejoin(21.5, share) == pytest.approx(11.5)
    assert book.degraded_since is None
    assert book.known().mode is Mode.SHARED
    assert book.known().grace == Grace(until=24.5, cap=4)


def test_leaving_forgets_every_id_held_or_doubtful() -> None:
    book = ledger()
    ids = book.new_ids(2)
    book.acquired(ids, {0: 2}, replies.Acquired(granted=1, count=1, limit=8, others={}))
    book.doubt(ids[1:], 0.0)
    assert book.take_all() == ["me:1", "me:2"] and book.held == 0
    book.gave_back(["me:1"], "a")
    assert book.known().count == 1  # held for another replica: still counted
    book.gave_back(["me:1"], None)
    assert book.known().count == 0


def test_refusals_are_all_counted_and_each_reason_logged_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    counted: list[str] = []
    now = [0.0]
    refusals = replies.Refusals(logging.getLogger("test.refusals"), counted.append, lambda: now[0])
    with caplog.at_level(logging.ERROR, logger="test.refusals"):
        for _ in range(3):
            refusals("demand", ("the same entry",))
        refusals("events", tuple(f"message {i}" for i in range(100)))
        now[0] = 60.0
        refusals("demand", ("the same entry",))
    assert counted == ["demand"] * 3 + ["events"] * 100 + ["demand"]
    logged = [r.getMessage() for r in caplog.records]
    assert logged[0] == "shared pool: refused from Redis: the same entry"
    assert logged[60] == "shared pool: more input refused this minute: counted only"
    assert len(logged) == 62 and logged[61] == logged[0]  # a new minute


def test_a_new_epoch_is_a_reset_and_the_end_of_its_fence_wakes_the_replica() -> None:
    book = ledger()
    assert not book.acquired(
        [], {}, replies.Acquired(granted=0, count=0, limit=8, others={}, epoch=5)
    )
    assert book.take_notices() == ()  # a first reply is no reset
    assert not book.returned(replies.Returned(given=0, count=0, limit=8, epoch=5))
    assert book.returned(replies.Returned(given=0, count=0, limit=8, epoch=9, fenced=True))
    (notice,) = book.take_notices()
    assert notice.startswith("its state in Redis was lost or reset (a new epoch, 9)")
    assert book.fenced and book.debug_view(0.0, 0, {})["fenced"] is True
    reply = replies.Renewed(
        count=0, limit=8, leader="", lost=(), claimed=0, live=("me",), others={}, epoch=9
    )
    after = book.renewed(1.0, [], {}, reply)
    assert after.raised and not after.reset and not book.fenced  # the fence ended: ask now
    assert book.take_notices() == ()


def test_other_policies_on_the_prefix_are_noticed_when_their_number_changes() -> None:
    book = ledger()

    def renew(policies: int) -> None:
        reply = replies.Renewed(
            count=0, limit=8, leader="", lost=(), claimed=0, live=(), others={}, policies=policies
        )
        book.renewed(1.0, [], {}, reply)

    renew(1)
    (notice,) = book.take_notices()
    assert notice.startswith("1 other policy(ies) with other limits than ours (8:8:8)")
    renew(1)
    assert book.take_notices() == () and book.other_policies == 1
    renew(0)
    assert book.take_notices() == () and book.other_policies == 0
