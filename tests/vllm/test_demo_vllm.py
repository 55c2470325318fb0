"""`make demo-vllm` keeps working: a short run of the same script against the real engine."""

from __future__ import annotations

import os
import subprocess
import sys

from testing.stack import REPO
from testing.vllm import VLLM_PYTHON, engine_python


def test_the_demo_runs_against_the_real_engine() -> None:
    python = engine_python()  # a named skip (a failure in CI) without the engine
    argv = ["--backend", "vllm-cpu", "--interactive-rate", "5", "--seconds", "2", "--batch", "2"]
    out = subprocess.run(
        [sys.executable, "-m", "bench.demo", *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, VLLM_PYTHON: python},
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line.strip()}
    # requests sent 200 413 ...: every request answered by the engine, the oversize refused
    assert rows["interactive"][1:3] == ["10", "10"], out.stdout
    assert rows["batch"][1:3] == ["2", "2"], out.stdout
    assert rows["oversize"][1:4] == ["3", "0", "3"], out.stdout
    assert "all processes stopped." in out.stdout
