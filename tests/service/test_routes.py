"""Tier 2: route metadata changes nothing beyond the requests that carry it.

A gRPC peer (Envoy, or anyone who reaches the port) sends route metadata on each
request_headers message. It used to set its bucket's limits for the whole process, and they
stayed after the sender left; now a route's ``max_concurrency``/``max_queue`` are the limits of
that route's own share of the bucket, and the share goes once the route is gone.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2, text_format

from extproc.app import Sidecar
from extproc.config.policy import policy_from_yaml
from testing.grpc_aio import TRANSPORTS, sidecar_on
from testing.wait import until_async

POLICY = policy_from_yaml(
    """
buckets:
  - {name: b, max_concurrency: 3, queue_timeout: 2s, max_queue: 5}
"""
)
CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()


def headers_msg(route: dict[str, Any] | None = None) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[
                    base_pb2.HeaderValue(key=k, raw_value=v.encode())
                    for k, v in ((":path", "/v1/chat/completions"), (":method", "POST"))
                ]
            )
        )
    )
    if route is not None:
        md = base_pb2.Metadata()
        md.filter_metadata["llm_extproc"].update(route)
        attrs = struct_pb2.Struct()
        attrs.update({"xds.route_metadata": text_format.MessageToString(md)})
        msg.attributes["envoy.filters.http.ext_proc"].CopyFrom(attrs)
    return msg


class Exchange:
    def __init__(self, stub: pb_grpc.ExternalProcessorStub) -> None:
        self._queue: asyncio.Queue[pb.ProcessingRequest | None] = asyncio.Queue()

        async def requests() -> AsyncIterator[pb.ProcessingRequest]:
            while (item := await self._queue.get()) is not None:
                yield item

        self.call = stub.Process(requests())

    async def request(self, route: dict[str, Any] | None) -> pb.ProcessingResponse:
        """Headers, then the body: the answer to the body (or a refusal of it)."""
        await self._queue.put(headers_msg(route))
        assert (await self.call.read()).HasField("request_headers")
        await self._queue.put(
            pb.ProcessingRequest(request_body=pb.HttpBody(body=CHAT, end_of_stream=True))
        )
        return await self.next()

    async def next(self) -> pb.ProcessingResponse:
        resp = await self.call.read()
        assert resp is not grpc.aio.EOF
        return resp  # type: ignore[no-any-return]

    async def close(self) -> None:
        await self._queue.put(None)
        await self.call.read()


def bucket(sidecar: Sidecar) -> tuple[int, int, int]:
    assert sidecar.gate is not None
    s = sidecar.gate.statistics()["b"]
    return s.capacity, s.in_flight, s.queued


def run(test: Callable[[Sidecar, pb_grpc.ExternalProcessorStub], Awaitable[None]], t: str) -> None:
    async def main() -> None:
        sidecar = sidecar_on(t)(POLICY, listen="127.0.0.1:0", metrics_listen=None)
        await sidecar.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as ch:
                await asyncio.wait_for(test(sidecar, pb_grpc.ExternalProcessorStub(ch)), 10)
        finally:
            await sidecar.stop(0)

    asyncio.run(main())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_route_limits_are_the_routes_own_share_and_go_with_the_route(transport: str) -> None:
    hostile = {"bucket": "b", "max_concurrency": 1, "max_queue": 0}

    async def t(sidecar: Sidecar, stub: pb_grpc.ExternalProcessorStub) -> None:
        first = Exchange(stub)
        assert (await first.request(hostile)).HasField("request_body")  # admitted: 1 of 1
        second = Exchange(stub)
        refused = (await second.request(hostile)).immediate_response
        assert refused.status.code == 429  # the route's share is full, its queue 0 long
        assert json.loads(refused.body)["error"]["code"] == "queue_full"
        # The bucket itself is untouched: 3 slots, and other requests get the 2 left at once.
        assert bucket(sidecar) == (3, 1, 0)
        others = [Exchange(stub) for _ in range(2)]
        for ex in others:
            assert (await ex.request(None)).HasField("request_body")
        assert bucket(sidecar) == (3, 3, 0)
        assert sidecar.service is not None
        assert list(sidecar.service.route_shares().values()) == [
            {"capacity": 1, "in_flight": 1, "queued": 0}
        ]
        for ex in (first, second, *others):
            await ex.close()
        await until_async(lambda: bucket(sidecar) == (3, 0, 0), "every slot given back", limit_s=5)
        # A policy reload forgets every route: the share, holding nothing, goes at once.
        sidecar.service.apply_policy(POLICY)
        assert sidecar.service.route_shares() == {}

    run(t, transport)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_share_whose_route_is_gone_drains_then_goes(transport: str) -> None:
    share = {"bucket": "b", "max_concurrency": 1}

    async def t(sidecar: Sidecar, stub: pb_grpc.ExternalProcessorStub) -> None:
        assert sidecar.service is not None
        holder = Exchange(stub)
        assert (await holder.request(share)).HasField("request_body")
        waiter = Exchange(stub)
        await waiter._queue.put(headers_msg(share))
        await waiter.next()
        await waiter._queue.put(
            pb.ProcessingRequest(request_body=pb.HttpBody(body=CHAT, end_of_stream=True))
        )
        assert (await waiter.next()).HasField("override_message_timeout")  # queued
        sidecar.service.apply_policy(POLICY)  # the route is gone, its share still busy
        assert list(sidecar.service.route_shares().values()) == [
            {"capacity": 1, "in_flight": 1, "queued": 1}
        ]
        await holder.close()
        assert (await waiter.next()).HasField("request_body")  # the share hands over
        await waiter.close()
        service = sidecar.service
        await until_async(
            lambda: service.route_shares() == {} and bucket(sidecar) == (3, 0, 0),
            "the share gone, every slot given back",
            limit_s=5,
        )

    run(t, transport)
