"""``python -m bench.compare.attain``: the load each strategy sustains with both classes served
(synthetic records and output files here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.compare.attain import Figure, figure_of, main, ratio_verdict, shares_of

WINDOW = (90.0, 200.0)


def _rec(cls: str, **kw: Any) -> dict[str, Any]:
    base = {"cls": cls, "arrival_s": 100.0, "e2e_s": 5.0, "attempts": 1, "outcome": "ok"}
    base.update(good=True, ttft_s=0.5 if cls == "interactive" else None)
    return {**base, **kw}


def test_shares_count_each_original_request_and_refusals_fail() -> None:
    records = [
        _rec("interactive"),  # on time
        _rec("interactive", attempts=2, ttft_s=1.9),  # retried, still within 2 s of the first
        _rec("interactive", ttft_s=2.5),  # late first token
        _rec("interactive", outcome="http_error", good=False, ttft_s=None),  # refused, never served
        _rec("interactive", outcome="timeout", good=False, ttft_s=None),  # its client gave up
        _rec("interactive", arrival_s=10.0),  # ended before the window: not counted
        _rec("interactive", arrival_s=150.0, e2e_s=51.0, outcome="cancelled", good=False),
        _rec("batch", e2e_s=250.0, arrival_s=-60.0),  # long, but within its deadline
        _rec("batch", good=False, e2e_s=80.0),  # a 200 past its deadline, or a refusal
    ]
    shares, open_at_cut = shares_of(records, WINDOW)
    assert shares == {"interactive": pytest.approx(2 / 5), "batch": 0.5}
    assert open_at_cut == {"interactive": 1, "batch": 0}
    assert shares_of([], WINDOW)[0] == {"interactive": None, "batch": None}


def test_the_figure_is_the_first_crossing_interpolated() -> None:
    curve: dict[float, dict[str, float | None]] = {
        0.5: {"interactive": 1.0, "batch": 1.0},
        1.0: {"interactive": 0.95, "batch": 0.92},
        2.0: {"interactive": 0.85, "batch": 0.82},  # interactive crosses at 1.5, batch at 1.2
        4.0: {"interactive": 0.95, "batch": 0.95},  # passes again: does not raise it
    }
    assert figure_of(curve).kind == "exact"
    assert figure_of(curve).load == pytest.approx(1.2)
    assert figure_of({1.0: {"interactive": 0.95, "batch": None}}) == Figure(
        load=1.0, kind="at_least"
    )
    assert figure_of({1.0: {"interactive": 0.5, "batch": 1.0}, 2.0: curve[0.5]}) == Figure(
        load=1.0, kind="below"
    )
    assert str(Figure(load=1.0, kind="below")) == "< 1.00"
    with pytest.raises(ValueError):
        figure_of({})


@pytest.mark.parametrize(
    ("mine", "other", "expected"),
    [
        (Figure(load=3.0, kind="exact"), Figure(load=1.5, kind="exact"), ("2.00", "PASS")),
        (Figure(load=2.0, kind="exact"), Figure(load=1.5, kind="exact"), ("1.33", "MISS")),
        (Figure(load=2.0, kind="at_least"), Figure(load=1.0, kind="exact"), (">= 2.00", "PASS")),
        (Figure(load=1.2, kind="at_least"), Figure(load=1.0, kind="exact"), (">= 1.20", "?")),
        (Figure(load=1.5, kind="exact"), Figure(load=0.5, kind="below"), (">= 3.00", "PASS")),
        (Figure(load=0.5, kind="below"), Figure(load=1.0, kind="exact"), ("<= 0.50", "MISS")),
        (Figure(load=2.0, kind="exact"), Figure(load=1.0, kind="at_least"), ("<= 2.00", "?")),
        (Figure(load=2.0, kind="at_least"), Figure(load=2.0, kind="at_least"), ("?", "?")),
    ],
)
def test_the_ratio_and_its_verdict_respect_the_bounds(
    mine: Figure, other: Figure, expected: tuple[str, str]
) -> None:
    assert ratio_verdict(mine, other) == expected


def _write(out: Path, on_time: dict[tuple[str, float], int], seed: int) -> None:
    """Ten interactive requests per run, ``on_time`` of them answered within 2 s; batch all good."""
    out.mkdir()
    runs, records = [], {}
    for (strategy, load), n in on_time.items():
        runs.append(
            {"scenario": "steady", "load": load, "strategy": strategy, "window_s": list(WINDOW)}
        )
        recs = [_rec("interactive", ttft_s=0.5 if i < n else 3.0) for i in range(10)]
        records[f"steady-{load:g}x/{strategy}"] = [*recs, _rec("batch")]
    runs.append({"scenario": "shift", "load": 1.0, "strategy": "sidecar", "window_s": [0, 1]})
    (out / "compare.json").write_text(json.dumps({"options": {"seed": seed}, "runs": runs}))
    (out / "records.json").write_text(json.dumps(records))


def test_seeds_average_the_shares_and_the_sidecar_is_held_to_the_ratio(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write(tmp_path / "a", {("sidecar", 1.0): 10, ("sidecar", 2.0): 10, ("peer", 1.0): 10,
                            ("peer", 2.0): 8}, seed=0)  # fmt: skip
    _write(tmp_path / "b", {("sidecar", 1.0): 10, ("peer", 1.0): 10}, seed=1)
    _write(tmp_path / "b2", {("sidecar", 2.0): 9, ("peer", 2.0): 6}, seed=1)  # seed 1's 2x
    _write(tmp_path / "c", {("sidecar", 4.0): 0, ("peer", 4.0): 0}, seed=0)  # seed 0 only
    assert main([str(tmp_path / d) for d in ("a", "b", "b2", "c")]) == 0
    shares, figures = capsys.readouterr().out.split("\n\n")
    assert ["sidecar", "2", "95.0+-5.0", "100.0+-0.0", "0/0"] in [
        ln.split() for ln in shares.splitlines()
    ]
    rows = {ln.split()[0]: ln for ln in figures.splitlines()[1:]}
    assert rows["sidecar"].split()[1:3] == [">=", "2.00"]
    # peer: mean 70 % at 2x, crossing at 1 + (1 - 0.9) / (1 - 0.7) = 1.33 (seeds: 1.5, 1.25)
    assert rows["peer"].split() == ["peer", "1.33", "1.50", "/", "1.25", ">=", "1.50", "PASS"]
