"""Deployment artifacts (Dockerfile, docker-compose.yml, deploy/), checked without Docker or a
cluster: no Docker daemon runs where these tests run, so the container files are checked
structurally and by running what they would run (the image's entrypoint, command and health
check, with the real CLI; the build context, by building the wheel from it).

Envoy configs are checked by the real Envoy 1.40 (`--mode validate`), and one by running it.
Prometheus rules and the Grafana dashboard are checked against the metric names a live sidecar
exports; `promtool check rules` / `promtool test rules` run too when promtool is installed
(`apt-get install prometheus`), and `docker-compose config` when a compose CLI is. CI
(.ci/run) installs both and sets LLM_EXTPROC_REQUIRE_TOOLS=1, which turns their absence into a
failure instead of a skip.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from extproc.app import Sidecar, default_policy
from extproc.config.envoy import render
from extproc.config.policy import Policy, load_policy, policy_from_yaml
from extproc.outcome import Outcome
from testing.stack import REPO, Proc, envoy_binary, free_port, render_envoy_config, wait_tcp

EXT_PROC = "envoy.filters.http.ext_proc"
HEADER_MUTATION = "envoy.filters.http.header_mutation"
ROUTER = "envoy.filters.http.router"
DEPLOY = REPO / "deploy"


# --- helpers -----------------------------------------------------------------------------------


def envoy_validate(
    config: dict[str, Any] | Path, tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    if isinstance(config, dict):
        path = tmp_path / f"envoy-{len(list(tmp_path.glob('envoy-*.yaml')))}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        config = path
    return subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(config), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
    )


def assert_valid(config: dict[str, Any] | Path, tmp_path: Path) -> None:
    out = envoy_validate(config, tmp_path)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr


def hcm(cfg: dict[str, Any]) -> dict[str, Any]:
    (listener,) = cfg["static_resources"]["listeners"]
    (chain,) = listener["filter_chains"]
    (manager,) = chain["filters"]
    return manager["typed_config"]  # type: ignore[no-any-return]


def http_filter(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    (f,) = [f for f in hcm(cfg)["http_filters"] if f["name"] == name]
    return f  # type: ignore[no-any-return]


def cluster(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    (c,) = [c for c in cfg["static_resources"]["clusters"] if c["name"] == name]
    return c  # type: ignore[no-any-return]


def endpoint(c: dict[str, Any]) -> tuple[str, int]:
    (locality,) = c["load_assignment"]["endpoints"]
    (lb,) = locality["lb_endpoints"]
    sock = lb["endpoint"]["address"]["socket_address"]
    return sock["address"], sock["port_value"]


def without_address(c: dict[str, Any]) -> dict[str, Any]:
    """A cluster minus what a deployment changes: discovery type, DNS family, endpoint."""
    c = copy.deepcopy(c)
    c.pop("type")
    c.pop("dns_lookup_family", None)
    c.pop("load_assignment")
    return c


def shipped_envoy() -> dict[str, Any]:
    return yaml.safe_load((REPO / "envoy" / "envoy.yaml").read_text())  # type: ignore[no-any-return]


def import_file(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def minimal_bootstrap(
    filters: list[dict[str, Any]],
    clusters: list[dict[str, Any]],
    routes: list[dict[str, Any]],
    port: int = 10000,
    name: str = "llm",
) -> dict[str, Any]:
    return {
        "static_resources": {
            "listeners": [listener(filters, routes, port, name)],
            "clusters": clusters,
        }
    }


def listener(
    filters: list[dict[str, Any]], routes: list[dict[str, Any]], port: int, name: str
) -> dict[str, Any]:
    return {
        "name": name,
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.network."
                            "http_connection_manager.v3.HttpConnectionManager",
                            "stat_prefix": name,
                            "route_config": {
                                "name": name,
                                "virtual_hosts": [
                                    {"name": name, "domains": ["*"], "routes": routes}
                                ],
                            },
                            "http_filters": filters,
                        },
                    }
                ]
            }
        ],
    }


@contextlib.contextmanager
def running_envoy(cfg: dict[str, Any], tmp_path: Path, *ports: int) -> Iterator[None]:
    """The real Envoy on a config, until the block ends; waits for its listener ports."""
    path = tmp_path / "running-envoy.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    with (tmp_path / "running-envoy.log").open("w") as log:
        proc = subprocess.Popen(
            [
                envoy_binary(),
                "-c",
                str(path),
                "--disable-hot-restart",
                "--concurrency",
                "1",
                "--log-level",
                "warning",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            for port in ports:
                wait_tcp(port)
            yield
        finally:
            proc.terminate()
            proc.wait(timeout=30)


ROUTER_FILTER: dict[str, Any] = {
    "name": ROUTER,
    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
}


def static_cluster(name: str, port: int) -> dict[str, Any]:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {
                                    "socket_address": {"address": "127.0.0.1", "port_value": port}
                                }
                            }
                        }
                    ]
                }
            ],
        },
    }


# --- Dockerfile --------------------------------------------------------------------------------


def dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """{stage name: [(INSTRUCTION, arguments)]}, in file order; continuation lines joined,
    `FROM x AS y` opening a stage; a stage built FROM another starts with its instructions."""
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    args: dict[str, str] = {}
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, rest = line.partition(" ")
        key, rest = key.upper(), " ".join(rest.split())
        if key == "ARG" and current is None:
            name, _, value = rest.partition("=")
            args[name] = value
        elif key == "FROM":
            m = re.fullmatch(r"(\S+) AS (\S+)", rest, re.IGNORECASE)
            assert m, f"every stage is named: {line}"
            base = re.sub(r"\$\{(\w+)\}", lambda a: args[a.group(1)], m.group(1))
            current = copy.copy(stages.get(base, [("BASE", base)]))
            stages[m.group(2)] = current
        else:
            assert current is not None, line
            current.append((key, rest))
    return stages


def instruction(stage: list[tuple[str, str]], key: str) -> str:
    """The last value of an instruction in a stage (the one in force)."""
    values = [v for k, v in stage if k == key]
    assert values, f"no {key}"
    return values[-1]


def exec_form(value: str) -> list[str]:
    parsed = json.loads(value)
    assert isinstance(parsed, list) and all(isinstance(a, str) for a in parsed), value
    return parsed


def healthcheck_command(stage: list[tuple[str, str]]) -> list[str]:
    value = instruction(stage, "HEALTHCHECK")
    m = re.search(r"\bCMD (\[.*\])$", value)
    assert m, value
    return exec_form(m.group(1))


def dockerignore_allows(rel: str) -> bool:
    """Docker's .dockerignore rules, for the patterns used there: in order, the last pattern
    matching the path or one of its parent folders wins; `!` re-includes; `*` stays within one
    path segment, `**` spans several."""
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    allowed = True
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern.lstrip("!").strip("/")
        regex = "".join(
            ".*" if tok == "**" else "[^/]*" if tok == "*" else re.escape(tok)
            for tok in re.split(r"(\*\*|\*)", body)
        )
        if any(re.fullmatch(regex, p) for p in prefixes):
            allowed = negate
    return allowed


def docker_context() -> list[str]:
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    ).stdout.split()
    return sorted(f for f in files if (REPO / f).is_file() and dockerignore_allows(f))


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
    assert "pip install ." in next(v for k, v in stages["runtime"] if k == "RUN")


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
    assert f'pip install "{aiohttp}"' in [v for k, v in sim if k == "RUN"]
    assert exec_form(instruction(sim, "ENTRYPOINT")) == ["python", "-m", "bench.vllm_sim"]
    assert exec_form(instruction(sim, "CMD")) == ["--host", "0.0.0.0", "--port", "8000"]
    # The simulator imports nothing from the repository beyond what the stage copies.
    source = (REPO / "bench" / "vllm_sim.py").read_text()
    assert not re.search(r"^(from|import) (bench|extproc|tests)\b", source, re.MULTILINE)


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


# --- docker compose ----------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())  # type: ignore[no-any-return]


def compose_envoy() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose" / "envoy.yaml").read_text())  # type: ignore[no-any-return]


def interpolate(value: str) -> str:
    """Compose's ${VAR:-default}, with every variable unset."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


def bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """{container path: host path} of a service's bind mounts (named volumes left out)."""
    mounts = {}
    for spec in service.get("volumes", []):
        source, target = spec.split(":")[:2]
        if source.startswith((".", "/")):
            mounts[target] = (REPO / source).resolve()
    return mounts


def host_path(service: dict[str, Any], container_path: str) -> Path:
    for target, source in bind_mounts(service).items():
        if container_path == target or container_path.startswith(target.rstrip("/") + "/"):
            return source / Path(container_path).relative_to(target)
    raise AssertionError(f"{container_path} is not in a bind mount")


def flag(command: list[str], name: str) -> str:
    """The value of --name=V or --name V in an argument list."""
    for i, arg in enumerate(command):
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
        if arg == name:
            return command[i + 1]
    raise AssertionError(f"{name} not in {command}")


def test_compose_envoy_yaml_is_rendered_from_envoy_yaml() -> None:
    render_module = import_file(DEPLOY / "compose" / "render.py")
    assert (DEPLOY / "compose" / "envoy.yaml").read_text() == render_module.render_text(), (
        "run python deploy/compose/render.py"
    )


def test_compose_envoy_yaml_differs_from_envoy_yaml_only_in_addresses() -> None:
    source, ours = shipped_envoy(), compose_envoy()
    assert ours["admin"]["address"]["socket_address"]["address"] == "0.0.0.0"
    (lst,) = ours["static_resources"]["listeners"]
    assert lst["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": 10000}
    for name in ("backend", "llm_extproc"):
        assert cluster(ours, name)["type"] == "STRICT_DNS"
        assert cluster(ours, name)["dns_lookup_family"] == "V4_ONLY"
        assert without_address(cluster(ours, name)) == without_address(cluster(source, name))
    for cfg in (source, ours):
        for key in ("admin",):
            cfg.pop(key)
        cfg["static_resources"].pop("clusters")
        for listener_cfg in cfg["static_resources"]["listeners"]:
            listener_cfg.pop("address")
    assert ours == source


def test_envoy_validates_the_compose_config_without_resolving_names(tmp_path: Path) -> None:
    assert_valid(DEPLOY / "compose" / "envoy.yaml", tmp_path)
    # STRICT_DNS names are resolved at run time, not by --mode validate: a name that can
    # never resolve (RFC 6761 .invalid) validates too.
    cfg = compose_envoy()
    for c in cfg["static_resources"]["clusters"]:
        sock = c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
        sock["socket_address"]["address"] = f"{c['name'].replace('_', '-')}.invalid"
    assert_valid(cfg, tmp_path)
    # ... and validation is not a formality: a wrong value is refused.
    cluster(cfg, "llm_extproc")["connect_timeout"] = "soon"
    assert envoy_validate(cfg, tmp_path).returncode != 0


def test_compose_services_profiles_and_wiring() -> None:
    services = compose()["services"]
    assert set(services) == {"envoy", "extproc", "sim", "vllm"}
    assert "profiles" not in services["envoy"] and "profiles" not in services["extproc"]
    assert services["sim"]["profiles"] == ["cpu"] and services["vllm"]["profiles"] == ["gpu"]
    envoy_cfg = compose_envoy()

    # Envoy: the pinned official image, the version the tests run.
    envoy = services["envoy"]
    version = subprocess.run(
        [envoy_binary(), "--version"], capture_output=True, text=True, check=True
    ).stdout
    tag = envoy["image"].removeprefix("envoyproxy/envoy:v")
    assert envoy["image"].startswith("envoyproxy/envoy:v") and f"/{tag}/" in version, version
    config_path = flag(envoy["command"], "-c")
    assert host_path(envoy, config_path) == DEPLOY / "compose" / "envoy.yaml"
    assert envoy["depends_on"]["extproc"]["condition"] == "service_healthy"
    published = {p.rsplit(":", 1)[1]: p for p in envoy["ports"]}
    assert published["9901"].startswith("127.0.0.1:"), "Envoy admin stays on localhost"
    assert interpolate(published["10000"]).startswith("127.0.0.1:")

    # The sidecar: the Dockerfile's sidecar stage, all interfaces, the mounted policy.
    extproc = services["extproc"]
    stages = dockerfile_stages()
    assert extproc["build"] == {"context": ".", "target": "sidecar"}
    command = extproc["command"]
    host, port = flag(command, "--listen").rsplit(":", 1)
    assert host == "0.0.0.0"
    assert endpoint(cluster(envoy_cfg, "llm_extproc")) == ("extproc", int(port))
    assert flag(command, "--metrics").startswith("0.0.0.0:")
    policy = host_path(extproc, flag(command, "--policy"))
    assert policy == DEPLOY / "compose" / "policy.yaml" and policy.is_file()
    assert next(p for p in extproc["ports"] if p.endswith(":9464")).startswith("127.0.0.1:")

    # Both backends answer to `backend` on port 8000, where the Envoy cluster points.
    assert endpoint(cluster(envoy_cfg, "backend")) == ("backend", 8000)
    sim, vllm = services["sim"], services["vllm"]
    for backend in (sim, vllm):
        assert "backend" in backend["networks"]["default"]["aliases"]
        assert "ports" not in backend, "a published backend port would bypass admission"
    assert sim["build"] == {"context": ".", "target": "sim"} and "sim" in stages
    assert flag(sim["command"], "--host") == "0.0.0.0" and flag(sim["command"], "--port") == "8000"
    vllm_command = vllm["command"].split()
    assert interpolate(flag(vllm_command, "--model")) == "meta-llama/Llama-3.1-8B-Instruct"
    assert "${MODEL:-" in vllm["command"] and "${VLLM_ARGS:-}" in vllm["command"]
    assert flag(vllm_command, "--host") == "0.0.0.0" and flag(vllm_command, "--port") == "8000"
    assert vllm["image"].startswith("${VLLM_IMAGE:-vllm/vllm-openai:")
    assert "HF_TOKEN" in vllm["environment"]
    (gpu,) = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]

    # Every bind-mounted file or folder exists.
    for service in services.values():
        for source in bind_mounts(service).values():
            assert source.exists(), source


def compose_cli() -> list[str] | None:
    """`docker compose` (the plugin) or `docker-compose` (v1), if installed: their `config`
    validates the file against the Compose schema without a Docker daemon."""
    docker = shutil.which("docker")
    if (
        docker
        and subprocess.run(
            [docker, "compose", "version"], capture_output=True, check=False
        ).returncode
        == 0
    ):
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_compose_cli_accepts_the_file(profile: str) -> None:
    cli = compose_cli()
    if cli is None:
        if os.environ.get("LLM_EXTPROC_REQUIRE_TOOLS"):
            pytest.fail("LLM_EXTPROC_REQUIRE_TOOLS is set but no compose CLI is on PATH")
        pytest.skip("neither `docker compose` nor docker-compose is installed")
    out = subprocess.run(
        [*cli, "-f", "docker-compose.yml", "--profile", profile, "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_stop_grace_outlasts_the_sidecars_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    """`docker compose stop` SIGKILLs after stop_grace_period; the sidecar drains admitted
    requests for --grace seconds after SIGTERM. Read the CLI's real default."""
    import extproc.cli

    seen: dict[str, Any] = {}

    async def fake_serve(args: Any) -> None:
        seen["grace"] = args.grace

    monkeypatch.setattr(extproc.cli, "_serve", fake_serve)
    monkeypatch.setattr(extproc.cli, "configure_logging", lambda *a, **k: None)
    assert extproc.cli.main(["serve"]) == 0
    period = compose()["services"]["extproc"]["stop_grace_period"]
    assert re.fullmatch(r"\d+s", period) and int(period[:-1]) > seen["grace"]


def test_compose_envoy_config_serves_through_the_sidecar(tmp_path: Path) -> None:
    """deploy/compose/envoy.yaml run for real, as compose would run it but on this machine:
    its clusters keep STRICT_DNS and resolve a name (`localhost` standing in for the compose
    service names), the sidecar runs the compose policy, testing/backend.py is the backend."""
    ports = {name: free_port() for name in ("listener", "admin", "backend", "grpc", "metrics")}
    cfg = yaml.safe_load(
        render_envoy_config(
            listener_port=ports["listener"],
            backend_port=ports["backend"],
            extproc_port=ports["grpc"],
            admin_port=ports["admin"],
            source=DEPLOY / "compose" / "envoy.yaml",
            access_log=tmp_path / "access.log",
        )
    )
    for c in cfg["static_resources"]["clusters"]:
        assert c["type"] == "STRICT_DNS"
        c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
            "socket_address"
        ]["address"] = "localhost"
    (tmp_path / "envoy.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    cli = str(Path(sys.executable).parent / "llm-extproc")
    procs = [
        Proc(
            "backend",
            [sys.executable, str(REPO / "testing" / "backend.py"), "--port", str(ports["backend"])],
            tmp_path,
        ),
        Proc(
            "sidecar",
            [
                cli,
                "serve",
                f"--listen=127.0.0.1:{ports['grpc']}",
                f"--metrics=127.0.0.1:{ports['metrics']}",
                f"--policy={DEPLOY / 'compose' / 'policy.yaml'}",
            ],
            tmp_path,
        ),
        Proc(
            "envoy",
            [
                envoy_binary(),
                "-c",
                str(tmp_path / "envoy.yaml"),
                "--disable-hot-restart",
                "--concurrency",
                "1",
                "--log-level",
                "warning",
            ],
            tmp_path,
        ),
    ]
    try:
        for name, proc in zip(("backend", "grpc", "listener"), procs, strict=True):
            wait_tcp(ports[name], proc=proc)
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 99999})
        req = urllib.request.Request(
            f"http://127.0.0.1:{ports['listener']}/v1/chat/completions",
            data=body.encode(),
            headers={"content-type": "application/json"},
            method="POST",
        )
        # STRICT_DNS resolves asynchronously after start: allow Envoy a moment.
        deadline = time.monotonic() + 10
        while True:
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    assert r.status == 200
                    assert r.headers["x-llm-max-tokens"] == "1024"  # clamped by the policy
                    echo = json.loads(r.read())["echo"]
                break
            except urllib.error.HTTPError as e:
                if e.code != 503 or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert json.loads(echo["body"])["max_tokens"] == 1024
        assert echo["headers"]["x-llm-bucket"] == "batch"
    finally:
        for proc in reversed(procs):
            proc.stop()


def assert_policy_fits(
    policy: Policy, filters: list[dict[str, Any]], llm_extproc_cluster: dict[str, Any]
) -> None:
    """What `llm-extproc render-envoy` derives from the policy is what the config has."""
    rendered = render(policy)
    assert filters == rendered["http_filters"]
    assert without_address(llm_extproc_cluster) == without_address(rendered["clusters"][0])


def test_compose_policy_loads_and_fits_the_compose_envoy_config() -> None:
    cfg = compose_envoy()
    filters = [f for f in hcm(cfg)["http_filters"] if f["name"] != ROUTER]
    assert_policy_fits(
        load_policy(DEPLOY / "compose" / "policy.yaml"), filters, cluster(cfg, "llm_extproc")
    )


# --- Istio -------------------------------------------------------------------------------------


def istio_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def envoy_filter_patches(path: Path) -> list[dict[str, Any]]:
    (ef,) = [
        d
        for d in istio_docs(path)
        if d["kind"] == "EnvoyFilter"
        and any(p["applyTo"] != "HTTP_ROUTE" for p in d["spec"]["configPatches"])
    ]
    assert ef["apiVersion"] == "networking.istio.io/v1alpha3"
    return ef["spec"]["configPatches"]  # type: ignore[no-any-return]


def apply_filter_patches(patches: list[dict[str, Any]], chain: list[dict[str, Any]]) -> None:
    """Istio's INSERT_FIRST / INSERT_BEFORE on an HTTP filter chain, in patch order."""
    for p in patches:
        if p["applyTo"] != "HTTP_FILTER":
            continue
        op, value = p["patch"]["operation"], copy.deepcopy(p["patch"]["value"])
        if op == "INSERT_FIRST":
            chain.insert(0, value)
        elif op == "INSERT_BEFORE":
            sub = p["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"]
            chain.insert([f["name"] for f in chain].index(sub), value)
        else:
            raise AssertionError(f"unexpected {op}")


def added_clusters(patches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        copy.deepcopy(p["patch"]["value"])
        for p in patches
        if p["applyTo"] == "CLUSTER" and p["patch"]["operation"] == "ADD"
    ]


def extproc_manifests() -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in istio_docs(DEPLOY / "istio" / "extproc.yaml")}


ENVOY_FILTERS = [
    DEPLOY / "istio" / "envoyfilter-gateway.yaml",
    DEPLOY / "istio" / "examples" / "sidecar-inbound.yaml",
]


@pytest.mark.parametrize("path", ENVOY_FILTERS, ids=lambda p: p.name)
def test_istio_filters_and_cluster_are_those_of_envoy_yaml(path: Path) -> None:
    shipped = shipped_envoy()
    patches = envoy_filter_patches(path)
    chain = [ROUTER_FILTER]
    apply_filter_patches(patches, chain)
    assert [f["name"] for f in chain] == [HEADER_MUTATION, EXT_PROC, ROUTER]
    for f in chain[:2]:
        assert f["typed_config"] == http_filter(shipped, f["name"])["typed_config"], f["name"]
    (ours,) = added_clusters(patches)
    assert without_address(ours) == without_address(cluster(shipped, "llm_extproc"))
    assert ours["type"] == "STRICT_DNS"
    # It points at the sidecar's Service, on the port the container listens on.
    manifests = extproc_manifests()
    service, deployment = manifests["Service"], manifests["Deployment"]
    meta = service["metadata"]
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert endpoint(ours) == (f"{meta['name']}.{meta['namespace']}.svc.cluster.local", grpc["port"])
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert flag(container["args"], "--listen") == f"0.0.0.0:{grpc['port']}"
    assert ours["name"] == chain[1]["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]


def test_istio_configmap_policy_loads_and_fits_the_envoyfilter() -> None:
    manifests = extproc_manifests()
    policy = policy_from_yaml(manifests["ConfigMap"]["data"]["policy.yaml"], "ConfigMap")
    patches = envoy_filter_patches(ENVOY_FILTERS[0])
    chain: list[dict[str, Any]] = []
    apply_filter_patches([p for p in patches if p["patch"]["operation"] == "INSERT_FIRST"], chain)
    chain += [p["patch"]["value"] for p in patches if p["patch"]["operation"] == "INSERT_BEFORE"]
    (ours,) = added_clusters(patches)
    assert_policy_fits(policy, chain, ours)


def test_istio_sidecar_deployment() -> None:
    manifests = extproc_manifests()
    deployment, service = manifests["Deployment"], manifests["Service"]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert deployment["spec"]["replicas"] == 1  # admission state lives in one process
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert container["readinessProbe"]["grpc"]["port"] == 50051
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "grpc": 50051,
        "http-metrics": 9464,
    }
    assert container["resources"]["requests"] and container["resources"]["limits"]
    # The policy file is the ConfigMap's key, in the mounted folder.
    (mount,) = container["volumeMounts"]
    (volume,) = pod["spec"]["volumes"]
    assert volume["configMap"]["name"] == manifests["ConfigMap"]["metadata"]["name"]
    assert flag(container["args"], "--policy") == f"{mount['mountPath']}/policy.yaml"
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    # Drain: preStop, then up to --grace (the CLI default) within the termination period.
    prestop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["spec"]["terminationGracePeriodSeconds"] > prestop + 30
    for doc in manifests.values():
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == manifests["Namespace"]["metadata"]["name"]


def virtual_service_routes() -> list[dict[str, Any]]:
    """The example VirtualService's routes, translated as Istio would (name, path, header
    match, timeout, header edits), all to a `backend` cluster."""
    (vs,) = [
        d
        for d in istio_docs(DEPLOY / "istio" / "examples" / "routes.yaml")
        if d["kind"] == "VirtualService"
    ]
    routes = []
    for http in vs["spec"]["http"]:
        route: dict[str, Any] = {"name": http["name"]}
        (match,) = http.get("match", [{}])
        route["match"] = {"path": match["uri"]["exact"]} if "uri" in match else {"prefix": "/"}
        if "headers" in match:
            route["match"]["headers"] = [
                {"name": k, "string_match": {"exact": v["exact"]}}
                for k, v in match["headers"].items()
            ]
        route["route"] = {"cluster": "backend", "timeout": http["timeout"]}
        headers = http.get("headers", {})
        if "remove" in headers.get("request", {}):
            route["request_headers_to_remove"] = headers["request"]["remove"]
        if "set" in headers.get("response", {}):
            route["response_headers_to_add"] = [
                {"header": {"key": k, "value": v}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
                for k, v in headers["response"]["set"].items()
            ]
        routes.append(route)
    return routes


def merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """Istio's MERGE (protobuf merge): maps merge key by key, lists append, scalars replace."""
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            merge(target[key], value)
        elif isinstance(value, list) and isinstance(target.get(key), list):
            target[key] += copy.deepcopy(value)
        else:
            target[key] = copy.deepcopy(value)


def test_istio_gateway_with_example_routes_validates_in_envoy(tmp_path: Path) -> None:
    """The gateway EnvoyFilter's filters and cluster, plus the example routes with their
    HTTP_ROUTE merge patches applied, make a config the real Envoy accepts."""
    patches = envoy_filter_patches(ENVOY_FILTERS[0])
    chain = [ROUTER_FILTER]
    apply_filter_patches(patches, chain)
    routes = virtual_service_routes()
    by_name = {r["name"]: r for r in routes}
    (route_filter,) = [
        d
        for d in istio_docs(DEPLOY / "istio" / "examples" / "routes.yaml")
        if d["kind"] == "EnvoyFilter"
    ]
    for p in route_filter["spec"]["configPatches"]:
        assert p["applyTo"] == "HTTP_ROUTE" and p["patch"]["operation"] == "MERGE"
        merge(
            by_name[p["match"]["routeConfiguration"]["vhost"]["route"]["name"]], p["patch"]["value"]
        )
    # The metadata names a bucket of the ConfigMap's policy; the catch-all skips ext_proc.
    policy = policy_from_yaml(extproc_manifests()["ConfigMap"]["data"]["policy.yaml"])
    bucket = by_name["llm-priority"]["metadata"]["filter_metadata"]["llm_extproc"]["bucket"]
    assert bucket in {b.name for b in policy.buckets}
    assert by_name["llm-other"]["typed_per_filter_config"][EXT_PROC]["disabled"] is True
    # LLM routes echo the effective max_tokens, as envoy/envoy.yaml's virtual host does.
    (vhost,) = hcm(shipped_envoy())["route_config"]["virtual_hosts"]
    for name in ("llm-priority", "llm-chat", "llm-completions"):
        assert by_name[name]["response_headers_to_add"] == vhost["response_headers_to_add"], name
    clusters = [*added_clusters(patches), static_cluster("backend", 8000)]
    assert_valid(minimal_bootstrap(chain, clusters, routes), tmp_path)
    sidecar_chain = [ROUTER_FILTER]
    sidecar_patches = envoy_filter_patches(ENVOY_FILTERS[1])
    apply_filter_patches(sidecar_patches, sidecar_chain)
    clusters = [*added_clusters(sidecar_patches), static_cluster("backend", 8000)]
    assert_valid(minimal_bootstrap(sidecar_chain, clusters, routes), tmp_path)


def test_ext_proc_default_on_and_opt_in_modes_with_the_real_envoy(tmp_path: Path) -> None:
    """Pins what deploy/istio/README.md says about the two ways to scope ext_proc, on Envoy
    1.40, with the gateway EnvoyFilter's own filter config and the sidecar unreachable (so a
    route where ext_proc runs answers 500, fail-closed, and one where it does not answers 200):
    - default on: every route runs it, unless the route has ExtProcPerRoute `disabled: true`;
    - opt-in (`disabled: true` on the filter): only routes with an ExtProcPerRoute run it."""
    patches = envoy_filter_patches(ENVOY_FILTERS[0])
    (ext_proc,) = [
        p["patch"]["value"] for p in patches if p["patch"]["value"].get("name") == EXT_PROC
    ]
    (ours,) = added_clusters(patches)
    dead = static_cluster(ours["name"], free_port())  # nothing listens there
    dead["typed_extension_protocol_options"] = ours["typed_extension_protocol_options"]

    def per_route(config: dict[str, Any]) -> dict[str, Any]:
        return {
            EXT_PROC: {
                "@type": "type.googleapis.com/envoy.extensions.filters.http."
                "ext_proc.v3.ExtProcPerRoute",
                **config,
            }
        }

    def direct(path: str, **extra: Any) -> dict[str, Any]:
        return {
            "match": {"path": path},
            "direct_response": {"status": 200, "body": {"inline_string": "ok"}},
            **extra,
        }

    default_port, opt_in_port = free_port(), free_port()
    opt_in_filter = {**copy.deepcopy(ext_proc), "disabled": True}
    cfg = {
        "static_resources": {
            "listeners": [
                listener(
                    [copy.deepcopy(ext_proc), ROUTER_FILTER],
                    [
                        direct("/v1/chat/completions"),
                        direct("/v1/models", typed_per_filter_config=per_route({"disabled": True})),
                    ],
                    default_port,
                    "default_on",
                ),
                listener(
                    [opt_in_filter, ROUTER_FILTER],
                    [
                        direct(
                            "/v1/chat/completions",
                            typed_per_filter_config=per_route({"overrides": {}}),
                        ),
                        direct("/v1/models"),
                    ],
                    opt_in_port,
                    "opt_in",
                ),
            ],
            "clusters": [dead],
        }
    }

    def status(port: int, p: str) -> int:
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}{p}",
            data=b"{}",
            method="POST",
            headers={"content-type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return int(e.code)

    with running_envoy(cfg, tmp_path, default_port, opt_in_port):
        assert status(default_port, "/v1/chat/completions") == 500
        assert status(default_port, "/v1/models") == 200
        assert status(opt_in_port, "/v1/chat/completions") == 500
        assert status(opt_in_port, "/v1/models") == 200


def test_route_header_edits_are_invisible_to_filters_before_the_router(tmp_path: Path) -> None:
    """Why the trusted-header strip is a header_mutation *filter* and not a VirtualService
    `headers.request.remove` (an Envoy route's request_headers_to_remove/add): route header
    edits are applied by the router, after ext_proc has seen the request. Pinned on Envoy 1.40
    with a Lua filter in ext_proc's place that answers with the headers it sees."""
    port = free_port()
    lua = {
        "name": "envoy.filters.http.lua",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {
                "inline_string": (
                    "function envoy_on_request(h)\n"
                    "  local tier = h:headers():get('x-llm-tier') or 'absent'\n"
                    "  local added = h:headers():get('x-added') or 'absent'\n"
                    "  h:respond({[':status'] = '200'}, tier .. ' ' .. added)\n"
                    "end\n"
                )
            },
        },
    }
    route = {
        "match": {"prefix": "/"},
        "direct_response": {"status": 204},
        "request_headers_to_remove": ["x-llm-tier"],
        "request_headers_to_add": [{"header": {"key": "x-added", "value": "yes"}}],
    }
    cfg = minimal_bootstrap([lua, ROUTER_FILTER], [], [route], port)
    with running_envoy(cfg, tmp_path, port):
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/", headers={"x-llm-tier": "priority"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.read() == b"priority absent"


# --- Prometheus rules and the Grafana dashboard ------------------------------------------------


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Sample names a real sidecar exports: from a live /metrics scrape, with each family's
    type (histograms as _bucket/_sum/_count, counters as _total), since labelled series appear
    only once something was counted."""

    async def scrape() -> str:
        sidecar = Sidecar(default_policy(), listen="127.0.0.1:0", metrics_listen="127.0.0.1:0")
        await sidecar.start()
        try:
            url = f"http://127.0.0.1:{sidecar.metrics_port}/metrics"
            return await asyncio.to_thread(
                lambda: urllib.request.urlopen(url, timeout=5).read().decode()
            )
        finally:
            await sidecar.stop(0)

    names = set()
    for family in text_string_to_metric_families(asyncio.run(scrape())):
        suffixes = {
            "counter": ["_total"],
            "histogram": ["_bucket", "_sum", "_count"],
            "gauge": [""],
        }[family.type]
        names |= {family.name + s for s in suffixes}
    assert "llm_extproc_requests_total" in names and "llm_extproc_queue_depth" in names
    return names


_NOT_METRICS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "and",
    "or",
    "unless",
    "inf",
    "nan",
}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects: identifiers that are not functions, keywords,
    label names (in {...}, by (...), ...), durations or strings."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    names = set()
    for m in re.finditer(r"(?<![\w:.$])[A-Za-z_:][\w:]*", e):
        if e[m.end() :].lstrip().startswith("(") or m.group(0).lower() in _NOT_METRICS:
            continue
        names.add(m.group(0))
    return names


LABEL_VALUES = {
    "outcome": {str(o) for o in Outcome},
    "action": {"defaulted", "clamped"},
    "result": {"ok", "error"},
}


def assert_label_values(expr: str) -> None:
    for label, value in re.findall(r'\b(\w+)\s*=~?\s*"([^"]*)"', expr):
        if label in LABEL_VALUES:
            assert set(value.split("|")) <= LABEL_VALUES[label], f"{label}={value!r} in {expr}"


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((DEPLOY / "prometheus" / "rules.yaml").read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def alert_threshold(name: str) -> float:
    (rule,) = [r for r in rules() if r.get("alert") == name]
    return float(rule["expr"].rsplit(">", 1)[1])


def test_rules_use_exported_metrics_and_real_label_values(exported: set[str]) -> None:
    recorded = {r["record"] for r in rules() if "record" in r}
    for rule in rules():
        names = metric_names(rule["expr"])
        assert names, rule
        unknown = names - exported - recorded - {"up"}
        assert not unknown, f"{rule.get('record') or rule.get('alert')}: {unknown}"
        assert_label_values(rule["expr"])
    alerts = {r["alert"] for r in rules() if "alert" in r}
    assert {
        "LLMExtprocEvictionsHigh",
        "LLMExtprocEvictionsCritical",
        "LLMExtprocDown",
        "LLMExtprocRoutePolicyErrors",
        "LLMExtprocPolicyReloadFailed",
    } <= alerts
    assert (
        alert_threshold("LLMExtprocEvictionsHigh"),
        alert_threshold("LLMExtprocEvictionsCritical"),
    ) == (0.05, 0.20)
    # The header's list of outcomes is complete.
    header = (DEPLOY / "prometheus" / "rules.yaml").read_text().split("groups:")[0]
    assert all(str(o) in header for o in Outcome)


def dashboard() -> dict[str, Any]:
    return json.loads((DEPLOY / "grafana" / "llm-extproc.json").read_text())  # type: ignore[no-any-return]


def dashboard_exprs() -> Iterator[tuple[dict[str, Any], str]]:
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            yield panel, target["expr"]


def test_dashboard_panels_query_exported_metrics(exported: set[str]) -> None:
    d = dashboard()
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    m = re.fullmatch(r"label_values\((\w+), bucket\)", variables["bucket"]["query"]["query"])
    assert m and m.group(1) in exported
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for panel, expr in dashboard_exprs():
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        names = metric_names(expr)
        assert names and names <= exported, f"{panel['title']}: {names - exported}"
        assert 'bucket=~"$bucket"' in expr, panel["title"]
        assert_label_values(expr)
    used = {n for _, expr in dashboard_exprs() for n in metric_names(expr)}
    assert {
        "llm_extproc_queue_depth",
        "llm_extproc_in_flight",
        "llm_extproc_capacity",
        "llm_extproc_queue_wait_seconds_bucket",
        "llm_extproc_requests_total",
        "llm_extproc_max_tokens_adjusted_total",
    } <= used
    # The eviction panel draws the alerts' thresholds.
    (eviction,) = [p for p in d["panels"] if p["title"] == "Eviction rate"]
    steps = eviction["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [s["value"] for s in steps[1:]] == [
        alert_threshold("LLMExtprocEvictionsHigh"),
        alert_threshold("LLMExtprocEvictionsCritical"),
    ]


def promtool() -> str | None:
    found = shutil.which("promtool")
    if found is None and os.environ.get("LLM_EXTPROC_REQUIRE_TOOLS"):
        pytest.fail("LLM_EXTPROC_REQUIRE_TOOLS is set but promtool is not on PATH")
    return found


def test_promtool_checks_and_unit_tests_the_rules() -> None:
    tool = promtool()
    if tool is None:
        pytest.skip("promtool not installed (apt-get install prometheus); names were checked")
    for args in (["check", "rules", "rules.yaml"], ["test", "rules", "rules.test.yaml"]):
        out = subprocess.run(
            [tool, *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=DEPLOY / "prometheus",
        )
        assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_parses_the_dashboard_queries(tmp_path: Path) -> None:
    """Grafana's variables replaced by what they expand to, each query becomes a recording
    rule, and promtool's PromQL parser must accept them all."""
    tool = promtool()
    if tool is None:
        pytest.skip("promtool not installed (apt-get install prometheus); names were checked")
    exprs = [
        expr.replace("$__rate_interval", "5m").replace("$bucket", ".*")
        for _, expr in dashboard_exprs()
    ]
    doc = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": e} for i, e in enumerate(exprs)
                ],
            }
        ]
    }
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump(doc))
    out = subprocess.run(
        [tool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
