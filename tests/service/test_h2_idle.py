"""The choice of the connection a newcomer displaces at ``max_connections`` (``IdleOrder``),
alone: keys are names, each connection's mark a number the test sets (None: a call is open).
No event loop, no sockets."""

from __future__ import annotations

import pytest

from extproc.transport.h2.idle import IdleOrder

# Steps, in a case's string: "new K" a connection arrives (mark 0); "use K N" it opened
# streams up to N ("use K call": a call is open now); "tick K" the server's tick looks at it;
# "gone K" it is lost; "victim K" the next newcomer displaces K ("victim -": none).
CASES: dict[str, str] = {
    "oldest-first": "new a, new b, new c, victim a, victim b, victim c, victim -",
    "never-used-before-used": (
        "new envoy, use envoy 7, tick envoy, new stranger, victim stranger, victim envoy"
    ),
    "a-call-open-is-never-chosen": (
        "new envoy, use envoy call, new stranger, victim stranger, victim -,"
        " use envoy 41, victim -, tick envoy, victim envoy"  # back at the tick after its calls
    ),
    "the-tick-takes-out-a-connection-with-a-call": (
        "new a, use a 1, tick a, use a call, tick a, use a 1, victim -"
    ),
    "used-since-placed-goes-to-the-back": (
        "new a, new b, use a 1, use b 1, tick a, tick b, use a 3, victim b, victim a"
    ),
    "the-tick-moves-the-used-back": (
        "new a, new b, use a 1, use b 1, tick a, tick b, use a 3, tick a, tick b, victim b"
    ),
    "a-fresh-one-that-opened-a-stream-is-used": (
        "new a, new b, use a 1, victim b, new c, victim c, victim a"
    ),
    "all-used-lately-the-least-recent-goes": "new a, new b, use a 1, use b 1, victim a",
    "lost-connections-are-forgotten": "new a, new b, gone a, victim b, victim -",
}


@pytest.mark.parametrize("steps", CASES.values(), ids=CASES.keys())
def test_the_newcomer_displaces_the_least_recently_used_without_a_call(steps: str) -> None:
    marks: dict[str, int | None] = {}
    order = IdleOrder(marks.__getitem__)
    for i, step in enumerate(steps.split(", ")):
        what, key, *mark = step.split()
        if what == "new":
            marks[key] = 0
            order.update(key)
        elif what == "use":
            marks[key] = None if mark == ["call"] else int(mark[0])
        elif what == "tick":
            order.update(key)
        elif what == "gone":
            order.discard(key)
        else:
            assert what == "victim"
            assert order.victim() == (None if key == "-" else key), f"step {i}: {step}"


def test_choosing_costs_o1_amortized() -> None:
    """Each entry the choice passes over is dropped (a call open) or moved back once (used
    since placed): with every connection busy, the first choice reads each mark once and the
    next reads none; with every one used since placed, one choice reads each twice at most."""
    n = 256
    reads = [0]
    marks: dict[int, int | None] = dict.fromkeys(range(n), 0)

    def mark(key: int) -> int | None:
        reads[0] += 1
        return marks[key]

    order = IdleOrder(mark)
    for key in range(n):
        order.update(key)
    marks.update(dict.fromkeys(range(n), None))
    reads[0] = 0
    assert order.victim() is None
    assert reads[0] == n and len(order) == 0
    reads[0] = 0
    assert order.victim() is None
    assert reads[0] == 0

    marks.update(dict.fromkeys(range(n), 1))
    for key in range(n):
        order.update(key)
    marks.update(dict.fromkeys(range(n), 2))
    reads[0] = 0
    assert order.victim() == 0
    assert reads[0] <= 2 * n + 1
    reads[0] = 0
    assert order.victim() == 1
    assert reads[0] == 1
