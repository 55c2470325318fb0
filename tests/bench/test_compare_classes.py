"""``python -m bench.compare.classes``: the per-class figures from a comparison's output files
(synthetic ones here: two answers, two limit samples, two seeds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.compare.classes import main, rows_of


def _write(out: Path, *, batch_rps: float, limits: list[float]) -> None:
    out.mkdir()
    run = {
        "label": "2x",
        "scenario": "steady",
        "load": 2.0,
        "strategy": "sidecar",
        "window_s": [90.0, 200.0],
        "goodput_rps": 10.0,
        "goodput_tokens_per_s": 2000.0,
        "per_class": {"interactive": {"goodput_rps": 8.0}, "batch": {"goodput_rps": batch_rps}},
        "interactive_ttft_p99_first_attempt_s": 1.5,
        "wasted_frac": 0.01,
    }
    (out / "compare.json").write_text(json.dumps({"runs": [run]}))
    answer = {"cls": "interactive", "good": True, "ttft_s": 0.5, "arrival_s": 100.0}
    records = [
        {**answer, "e2e_s": 0.5 + 0.04 * 100, "output_tokens": 101},  # 40 ms a token
        {**answer, "e2e_s": 0.5 + 0.06 * 10, "output_tokens": 11},  # 60 ms a token
        {**answer, "e2e_s": 0.5, "output_tokens": 1},  # one token: no gap
        {**answer, "e2e_s": 0.5 + 9.0, "output_tokens": 10, "good": False},  # late: left out
        {**answer, "e2e_s": 1.0, "output_tokens": 5, "arrival_s": 10.0},  # before the window
    ]
    samples = [{"t_s": t, "limit": v} for t, v in zip((95.0, 100.0, 105.0), limits, strict=True)]
    (out / "records.json").write_text(json.dumps({"steady-2x/sidecar": records}))
    (out / "timelines.json").write_text(json.dumps({"steady-2x/sidecar": samples}))


def test_rows_carry_classes_client_tpot_and_the_limits_band(tmp_path: Path) -> None:
    _write(tmp_path / "a", batch_rps=2.0, limits=[60, 70, 80])
    row = rows_of(tmp_path / "a")[("2x", "sidecar")]
    assert (row["interactive_rps"], row["batch_rps"], row["waste_pct"]) == (8.0, 2.0, 1.0)
    assert row["tpot_p90_ms"] == pytest.approx(40 + 0.9 * 20)  # of 40 and 60 ms, interpolated
    assert row["limit"] == "62/70/78"


def test_several_outputs_print_the_mean_and_half_the_spread(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write(tmp_path / "a", batch_rps=2.0, limits=[60, 70, 80])
    _write(tmp_path / "b", batch_rps=3.0, limits=[60, 70, 80])
    assert main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    header, line = capsys.readouterr().out.splitlines()
    assert header.split()[:4] == ["run", "strategy", "good/s", "tok/s"]
    assert "2.50+-0.50" in line.split() and "10.00+-0.00" in line.split()
    assert main([]) == 2
