"""grpc.health.v1 on the h2 transport: Check and Watch.

grpc.aio serves the same service with grpc_health's own servicer; this class offers the two
calls the sidecar makes of that servicer (``set``, ``enter_graceful_shutdown``), so
``extproc.app`` drives either the same way.

Bounds: a request is one message of at most the transport's ``max_message``; a watcher holds
one queue of status changes (only the sidecar changes a status, a handful of times in its
life) and its registry entry goes when its call ends, so what a peer can make this service
hold is bounded by the calls the transport lets it open. An open watch does not keep its
connection in place at ``max_connections`` (``keeps_connection=False``): otherwise 256
connections, each watching, would keep Envoy's connection out (issue 31).
"""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health_pb2

from extproc.transport import h2

__all__ = ["H2Health"]


class H2Health:
    """grpc.health.v1 for the h2 transport: Check and Watch, with the two calls the sidecar
    makes of grpc_health's servicer (``set``, ``enter_graceful_shutdown``)."""

    def __init__(self) -> None:
        self._status: dict[str, int] = {}
        self._watchers: dict[str, set[asyncio.Queue[int]]] = {}
        self._shutting_down = False

    async def set(self, service: str, status: int) -> None:
        if self._shutting_down:
            return
        self._set(service, status)

    def _set(self, service: str, status: int) -> None:
        self._status[service] = status
        for q in self._watchers.get(service, ()):
            q.put_nowait(status)

    async def enter_graceful_shutdown(self) -> None:
        self._shutting_down = True
        for service in self._status:
            self._set(service, health_pb2.HealthCheckResponse.NOT_SERVING)

    def methods(self) -> dict[str, h2.Method]:
        parse = health_pb2.HealthCheckRequest.FromString
        return {
            "/grpc.health.v1.Health/Check": h2.Method(self._check, parse, _serialize),
            # A watch stays open as long as its client likes, and Envoy never watches (its
            # health checks use Check): an open watch does not keep its connection from
            # being displaced at max_connections (docs/transport.md).
            "/grpc.health.v1.Health/Watch": h2.Method(
                self._watch, parse, _serialize, keeps_connection=False
            ),
        }

    async def _check(self, call: h2.Call) -> None:
        request = await call.read()
        if request is h2.EOF:
            return
        status = self._status.get(request.service)
        if status is None:
            raise h2.CallAbort(h2.StatusCode.NOT_FOUND, "unknown service")
        await call.write(health_pb2.HealthCheckResponse(status=status))

    async def _watch(self, call: h2.Call) -> None:
        request = await call.read()
        if request is h2.EOF:
            return
        q: asyncio.Queue[int] = asyncio.Queue()
        q.put_nowait(
            self._status.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
        )
        watchers = self._watchers.setdefault(request.service, set())
        watchers.add(q)
        try:
            while True:
                await call.write(health_pb2.HealthCheckResponse(status=await q.get()))
        finally:
            watchers.discard(q)
            if not watchers:
                # Any name may be watched: keep an entry only while someone watches it, so
                # the registry is bounded by the open calls (h2's max_streams).
                self._watchers.pop(request.service, None)


def _serialize(message: object) -> bytes:
    return message.SerializeToString()  # type: ignore[attr-defined,no-any-return]
