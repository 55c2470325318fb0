"""Tier 1: the scripts' replies decoded (``extproc.pool.shared.replies``) and applied to what one
replica knows (``extproc.pool.shared.ledger``). No Redis, no event loop."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from extproc.config.policy import SharedPolicy
from extproc.pool.shared import replies
from extproc.pool.shared.decide import Grace, Mode, View
from extproc.pool.shared.ledger import Ledger, Renewed
from extproc.pool.shared.replies import DemandChanged, Freed, ReplyError


def test_replies_decode_as_redis_py_reads_them() -> None:
    assert replies.acquired([2, 5, 8, [b"a", b"0:1,5:2", b"c", b""]]) == replies.Acquired(
        granted=2, count=5, limit=8, others={"a": {0: 1, 5: 2}}
    )
    assert replies.returned([1, 4, 8]) == replies.Returned(given=1, count=4, limit=8)
    reply = [3, 8, b"a", [b"b:7"], 1, [b"c", b"a"], []]
    assert replies.renewed(reply) == replies.Renewed(
        count=3, limit=8, leader="a", lost=("b:7",), claimed=1, live=("c", "a"), others={}
    )


@pytest.mark.parametrize(
    ("decode", "reply", "error"),
    [
        (replies.returned, None, "RETURN reply: expected a list, got NoneType"),
        (
            replies.returned,
            [1, 2],
            r"RETURN reply: expected 3 items \(given, count, limit\), got 2",
        ),
        (replies.returned, [1, b"x", 3], "RETURN reply: count should be an integer, got b'x'"),
        (replies.returned, [1, True, 3], "RETURN reply: count should be an integer, got True"),
        (replies.acquired, [1, 2, 3, [b"a"]], "ACQUIRE reply: others' demand has an odd length 1"),
        (replies.acquired, [1, 2, 3, b"a"], "ACQUIRE reply: others' demand should be a list"),
        (
            replies.renewed,
            [3, 8, None, [], 0, [], []],
            "RENEW reply: leader should be a string, got None",
        ),
        (
            replies.renewed,
            [3, 8, b"", [b"x", 7], 0, [], []],
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


class Checked(Ledger):
    """A ledger whose ``known`` is checked against a view made afresh on every read: a
    method that changes a field of the view without saying so fails here."""

    def known(self) -> View:
        known = super().known()
        assert known == self._make_view()
        return known


def ledger(limit: int = 8) -> Checked:
    policy = SharedPolicy(redis="redis://x", lease_s=3.0, replicas=2)
    book = Checked(policy, "me", limit=limit, adaptive=False)
    book.known()
    return book


def test_ids_go_back_newest_first_and_failed_ones_stay_doubtful() -> None:
    book = ledger()
    ids = book.new_ids(3)
    assert ids == ["me:1", "me:2", "me:3"]
    book.acquired(ids, {0: 3}, replies.Acquired(granted=3, count=3, limit=8, others={}))
    assert book.pop_ids(2) == ["me:3", "me:2"] and book.held == 1
    assert book.pop_ids(5) == ["me:1"] and book.pop_ids(1) == []
    book.doubt(["me:9"])
    assert book.take_doubtful() == ["me:9"] and book.take_doubtful() == []


def test_an_acquire_keeps_the_granted_ids_and_publishes_the_rest() -> None:
    book = ledger()
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
    book = ledger()
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
    assert book.known().valid_until == pytest.approx(20.0 + 3.0 * 0.98)
    assert book.known().replicas == ["me", "x"]
    assert book.rejoin(21.5, share) == pytest.approx(11.5)
    assert book.degraded_since is None
    assert book.known().mode is Mode.SHARED
    assert book.known().grace == Grace(until=24.5, cap=4)


def test_leaving_forgets_every_id_held_or_doubtful() -> None:
    book = ledger()
    ids = book.new_ids(2)
    book.acquired(ids, {0: 2}, replies.Acquired(granted=1, count=1, limit=8, others={}))
    book.doubt(ids[1:])
    assert book.take_all() == ["me:1", "me:2"] and book.held == 0
    book.gave_back(["me:1"], "a")
    assert book.known().count == 1  # held for another replica: still counted
    book.gave_back(["me:1"], None)
    assert book.known().count == 0
