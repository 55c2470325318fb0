"""Start and stop the real pieces on 127.0.0.1: one or more backends, the sidecar, Envoy.

Used by the end-to-end tests, ``make demo`` and the benchmarks, so they all run the same way:
random free ports, start in order (backend, sidecar, Envoy), wait until each answers, keep each
process's output in a log file, print the logs when something fails, stop everything (SIGTERM,
then SIGKILL) so no process outlives its user. ``running_envoy`` runs Envoy alone, on a config
a test built (``testing.envoy`` builds them all).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from testing.envoy import (
    REPO,
    SHIPPED_ENVOY,
    envoy_binary,
    render_envoy_config,
    with_file_rds,
    with_upstream_tls,
)
from testing.grpc_aio import serve_argv

__all__ = [
    "REPO",
    "Proc",
    "Stack",
    "cli",
    "envoy_binary",
    "free_port",
    "render_envoy_config",
    "running_envoy",
    "wait_http",
    "wait_tcp",
]


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``llm-extproc ARGS`` run as a user runs it (``python -m extproc``), from the repository,
    to its end: the exit status, stdout and stderr as text."""
    return subprocess.run(
        [sys.executable, "-m", "extproc", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
        check=False,
    )


def _ephemeral_start() -> int:
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range is 32768-60999


_LOW_PORT = 10000
_handed_out: set[int] = set()


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on, for a server started later.

    Taken from below the kernel's ephemeral range: a port from ``bind(0)`` is an ephemeral one,
    and any outgoing connection in the meantime (Envoy dialing a sidecar that is not up yet) may
    take it as its source port, so the server's bind fails with EADDRINUSE (seen in CI on
    tests/e2e/test_failure.py::test_sidecar_comes_back). A port is handed out once per process.
    """
    top = _ephemeral_start()
    if top - _LOW_PORT < 1000:  # an unusual range: fall back to the kernel's choice
        return _bound_port(0)
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(_LOW_PORT, top)
        if port in _handed_out:
            continue
        with contextlib.suppress(OSError):
            _bound_port(port)
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free port found in {_LOW_PORT}-{top - 1} on 127.0.0.1")


def _bound_port(port: int) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))
        return int(s.getsockname()[1])


def wait_tcp(port: int, timeout: float = 15.0, proc: Proc | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None:
            proc.check_alive()
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def wait_http(url: str, timeout: float = 15.0, proc: Proc | None = None) -> None:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        if proc is not None:
            proc.check_alive()
        try:
            with urllib.request.urlopen(url, timeout=1.0) as r:
                if r.status == 200:
                    return
        except (OSError, urllib.error.URLError) as e:
            last = e
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer 200 within {timeout}s (last: {last})")


class Proc:
    """A child process with its output in a log file."""

    def __init__(
        self, name: str, argv: Sequence[str], log_dir: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
        )

    def check_alive(self) -> None:
        code = self.popen.poll()
        if code is not None:
            raise RuntimeError(f"{self.name} exited with {code}:\n{self.log_text()[-4000:]}")

    def log_text(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")
        return ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)

    def stop(self, timeout: float = 5.0) -> int | None:
        if self.popen.poll() is None:
            self.kill(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill(signal.SIGKILL)
                self.popen.wait(5)
        self._log.close()
        return self.popen.returncode


class Stack:
    """backend(s) + sidecar + Envoy on free ports. Use as a context manager.

    ``backend_argv`` is the backend command with ``{port}`` in place of its port.
    ``backends=N`` starts N replicas of it, each on its own port, all endpoints of Envoy's
    ``backend`` cluster; ``procs`` holds them as ``backend`` (the first, as with one),
    ``backend-1``, ``backend-2``, ... (their log files are named alike).
    ``start_envoy=False`` starts the backend (and the sidecar, if asked) only;
    ``ext_proc=False`` and ``backend_circuit_breakers`` are passed to
    :func:`render_envoy_config` (plain Envoy, breakers on the backend cluster).
    A port taken between picking it and Envoy binding it (another process's connection got it)
    is picked again: Envoy is started up to three times.
    ``running_backends``: ports of backends already running (another stack's, several gateways
    in front of one backend): the stack starts none and routes to those. ``sidecar_args``: more
    of the sidecar's ``serve`` flags.
    """

    def __init__(
        self,
        *,
        backend_argv: Sequence[str],
        backends: int = 1,
        policy_path: Path | None = None,
        envoy_concurrency: int = 1,
        failure_mode_allow: bool | None = None,
        start_sidecar: bool = True,
        access_log: bool = True,
        log_dir: Path | None = None,
        rds: bool = False,
        tls: Mapping[str, Path] | None = None,
        start_envoy: bool = True,
        ext_proc: bool = True,
        backend_circuit_breakers: Mapping[str, int] | None = None,
        transport: str | None = None,
        envoy_source: Path | None = None,
        envoy_patch: Callable[[dict[str, Any]], None] | None = None,
        running_backends: Sequence[int] | None = None,
        sidecar_args: Sequence[str] = (),
    ) -> None:
        if backends < 1:
            raise ValueError("backends must be >= 1")
        self.external_backends = running_backends is not None
        self.backend_argv = list(backend_argv)
        # Envoy's config: ``envoy_source`` (default envoy/envoy.yaml) with the stack's ports,
        # then ``envoy_patch`` applied to the parsed dict (a test's shorter timeouts, smaller
        # breakers).
        self.envoy_source = envoy_source
        self.envoy_patch = envoy_patch
        # The sidecar's transport (testing.grpc_aio.TRANSPORTS; None: the product's, h2).
        self.transport = transport
        self.sidecar_args = list(sidecar_args)  # more of the sidecar's flags (--grace 1)
        self.start_envoy = start_envoy
        self.ext_proc = ext_proc
        self.backend_circuit_breakers = backend_circuit_breakers
        self.policy_path = policy_path
        self.envoy_concurrency = envoy_concurrency
        self.failure_mode_allow = failure_mode_allow
        self.start_sidecar = start_sidecar
        self.access_log = access_log
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="llm-extproc-"))
        self.backend_ports = (
            list(running_backends)
            if running_backends is not None
            else [free_port() for _ in range(backends)]
        )
        self.backend_port = self.backend_ports[0]
        self.extproc_port = free_port()
        self.metrics_port = free_port()
        self.listener_port = free_port()
        self.admin_port = free_port()
        self.procs: dict[str, Proc] = {}
        # Routes from a watched file (file-based RDS) instead of static routes.
        self.rds = rds
        # Mutual TLS between Envoy and the sidecar: PEM files ca.pem, server.pem/key (the
        # sidecar's), client.pem/key (Envoy's).
        self.tls = tls

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener_port}"

    @property
    def backend_url(self) -> str:
        """The first backend's URL."""
        return f"http://127.0.0.1:{self.backend_port}"

    @property
    def backend_urls(self) -> list[str]:
        """Every backend's URL, in ``backend_ports`` order."""
        return [f"http://127.0.0.1:{port}" for port in self.backend_ports]

    @property
    def backend_names(self) -> list[str]:
        """The ``procs`` keys of the backends, in ``backend_ports`` order."""
        return ["backend"] + [f"backend-{i}" for i in range(1, len(self.backend_ports))]

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def routes_path(self) -> Path:
        return self.log_dir / "routes" / "routes.yaml"

    def write_routes(self, routes: dict[str, Any] | str) -> None:
        """Replace the RDS routes file atomically (temp file in the watched dir, then rename)."""
        text = routes if isinstance(routes, str) else yaml.safe_dump(routes, sort_keys=False)
        tmp = self.routes_path.with_name(".routes.tmp")
        tmp.write_text(text)
        tmp.replace(self.routes_path)

    @property
    def access_log_path(self) -> Path:
        return self.log_dir / "access.log"

    def start(self) -> Stack:
        try:
            # All replicas start at once, then each is waited for.
            for name, port in zip(self.backend_names, self.backend_ports, strict=True):
                if self.external_backends:
                    break
                argv = [a.replace("{port}", str(port)) for a in self.backend_argv]
                self.procs[name] = Proc(name, argv, self.log_dir)
            for name, url in zip(self.backend_names, self.backend_urls, strict=True):
                wait_http(f"{url}/health", proc=self.procs.get(name))
            if self.start_sidecar:
                self.start_sidecar_proc()
            if not self.start_envoy:
                return self
            for attempt in range(3):
                try:
                    self._start_envoy()
                    break
                except RuntimeError as e:
                    if "Address already in use" not in str(e) or attempt == 2:
                        raise
                    self.listener_port, self.admin_port = free_port(), free_port()
        except BaseException:
            self.dump_logs()
            self.stop()
            raise
        return self

    def _start_envoy(self) -> None:
        cfg = self.log_dir / "envoy.yaml"
        text = render_envoy_config(
            listener_port=self.listener_port,
            backend_ports=self.backend_ports,
            extproc_port=self.extproc_port,
            admin_port=self.admin_port,
            failure_mode_allow=self.failure_mode_allow,
            access_log=self.access_log_path if self.access_log else None,
            ext_proc=self.ext_proc,
            backend_circuit_breakers=self.backend_circuit_breakers,
            source=SHIPPED_ENVOY if self.envoy_source is None else self.envoy_source,
        )
        if self.envoy_patch is not None:
            patched = yaml.safe_load(text)
            self.envoy_patch(patched)
            text = yaml.safe_dump(patched, sort_keys=False)
        if self.tls is not None:
            text = with_upstream_tls(text, self.tls)
        if self.rds:
            text, routes = with_file_rds(text, self.routes_path.parent)
            self.routes_path.parent.mkdir(exist_ok=True)
            self.write_routes(routes)
        cfg.write_text(text)
        envoy = self.procs["envoy"] = Proc(
            "envoy",
            [
                envoy_binary(),
                "-c",
                str(cfg),
                "--concurrency",
                str(self.envoy_concurrency),
                "--disable-hot-restart",
                "--log-level",
                "warning",
                # Access-log lines reach the file within 100 ms (default 10 s).
                "--file-flush-interval-msec",
                "100",
            ],
            self.log_dir,
        )
        wait_http(f"http://127.0.0.1:{self.admin_port}/ready", proc=envoy)

    def start_sidecar_proc(self) -> Proc:
        argv = [
            *serve_argv(self.transport or "h2"),
            "--listen",
            f"127.0.0.1:{self.extproc_port}",
            "--metrics",
            f"127.0.0.1:{self.metrics_port}",
        ]
        if self.policy_path is not None:
            argv += ["--policy", str(self.policy_path)]
        argv += self.sidecar_args
        if self.tls is not None:
            argv += [
                "--tls-cert",
                str(self.tls["server.pem"]),
                "--tls-key",
                str(self.tls["server.key"]),
                "--tls-client-ca",
                str(self.tls["ca.pem"]),
            ]
        sidecar = self.procs["sidecar"] = Proc("sidecar", argv, self.log_dir)
        wait_http(self.metrics_url, proc=sidecar)
        wait_tcp(self.extproc_port, proc=sidecar)
        return sidecar

    def stop(self) -> None:
        for name in ("envoy", "sidecar", *self.backend_names):
            proc = self.procs.get(name)
            if proc is not None:
                proc.stop()

    def dump_logs(self, tail: int = 6000) -> None:
        for name, proc in self.procs.items():
            text = proc.log_text()
            print(f"----- {name} log ({proc.log_path}) -----\n{text[-tail:]}", file=sys.stderr)

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self.dump_logs()
        self.stop()

    def envoy_stat(self, name: str) -> int:
        url = f"http://127.0.0.1:{self.admin_port}/stats?filter=^{name}$"
        with urllib.request.urlopen(url, timeout=5) as r:
            for line in r.read().decode().splitlines():
                key, _, value = line.partition(": ")
                if key == name:
                    return int(value)
        raise KeyError(name)


@contextlib.contextmanager
def running(**kwargs: Any) -> Iterator[Stack]:
    with Stack(**kwargs) as stack:
        yield stack


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
