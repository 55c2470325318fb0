"""The metrics port's probes and the process's own metrics, on a sidecar started in-process:
``/healthz`` (alive), ``/readyz`` (serving, turned 503 when the stop begins, as the gRPC health
service turns NOT_SERVING), ``llm_extproc_build_info`` and the ``process_*`` collectors."""

from __future__ import annotations

import asyncio
import platform
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from extproc import version
from extproc.config.policy import policy_from_yaml
from extproc.pool.core.values import Entry
from extproc.pool.gate import Slot
from testing.grpc_aio import TRANSPORTS, sidecar_on
from testing.wait import until_async

POLICY = policy_from_yaml(
    "buckets: [{name: solo, max_concurrency: 1, queue_timeout: 5s, max_queue: 4}]"
)


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


async def fetch(port: int, path: str) -> tuple[int, str]:
    return await asyncio.to_thread(get, port, path)


async def grpc_health(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
        return int(reply.status)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_readyz_follows_the_grpc_health_service_and_healthz_stays_up(transport: str) -> None:
    """Ready once started; from the first moment of a graceful stop (a request still holds
    its slot, so the stop waits) /readyz says 503 and gRPC health NOT_SERVING, while /healthz
    still answers 200; the stop then ends when the slot is released."""
    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )

    async def main() -> None:
        sidecar = sidecar_on(transport)(POLICY, listen="127.0.0.1:0", metrics_listen="127.0.0.1:0")
        assert not sidecar.ready()
        await sidecar.start()
        stopping: asyncio.Task[None] | None = None
        try:
            assert sidecar.grpc_port is not None and sidecar.metrics_port is not None
            port, grpc_port = sidecar.metrics_port, sidecar.grpc_port
            assert await fetch(port, "/healthz") == (200, "ok\n")
            assert await fetch(port, "/readyz") == (200, "ready\n")
            assert await grpc_health(grpc_port) == serving
            assert sidecar.gate is not None
            slot = sidecar.gate.enter(Entry(bucket="solo", timeout_s=5.0))
            assert isinstance(slot, Slot)
            stopping = asyncio.create_task(sidecar.stop(grace=30))
            await until_async(
                lambda: get(port, "/readyz")[0] == 503, "/readyz answers 503", blocking=True
            )
            assert await fetch(port, "/readyz") == (503, "not ready\n")
            assert await grpc_health(grpc_port) == not_serving
            assert await fetch(port, "/healthz") == (200, "ok\n")
            assert not stopping.done()  # still draining: the slot is held
            slot.release()
            await asyncio.wait_for(stopping, 10)
        finally:
            if stopping is None:
                await sidecar.stop(0)

    asyncio.run(main())


def test_build_info_and_process_metrics_on_each_sidecars_own_registry() -> None:
    """Two sidecars side by side: each registry holds its own process collectors (a second
    registration in one registry would raise) and says what runs."""

    async def main() -> None:
        sidecars = [
            sidecar_on(t)(POLICY, listen="127.0.0.1:0", metrics_listen="127.0.0.1:0")
            for t in TRANSPORTS
        ]
        for sidecar in sidecars:
            await sidecar.start()
        try:
            for sidecar, transport in zip(sidecars, TRANSPORTS, strict=True):
                assert sidecar.metrics_port is not None
                status, text = await fetch(sidecar.metrics_port, "/metrics")
                assert status == 200
                samples = {
                    s.name: s
                    for family in text_string_to_metric_families(text)
                    for s in family.samples
                }
                build = samples["llm_extproc_build_info"]
                assert build.value == 1
                assert build.labels == {
                    "version": version(),
                    "python": platform.python_version(),
                    "transport": transport,
                    "event_loop": "asyncio",  # asyncio.run
                }
                for name in (
                    "process_cpu_seconds_total",
                    "process_resident_memory_bytes",
                    "process_open_fds",
                    "python_info",
                    "python_gc_objects_collected_total",
                ):
                    assert name in samples, name
                assert samples["process_resident_memory_bytes"].value > 0
        finally:
            for sidecar in sidecars:
                await sidecar.stop(0)

    asyncio.run(main())
