"""`make demo` keeps working: a short run of the same script, end to end."""

from __future__ import annotations

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
    assert "all processes stopped." in out.stdout
