"""Helpers for the end-to-end tests (tier 3): real Envoy, real sidecar, test backend.

The readers (``scrape``, ``gauge``, ``outcomes``, ``debug_queues``, ``backend_stats``) say what
the sidecar and the backend hold now; the waits (``wait_gauge``, ``gauge_reaches``,
``wait_idle``) wait for them to hold something, bounded (``testing.wait``), so a test orders its
requests by what happened ("the holder has the slot", "two are queued") instead of by sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from testing.clients import Reply, chat, post
from testing.stack import REPO, Stack
from testing.wait import TIMEOUT_S, until, until_async

BACKEND = [sys.executable, str(REPO / "testing" / "backend.py"), "--port", "{port}"]


def scrape(stack: Stack) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The sidecar's metrics as {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(stack.metrics_url, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def gauge(stack: Stack, name: str, bucket: str) -> float:
    return scrape(stack).get((name, (("bucket", bucket),)), 0.0)


def outcomes(stack: Stack) -> dict[tuple[str, str], float]:
    """{(bucket, outcome): count} of finished requests (series still at zero left out)."""
    return {
        (dict(labels)["bucket"], dict(labels)["outcome"]): v
        for (name, labels), v in scrape(stack).items()
        if name == "llm_extproc_requests_total" and v
    }


def debug_queues(stack: Stack) -> dict[str, Any]:
    """The sidecar's ``/debug/queues``: every bucket's (and pool's, route share's) state."""
    url = stack.metrics_url.removesuffix("/metrics") + "/debug/queues"
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def backend_stats(stack: Stack) -> dict[str, int]:
    """The test backend's ``/stats``: requests running, finished, aborted, total."""
    with urllib.request.urlopen(stack.backend_url + "/stats", timeout=5) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def wait_gauge(
    stack: Stack, name: str, bucket: str, value: float, limit_s: float = TIMEOUT_S
) -> None:
    """Wait until the bucket's gauge ``name`` is ``value`` (``llm_extproc_in_flight`` 1: the
    holder was admitted; ``llm_extproc_queue_depth`` 2: two are queued)."""
    until(
        lambda: gauge(stack, name, bucket) == value,
        f"{name}{{bucket={bucket!r}}} == {value}",
        limit_s=limit_s,
    )


async def gauge_reaches(
    stack: Stack, name: str, bucket: str, value: float, limit_s: float = TIMEOUT_S
) -> None:
    """:func:`wait_gauge` for a coroutine: the scrapes run in a thread, the loop goes on."""
    await until_async(
        lambda: gauge(stack, name, bucket) == value,
        f"{name}{{bucket={bucket!r}}} == {value}",
        limit_s=limit_s,
        blocking=True,
    )


async def until_in_flight(stack: Stack, bucket: str, n: float) -> None:
    """Wait until ``n`` requests of ``bucket`` hold a slot (a holder is admitted)."""
    await gauge_reaches(stack, "llm_extproc_in_flight", bucket, n)


async def until_queued(stack: Stack, bucket: str, n: float) -> None:
    """Wait until ``n`` requests of ``bucket`` are queued."""
    await gauge_reaches(stack, "llm_extproc_queue_depth", bucket, n)


async def holder_and_queue(
    stack: Stack,
    session: Any,
    url: str,
    *,
    bucket: str,
    hold: dict[str, str],
    queue: int = 0,
    headers: dict[str, str] | None = None,
) -> tuple[asyncio.Future[Reply], list[asyncio.Future[Reply]]]:
    """A streamed request holding ``bucket``'s one slot (``hold``: the test backend's headers
    for how long), once it is admitted; then ``queue`` more, each queued before the next is
    sent. ``session`` is an ``aiohttp.ClientSession``."""
    headers = headers or {}
    holder = asyncio.ensure_future(post(session, url, chat(stream=True), {**headers, **hold}))
    await until_in_flight(stack, bucket, 1)
    waiting: list[asyncio.Future[Reply]] = []
    for i in range(1, queue + 1):
        waiting.append(asyncio.ensure_future(post(session, url, chat(), headers)))
        await until_queued(stack, bucket, i)
    return holder, waiting


def wait_idle(stack: Stack, timeout: float = TIMEOUT_S) -> None:
    """Wait until no bucket has anything in flight or queued; fail if that never happens."""
    busy: dict[str, float] = {}

    def idle() -> bool:
        busy.clear()
        for (name, labels), v in scrape(stack).items():
            if name in ("llm_extproc_in_flight", "llm_extproc_queue_depth") and v:
                busy[f"{name}{dict(labels)}"] = v
        return not busy

    try:
        until(idle, "the sidecar idle", limit_s=timeout)
    except AssertionError:
        raise AssertionError(f"sidecar still busy after {timeout}s: {busy}") from None


def write_policy(tmp: Path, text: str) -> Path:
    path = tmp / "policy.yaml"
    path.write_text(text)
    return path


def start_stack(tmp: Path, policy: str | None, **kwargs: object) -> Iterator[Stack]:
    tmp.mkdir(parents=True, exist_ok=True)
    stack = Stack(
        backend_argv=BACKEND,
        policy_path=write_policy(tmp, policy) if policy is not None else None,
        log_dir=tmp,
        **kwargs,  # type: ignore[arg-type]
    )
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


# `with running_stack(tmp, policy) as stack:` for tests that need a stack of their own.
running_stack = contextlib.contextmanager(start_stack)


def make_certs(directory: Path) -> dict[str, Path]:
    """A throwaway CA, a server certificate for the sidecar (SAN llm-extproc, 127.0.0.1) and a
    client certificate for Envoy, made with the openssl command line."""
    import subprocess

    directory.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(
            ["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=60
        )

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=llm-extproc test CA",
    )
    for name, san in (("server", "DNS:llm-extproc,IP:127.0.0.1"), ("client", "DNS:envoy")):
        (directory / f"{name}.ext").write_text(f"subjectAltName={san}\n")
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            "-extfile",
            f"{name}.ext",
        )
    return {
        n: directory / n for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")
    }
