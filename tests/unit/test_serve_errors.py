"""``llm-extproc serve`` with a flag it cannot use: one line on stderr naming the flag and the
cause, exit status 2, no traceback, through the real CLI (a process each)."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from testing.grpc_aio import TRANSPORTS, serve_argv
from testing.harness import make_certs
from testing.stack import REPO, cli, free_port

pytestmark = pytest.mark.slow  # a CLI process per test

PREFIX = "llm-extproc serve: error: "


def serve_refuses(*flags: str, transport: str = "h2") -> str:
    """The one line ``serve`` writes for ``flags``, without its prefix: the product's CLI, or
    with ``transport="grpc"`` the tests' grpc.aio sidecar (``python -m testing.grpc_sidecar``)."""
    if transport == "h2":
        out = cli("serve", *flags, timeout=30)
    else:
        argv = [*serve_argv(transport), *flags]
        out = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=30)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stdout == ""
    (line,) = out.stderr.splitlines()
    assert line.startswith(PREFIX), line
    return line.removeprefix(PREFIX)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port of 127.0.0.1 that a listening socket holds."""
    port = free_port()
    with socket.create_server(("127.0.0.1", port)):
        yield port


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_busy_listen_port(busy_port: int, transport: str) -> None:
    flags = ("--listen", f"127.0.0.1:{busy_port}", "--metrics", "127.0.0.1:0")
    line = serve_refuses(*flags, transport=transport)
    assert line == f"--listen: cannot listen on 127.0.0.1:{busy_port}: Address already in use"


def test_a_busy_metrics_port(busy_port: int) -> None:
    line = serve_refuses("--listen", "127.0.0.1:0", "--metrics", f"127.0.0.1:{busy_port}")
    assert line == f"--metrics: cannot listen on 127.0.0.1:{busy_port}: Address already in use"


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            ("--listen", "50051"),
            "--listen: '50051' is not HOST:PORT or unix:PATH with a port from 0 to 65535",
        ),
        (
            ("--listen", "unix:"),
            "--listen: 'unix:' names no socket path",
        ),
        (
            ("--metrics", "127.0.0.1:http"),
            "--metrics: '127.0.0.1:http' is not HOST:PORT with a port from 0 to 65535",
        ),
        (
            ("--metrics", "127.0.0.1:70000"),
            "--metrics: '127.0.0.1:70000' is not HOST:PORT with a port from 0 to 65535",
        ),
        (
            ("--log-level", "LOUD"),
            "--log-level: unknown level 'LOUD' (debug, info, warning, error or critical)",
        ),
    ],
)
def test_a_malformed_address_or_log_level(flags: tuple[str, ...], expected: str) -> None:
    assert serve_refuses(*flags) == expected


def test_a_missing_policy_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    line = serve_refuses("--policy", str(path))
    assert line.startswith(f"--policy: {path}: cannot read: "), line
    assert "No such file or directory" in line


def test_a_policy_that_does_not_resolve(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("buckets: [\n")  # YAML's own error spans lines: still one line here
    line = serve_refuses("--policy", str(path))
    assert line.startswith(f"--policy: {path}: not valid YAML: "), line


def test_tls_files_that_are_missing_or_unreadable(certs: dict[str, Path], tmp_path: Path) -> None:
    cert, key = str(certs["server.pem"]), str(certs["server.key"])
    missing = str(tmp_path / "missing.pem")
    assert serve_refuses("--tls-cert", missing, "--tls-key", key) == (
        f"--tls-cert: cannot read {missing}: No such file or directory"
    )
    assert serve_refuses("--tls-cert", cert, "--tls-key", missing) == (
        f"--tls-key: cannot read {missing}: No such file or directory"
    )
    assert serve_refuses(
        "--tls-cert", cert, "--tls-key", key, "--tls-client-ca", str(tmp_path)
    ) == (f"--tls-client-ca: cannot read {tmp_path}: Is a directory")
    assert serve_refuses("--tls-cert", cert) == "--tls-key: required with --tls-cert"


def test_tls_files_that_hold_no_certificate(certs: dict[str, Path], tmp_path: Path) -> None:
    cert, key = str(certs["server.pem"]), str(certs["server.key"])
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    assert serve_refuses("--tls-cert", str(junk), "--tls-key", key).startswith(
        "--tls-cert/--tls-key: not a PEM certificate and its private key"
    )
    assert serve_refuses(
        "--tls-cert", cert, "--tls-key", key, "--tls-client-ca", str(junk)
    ).startswith("--tls-client-ca: no PEM CA certificate")
