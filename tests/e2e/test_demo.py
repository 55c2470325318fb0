"""`make demo` keeps working: a short run of the same script, end to end."""

from __future__ import annotations

import re
import subprocess
import sys

from testing.stack import REPO


def test_demo_runs_and_prints_the_table() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.demo",
            "--interactive-rate",
            "40",
            "--seconds",
            "1",
            "--batch",
            "3",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line.strip()}
    # requests sent 200 413 429-full 429-late other ...
    assert rows["interactive"][1] == "40"
    assert rows["batch"][1:3] == ["3", "3"]
    assert rows["oversize"][1:4] == ["3", "0", "3"]
    assert 'outcome="rejected_too_large"} 3.0' in out.stdout
    # Every answer is in a column: between "sent" and "other", each row adds up to "sent".
    cells = {
        line.split()[0]: re.split(r"\s{2,}", line.strip())
        for line in out.stdout.splitlines()
        if line.startswith(("requests", "interactive", "batch", "oversize"))
    }
    headers = cells.pop("requests")
    answers = headers[headers.index("sent") + 1 : headers.index("other") + 1]
    assert answers[:2] == ["200", "413"]
    assert set(cells) == {"interactive", "interactive-retry", "batch", "oversize"}
    for row in cells.values():
        got = dict(zip(headers, row, strict=True))
        assert sum(int(got[c]) for c in answers) == int(got["sent"]), got
    # Each interactive request refused with 429 came back once, and only those.
    first = dict(zip(headers, cells["interactive"], strict=True))
    refused = sum(int(first[c]) for c in answers if c.startswith("429"))
    assert int(dict(zip(headers, cells["interactive-retry"], strict=True))["sent"]) == refused
    # Only the counters that are not zero.
    assert " 0.0" not in out.stdout
    assert "all processes stopped." in out.stdout
