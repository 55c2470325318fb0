"""The Dockerfile and its build context, checked without Docker: no Docker daemon runs where
these tests run, so the image is checked structurally and by running what it would run (the
sidecar stage's entrypoint, command and health check, with the real CLI; the build context, by
building the wheel from it)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import urllib.request
import zipfile
from pathlib import Path

import pytest

from testing.dockerfile import (
    docker_context,
    dockerfile_stages,
    exec_form,
    flag,
    healthcheck_command,
    instruction,
)
from testing.stack import REPO, Proc, free_port, wait_tcp


def test_dockerfile_stages_user_and_ports() -> None:
    stages = dockerfile_stages()
    # `docker build .` builds the last stage: the sidecar.
    assert list(stages) == ["runtime", "sim", "sidecar"]
    base = stages["runtime"][0][1]
    assert re.fullmatch(r"python:3\.1[1-9]-slim", base), base
    for name in ("sim", "sidecar"):
        user = instruction(stages[name], "USER")
        assert user.split(":")[0] not in ("root", "0"), f"{name} runs as {user}"
    assert instruction(stages["sidecar"], "EXPOSE").split() == ["50051", "9464"]
    # The image installs the versions the tests ran on: the lock, as constraints.
    assert "pip install -c requirements.lock ." in next(
        v for k, v in stages["runtime"] if k == "RUN"
    )


def test_docker_context_has_what_the_dockerfile_copies_and_nothing_else() -> None:
    context = docker_context()
    for stage in dockerfile_stages().values():
        for key, value in stage:
            if key != "COPY":
                continue
            *sources, _dest = value.split()
            for src in sources:
                assert (REPO / src).exists(), src
                inside = [f for f in context if f == src or f.startswith(src.rstrip("/") + "/")]
                assert inside, f"COPY {src}: .dockerignore keeps it out of the build context"
    assert "extproc/config/default_policy.yaml" in context
    assert not [f for f in context if f.startswith(("tests/", "deploy/", ".venv/", ".git/"))]


@pytest.mark.slow  # pip builds a wheel
def test_docker_context_builds_a_wheel_with_the_package_data(tmp_path: Path) -> None:
    """What `pip install .` does in the image, from exactly the files the context holds."""
    ctx = tmp_path / "ctx"
    for rel in docker_context():
        (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, ctx / rel)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(ctx),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = (tmp_path / "dist").glob("llm_extproc-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = next(n for n in names if n.endswith("entry_points.txt"))
        assert "llm-extproc = extproc.cli:main" in z.read(entry_points).decode()
    assert {"extproc/config/default_policy.yaml", "extproc/cli.py"} <= names
    assert any(n.startswith("extproc/_proto/") and n.endswith("_pb2.py") for n in names)


def test_sim_image_installs_what_the_bench_extra_asks_for_the_simulator() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    (aiohttp,) = [
        r for r in pyproject["project"]["optional-dependencies"]["bench"] if r.startswith("aiohttp")
    ]
    sim = dockerfile_stages()["sim"]
    lock = "/opt/llm-extproc/requirements.lock"
    assert f'pip install -c {lock} "{aiohttp}"' in [v for k, v in sim if k == "RUN"]
    assert exec_form(instruction(sim, "ENTRYPOINT")) == ["python", "-m", "bench.sim"]
    assert exec_form(instruction(sim, "CMD")) == ["--host", "0.0.0.0", "--port", "8000"]
    # The simulator imports nothing from the repository beyond what the stage copies.
    source = "".join(p.read_text() for p in sorted((REPO / "bench" / "sim").glob("*.py")))
    assert not re.search(r"^(from|import) (bench|extproc|tests)\b", source, re.MULTILINE)


@pytest.mark.slow  # the sidecar's CLI, started three times
def test_image_entrypoint_command_and_healthcheck_run_the_real_sidecar(tmp_path: Path) -> None:
    """ENTRYPOINT + CMD of the sidecar stage, run with the real CLI (ports moved to free ones),
    answer the image's HEALTHCHECK command; it fails against a port with nothing behind it."""
    sidecar = dockerfile_stages()["sidecar"]
    entrypoint = exec_form(instruction(sidecar, "ENTRYPOINT"))
    command = exec_form(instruction(sidecar, "CMD"))
    assert entrypoint == ["llm-extproc", "serve"]
    # Inside a container the sidecar must listen on all interfaces (the CLI defaults to
    # 127.0.0.1, which nothing outside the container reaches).
    assert command == ["--listen", "0.0.0.0:50051", "--metrics", "0.0.0.0:9464"]
    grpc_port, metrics_port = free_port(), free_port()
    argv = [
        str(Path(sys.executable).parent / entrypoint[0]),
        *entrypoint[1:],
        *[
            a.replace(":50051", f":{grpc_port}").replace(":9464", f":{metrics_port}")
            for a in command
        ],
    ]
    health = healthcheck_command(sidecar)
    assert health[0] == "python"
    # Without LLM_EXTPROC_HEALTH_ADDR it checks the port CMD listens on.
    listen_port = flag(command, "--listen").rsplit(":", 1)[1]
    assert f"'LLM_EXTPROC_HEALTH_ADDR', '127.0.0.1:{listen_port}'" in health[-1]
    health[0] = sys.executable
    env = {**os.environ, "LLM_EXTPROC_HEALTH_ADDR": f"127.0.0.1:{grpc_port}"}

    def check() -> subprocess.CompletedProcess[str]:
        return subprocess.run(health, env=env, capture_output=True, text=True, timeout=30)

    assert check().returncode != 0  # nothing listening yet
    proc = Proc("sidecar", argv, tmp_path)
    try:
        wait_tcp(grpc_port, proc=proc)
        wait_tcp(metrics_port, proc=proc)
        result = check()
        assert result.returncode == 0, result.stderr
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
            assert b"llm_extproc_capacity" in r.read()
    finally:
        # SIGTERM is the container's stop signal: the sidecar drains and exits 0.
        assert proc.stop(timeout=60) == 0, proc.log_text()
