"""docker-compose.yml and deploy/compose/, checked without Docker: the services' wiring read
from the file, the compose Envoy config compared with envoy/envoy.yaml (and with what
`render-envoy` derives from the compose policy) and validated by the real Envoy 1.40, then run
for real on this machine with the sidecar and the compose policy, its pool leased from a real
redis-server standing in for the `redis` service.
`docker-compose config` checks the file against the Compose schema when a compose CLI is
installed; CI (.ci/run) installs one and sets LLM_EXTPROC_REQUIRE_TOOLS=1, which turns its
absence into a failure instead of a skip.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis
import yaml

from extproc.config.envoy import render
from extproc.config.policy import load_policy
from extproc.pool.shared.scripts import Keys
from testing.dockerfile import dockerfile_stages, flag
from testing.envoy import (
    EXT_PROC_FILTER,
    ROUTER_FILTER,
    assert_policy_fits,
    assert_valid,
    cluster_named,
    compose_envoy,
    endpoint_address,
    envoy_binary,
    envoy_validate,
    hcm_config,
    set_endpoint_host,
    shipped_envoy,
    without_address,
)
from testing.redis import RedisServer
from testing.stack import REPO, Proc, free_port, render_envoy_config, wait_http, wait_tcp
from testing.tools import optional_tool
from testing.wait import until

DEPLOY = REPO / "deploy"


def compose() -> dict[str, Any]:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())  # type: ignore[no-any-return]


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


def import_file(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compose_envoy_yaml_is_rendered_from_envoy_yaml() -> None:
    render_module = import_file(DEPLOY / "compose" / "render.py")
    assert (DEPLOY / "compose" / "envoy.yaml").read_text() == render_module.render_text(), (
        "run python deploy/compose/render.py"
    )


def test_compose_envoy_yaml_differs_only_in_addresses_and_sidecar_limits() -> None:
    """Addresses, the llm_extproc circuit breakers, which follow the compose policy (its
    adaptive pool may hold up to adaptive.max requests, more than the default policy), and the
    route the sidecar scrapes vLLM's /metrics through (the last before the catch-all)."""
    source, ours = shipped_envoy(), compose_envoy()
    assert ours["admin"]["address"]["socket_address"]["address"] == "0.0.0.0"
    (lst,) = ours["static_resources"]["listeners"]
    assert lst["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": 10000}
    policy = load_policy(DEPLOY / "compose" / "policy.yaml")
    breakers = render(policy)["clusters"][0]["circuit_breakers"]
    assert cluster_named(ours, "llm_extproc")["circuit_breakers"] == breakers
    for name in ("backend", "llm_extproc"):
        assert cluster_named(ours, name)["type"] == "STRICT_DNS"
        assert cluster_named(ours, name)["dns_lookup_family"] == "V4_ONLY"
        mine, theirs = (without_address(cluster_named(c, name)) for c in (ours, source))
        if name == "llm_extproc":
            mine.pop("circuit_breakers")
            theirs.pop("circuit_breakers")
        assert mine == theirs
    for cfg in (source, ours):
        for key in ("admin",):
            cfg.pop(key)
        cfg["static_resources"].pop("clusters")
        for listener_cfg in cfg["static_resources"]["listeners"]:
            listener_cfg.pop("address")
    metrics_route = hcm_config(ours)["route_config"]["virtual_hosts"][0]["routes"].pop(-2)
    assert metrics_route["match"]["path"] == "/metrics"
    assert ours == source


@pytest.mark.envoy
def test_envoy_validates_the_compose_config_without_resolving_names(tmp_path: Path) -> None:
    assert_valid(DEPLOY / "compose" / "envoy.yaml", tmp_path)
    # STRICT_DNS names are resolved at run time, not by --mode validate: a name that can
    # never resolve (RFC 6761 .invalid) validates too.
    cfg = compose_envoy()
    for c in cfg["static_resources"]["clusters"]:
        set_endpoint_host(c, f"{c['name'].replace('_', '-')}.invalid")
    assert_valid(cfg, tmp_path)
    # ... and validation is not a formality: a wrong value is refused.
    cluster_named(cfg, "llm_extproc")["connect_timeout"] = "soon"
    assert envoy_validate(cfg, tmp_path).returncode != 0


@pytest.mark.envoy
def test_compose_services_profiles_and_wiring() -> None:
    services = compose()["services"]
    assert set(services) == {"envoy", "extproc", "redis", "sim", "vllm", "vllm-cpu"}
    for name in ("envoy", "extproc", "redis"):
        assert "profiles" not in services[name], name
    assert services["sim"]["profiles"] == ["cpu"] and services["vllm"]["profiles"] == ["gpu"]
    assert services["vllm-cpu"]["profiles"] == ["vllm-cpu"]
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
    assert endpoint_address(cluster_named(envoy_cfg, "llm_extproc")) == ("extproc", int(port))
    assert flag(command, "--metrics").startswith("0.0.0.0:")
    policy = host_path(extproc, flag(command, "--policy"))
    assert policy == DEPLOY / "compose" / "policy.yaml" and policy.is_file()
    assert next(p for p in extproc["ports"] if p.endswith(":9464")).startswith("127.0.0.1:")

    # Every backend answers to `backend` on port 8000, where the Envoy cluster points.
    assert endpoint_address(cluster_named(envoy_cfg, "backend")) == ("backend", 8000)
    sim, vllm, vllm_cpu = services["sim"], services["vllm"], services["vllm-cpu"]
    for backend in (sim, vllm, vllm_cpu):
        assert "backend" in backend["networks"]["backend"]["aliases"]
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
    # vLLM's CPU image: no GPU asked for, its KV cache sized (else most of the memory).
    cpu_command = vllm_cpu["command"].split()
    assert flag(cpu_command, "--host") == "0.0.0.0" and flag(cpu_command, "--port") == "8000"
    assert vllm_cpu["image"].startswith("${VLLM_CPU_IMAGE:-public.ecr.aws/q9t5s3a7/vllm-cpu-")
    assert "deploy" not in vllm_cpu and "VLLM_CPU_KVCACHE_SPACE" in vllm_cpu["environment"]

    # Every bind-mounted file or folder exists.
    for service in services.values():
        for source in bind_mounts(service).values():
            assert source.exists(), source


def networks_of(service: dict[str, Any]) -> set[str]:
    """The networks a compose service joins (a list or a mapping; none given: `default`)."""
    return set(service.get("networks", ["default"]))


def test_only_envoy_can_reach_the_sidecars_grpc_port() -> None:
    """The gRPC port is not published on the host, and the services on a network with the
    sidecar are Envoy and Redis, which shares only the sidecar's `pool` network and opens no
    connections of its own (no replication): the backends (model code) cannot open ext_proc
    streams."""
    services = compose()["services"]
    extproc = services["extproc"]
    (_, grpc_port) = flag(extproc["command"], "--listen").rsplit(":", 1)
    published = [interpolate(p).split(":") for p in extproc.get("ports", [])]
    assert all(container != grpc_port for *_, container in published), published
    assert all(host == "127.0.0.1" for host, *_ in published), published
    assert "expose" not in extproc
    shares = {
        name
        for name, service in services.items()
        if name != "extproc" and networks_of(service) & networks_of(extproc)
    }
    assert shares == {"envoy", "redis"}, shares
    assert networks_of(services["redis"]) & networks_of(services["envoy"]) == set()
    assert "--replicaof" not in services["redis"]["command"]
    assert set(compose()["networks"]) >= networks_of(extproc) | networks_of(services["envoy"])


def policy_redis() -> urllib.parse.SplitResult:
    policy = load_policy(DEPLOY / "compose" / "policy.yaml")
    assert policy.pool is not None and policy.pool.shared is not None
    return urllib.parse.urlsplit(policy.pool.shared.redis)


def test_compose_policy_leases_its_pool_from_the_redis_service() -> None:
    """The policy's Redis is the `redis` service, on the port it listens on; it keeps nothing
    on disk (leases are worth nothing after a restart), and the sidecar starts once it
    answers."""
    services = compose()["services"]
    url = policy_redis()
    assert url.scheme == "redis" and url.hostname == "redis" and url.hostname in services
    r = services["redis"]
    command = r["command"]
    assert command[0] == "redis-server"
    assert (url.port or 6379) == int(flag(command, "--port") if "--port" in command else 6379)
    assert flag(command, "--save") == "" and flag(command, "--appendonly") == "no"
    assert r["image"].startswith("redis:")
    assert "redis-cli" in r["healthcheck"]["test"]
    assert services["extproc"]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_only_the_sidecar_can_reach_redis() -> None:
    """Redis has no password, and whoever reaches it can grant itself the pool: it publishes
    no port, and the only service on a network with it is the sidecar, on a network with no
    way out."""
    services, networks = compose()["services"], compose()["networks"]
    r = services["redis"]
    assert "ports" not in r
    shares = {
        name
        for name, service in services.items()
        if name != "redis" and networks_of(service) & networks_of(r)
    }
    assert shares == {"extproc"}, shares
    for net in networks_of(r):
        assert (networks[net] or {}).get("internal") is True, net


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


@pytest.mark.docker
@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_compose_cli_accepts_the_file(profile: str) -> None:
    how = "apt-get install docker-compose, or Docker's compose plugin; no daemon is needed"
    cli = optional_tool(
        "docker", compose_cli(), "a compose CLI (docker compose, docker-compose)", how
    )
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

    async def fake_serve(args: Any, *resolved: Any) -> None:
        seen["grace"] = args.grace

    monkeypatch.setattr(extproc.cli, "_serve", fake_serve)
    monkeypatch.setattr(extproc.cli, "configure_logging", lambda *a, **k: None)
    assert extproc.cli.main(["serve"]) == 0
    period = compose()["services"]["extproc"]["stop_grace_period"]
    assert re.fullmatch(r"\d+s", period) and int(period[:-1]) > seen["grace"]


def shared_view(metrics_port: int) -> dict[str, Any]:
    """The sidecar's shared pool as /debug/queues shows it."""
    url = f"http://127.0.0.1:{metrics_port}/debug/queues"
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())["/pool"]["shared"]  # type: ignore[no-any-return]


@pytest.mark.envoy
@pytest.mark.redis
def test_compose_envoy_config_serves_through_the_sidecar(tmp_path: Path) -> None:
    """deploy/compose/envoy.yaml run for real, as compose would run it but on this machine:
    its clusters keep STRICT_DNS and resolve a name (`localhost` standing in for the compose
    service names), the sidecar runs the compose policy with its Redis URL pointed at a real
    redis-server, testing/backend.py is the backend. The request is admitted on a lease from
    that Redis, with the sidecar never degraded."""
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
        set_endpoint_host(c, "localhost")
    (tmp_path / "envoy.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    redis_server = RedisServer(tmp_path).start()
    policy_text = (DEPLOY / "compose" / "policy.yaml").read_text()
    compose_url = policy_redis().geturl()
    assert policy_text.count(compose_url) == 1
    (tmp_path / "policy.yaml").write_text(policy_text.replace(compose_url, redis_server.url))
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
                f"--policy={tmp_path / 'policy.yaml'}",
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
        wait_http(f"http://127.0.0.1:{ports['metrics']}/metrics", proc=procs[1])
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 99999})
        req = urllib.request.Request(
            f"http://127.0.0.1:{ports['listener']}/v1/chat/completions",
            data=body.encode(),
            headers={"content-type": "application/json"},
            method="POST",
        )

        def answer() -> dict[str, Any] | None:
            """The backend's echo, or None while Envoy answers 503 (STRICT_DNS resolves
            asynchronously after start). A pool that starts on an empty Redis grants its first
            slot one lease (10 s here) after it starts (the fence, docs/scaling.md)."""
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    assert r.status == 200
                    assert r.headers["x-llm-max-tokens"] == "1024"  # clamped by the policy
                    return json.loads(r.read())["echo"]  # type: ignore[no-any-return]
            except urllib.error.HTTPError as e:
                if e.code != 503:
                    raise
                return None

        echo = until(answer, "Envoy resolved the backend's name (no more 503)", every=0.2)
        assert json.loads(echo["body"])["max_tokens"] == 1024
        assert echo["headers"]["x-llm-bucket"] == "batch"
        # Admitted on a lease: in shared mode the local limit is the leases held, none at start.
        # The one sidecar of an adaptive pool leads it (the first renewal elects it).
        shared = until(
            lambda: v if (v := shared_view(ports["metrics"]))["is_leader"] else None,
            "the sidecar leads the pool",
        )
        assert shared["state"] == "shared" and shared["degraded_transitions"] == 0, shared
        assert shared["replicas"] == 1 and shared["last_error"] is None, shared
        client = redis.Redis.from_url(redis_server.url)
        try:
            assert client.zscore(Keys.for_prefix(shared["key_prefix"]).replicas, shared["replica"])
        finally:
            client.close()
    finally:
        for proc in reversed(procs):
            proc.stop()
        redis_server.stop()


def test_compose_policy_loads_and_fits_the_compose_envoy_config() -> None:
    cfg = compose_envoy()
    filters = [f for f in hcm_config(cfg)["http_filters"] if f["name"] != ROUTER_FILTER]
    assert_policy_fits(
        load_policy(DEPLOY / "compose" / "policy.yaml"), filters, cluster_named(cfg, "llm_extproc")
    )


def test_compose_policy_reads_the_backends_metrics_through_envoy() -> None:
    """The sidecar shares no network with the backends, so the adaptive pool reads vLLM's
    /metrics through Envoy's listener, on the GET /metrics route (compose's only) that skips
    the sidecar and goes to `backend:8000` (vllm or sim)."""
    policy = load_policy(DEPLOY / "compose" / "policy.yaml")
    assert policy.pool is not None and policy.pool.adaptive is not None
    (url,) = policy.backend.metrics
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname == "envoy" and parts.path == "/metrics"
    assert "envoy" in compose()["services"]
    cfg = compose_envoy()
    (lst,) = cfg["static_resources"]["listeners"]
    assert parts.port == lst["address"]["socket_address"]["port_value"]
    (vhost,) = hcm_config(cfg)["route_config"]["virtual_hosts"]
    (route,) = [r for r in vhost["routes"] if r["match"].get("path") == "/metrics"]
    assert route["match"]["headers"] == [{"name": ":method", "string_match": {"exact": "GET"}}]
    assert route["route"]["cluster"] == "backend"
    assert route["typed_per_filter_config"][EXT_PROC_FILTER]["disabled"] is True
    assert endpoint_address(cluster_named(cfg, route["route"]["cluster"])) == ("backend", 8000)
