"""A throwaway ``redis-server`` on 127.0.0.1 for the shared pool's tests.

Debian's package (``/usr/bin/redis-server``), started on a free port with no persistence
(``--save '' --appendonly no``): a restart starts empty, like a Redis that lost its data.
``stop`` / ``start`` keep the port, so clients reconnect to the same address; ``kill`` is
SIGKILL. A missing binary raises: the tests that need Redis fail, never skip.
"""

from __future__ import annotations

import shutil
import signal
import socket
import time
from pathlib import Path

from testing.stack import Proc, free_port, wait_tcp

__all__ = ["RedisServer", "redis_binary"]


def redis_binary() -> str:
    path = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not Path(path).is_file():
        raise RuntimeError(
            "redis-server not found: apt-get install redis-server (.ci/run installs it)"
        )
    return path


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
        argv = [
            redis_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
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
