"""bench.bounds without running it: its table of bounds is whole, its verdicts are right."""

from __future__ import annotations

import pytest

from bench.bounds import BOUNDS, GROUPS, main, report


def test_every_bound_has_a_group_and_a_unique_name() -> None:
    names = [b.name for b in BOUNDS]
    assert len(names) == len(set(names))
    assert {b.group for b in BOUNDS} == set(GROUPS)
    assert all(b.target_s > 0 and b.test for b in BOUNDS)


def test_verdicts_pass_miss_and_not_measured() -> None:
    queue = [b for b in BOUNDS if b.group == "queue"]
    figures = {queue[0].name: queue[0].target_s / 2, queue[1].name: queue[1].target_s}
    table, missed = report(figures, {"queue": "RuntimeError: broke"})
    rows = {line.split()[0]: line.split() for line in table.splitlines()[1:]}
    assert set(rows) == {b.name for b in queue}  # only the groups that ran
    assert rows[queue[0].name][4] == "PASS"
    assert rows[queue[1].name][4] == "MISS" and missed == 1  # at the target is a miss
    assert rows[queue[2].name][4] == "n/a" and "RuntimeError" in table


def test_unknown_names_are_refused() -> None:
    with pytest.raises(SystemExit):
        main(["--only", "nope"])
