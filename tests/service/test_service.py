"""Tier 2: the gRPC service in-process, over a real loopback gRPC channel (no Envoy).

These pin the exact messages we send Envoy; the end-to-end tests pin what Envoy does with them.
Every test runs on both transports (``h2``, the product's, and ``grpc``, the grpc.aio oracle of
``testing.grpc_aio``), with grpc-python's client, so the h2 transport is also checked against a
second gRPC implementation.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.app import Sidecar
from extproc.config.policy import policy_from_yaml
from testing.grpc_aio import TRANSPORTS, sidecar_on
from testing.wait import until_async

POLICY = policy_from_yaml(
    """
limits: {max_prompt_tokens: 100, default_max_tokens: 16, max_output_tokens: 32}
retry_after: {min: 1s, max: 9s, jitter: 0}
buckets:
  - {name: solo, max_concurrency: 1, queue_timeout: 300ms, max_queue: 1}
"""
)


def headers_msg(
    path: str = "/v1/chat/completions", method: str = "POST", eos: bool = False, **extra: str
) -> pb.ProcessingRequest:
    hs = [(":path", path), (":method", method), (":authority", "x"), *extra.items()]
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[
                    base_pb2.HeaderValue(key=k.replace("_", "-"), raw_value=v.encode())
                    for k, v in hs
                ]
            ),
            end_of_stream=eos,
        )
    )


def body_msg(body: bytes) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))


CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()

Test = Callable[[Sidecar, pb_grpc.ExternalProcessorStub], Awaitable[None]]

TRANSPORT = "h2"


@pytest.fixture(autouse=True, params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    global TRANSPORT
    TRANSPORT = request.param
    return TRANSPORT  # type: ignore[no-any-return]


def with_sidecar(test: Test) -> None:
    async def main() -> None:
        sidecar = sidecar_on(TRANSPORT)(POLICY, listen="127.0.0.1:0", metrics_listen="127.0.0.1:0")
        await sidecar.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as ch:
                await asyncio.wait_for(test(sidecar, pb_grpc.ExternalProcessorStub(ch)), 10)
        finally:
            await sidecar.stop(0)

    asyncio.run(main())


class Exchange:
    """One ext_proc stream driven by hand, the way Envoy drives it."""

    def __init__(self, stub: pb_grpc.ExternalProcessorStub) -> None:
        self._queue: asyncio.Queue[pb.ProcessingRequest | None] = asyncio.Queue()

        async def requests() -> AsyncIterator[pb.ProcessingRequest]:
            while (item := await self._queue.get()) is not None:
                yield item

        self.call = stub.Process(requests())

    async def send(self, msg: pb.ProcessingRequest) -> None:
        await self._queue.put(msg)

    async def recv(self) -> pb.ProcessingResponse:
        resp = await self.call.read()
        assert resp is not grpc.aio.EOF
        return resp  # type: ignore[no-any-return]

    async def close(self) -> None:
        await self._queue.put(None)
        assert await self.call.read() is grpc.aio.EOF


def set_headers(resp: pb.CommonResponse | pb.ImmediateResponse) -> dict[str, str]:
    mutation = resp.header_mutation if isinstance(resp, pb.CommonResponse) else resp.headers
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def stats(sidecar: Sidecar) -> tuple[int, int]:
    assert sidecar.gate is not None
    s = sidecar.gate.statistics()["solo"]
    return s.in_flight, s.queued


def finished(sidecar: Sidecar) -> dict[str, float]:
    assert sidecar.metrics is not None
    out = {}
    for metric in sidecar.metrics.requests.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and sample.value:
                out[sample.labels["outcome"]] = sample.value
    return out


def test_other_paths_pass_through_without_body_or_queue() -> None:
    async def t(sidecar: Sidecar, stub: pb_grpc.ExternalProcessorStub) -> None:
        ex = Exchange(stub)
        await ex.send(headers_msg("/v1/models", "GET"))
        resp = await ex.recv()
        assert resp.HasField("request_headers")
        assert not resp.request_headers.HasField("response")
        assert resp.mode_override.request_body_mode == processing_mode_pb2.ProcessingMode.NONE
        await ex.close()
        assert finished(sidecar) == {} and stats(sidecar) == (0, 0)

    with_sidecar(t)


def test_admitted_request_gets_rewritten_body_and_headers() -> None:
    async def t(sidecar: Sidecar, stub: pb_grpc.ExternalProcessorStub) -> None:
        ex = Exchange(stub)
        await ex.send(headers_msg(content_type="application/json"))
        resp = await ex.recv()
        assert resp == pb.ProcessingResponse(request_headers=pb.HeadersResponse())
        await ex.send(body_msg(CHAT))
        resp = await ex.recv()
        common = resp.request_body.response
        new_body = json.loads(common.body_mutation.body)
        assert new_body == {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
        assert set_headers(common) == {
            "x-llm-bucket": "solo",
            "x-llm-queue-ms": "0",
            "x-llm-prompt-tokens": "4",  # ceil(2 / 4) + 3 per message
            "x-llm-max-tokens": "16",
            "content-length": str(len(common.body_mutation.body)),
        }
        assert stats(sidecar) == (1, 0)  # held until the stream ends
        await ex.close()
        assert stats(sidecar) == (0, 0)
        assert finished(sidecar) == {"admitted": 1.0}

    with_sidecar(t)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_unchanged_body_is_not_mutated(path: str) -> None:
    body = {"max_tokens": 8, "prompt": "x", "messages": [{"role": "user", "content": "x"}]}

    async def t(sidecar: Sidecar, stub: pb_grpc.ExternalProcessorStub) -> None:
        ex = Exchange(stub)
        await ex.send(headers_msg(path))
        await ex.recv()
        await ex.send(body_msg(json.dumps(body).encode()))
        common = (await ex.recv()).request_body.response
        assert not common.HasField("body_mutation")
        assert "content-length" not in set_headers(common)
        assert set_headers(common)["x-llm-max-tokens"] == "8"
        await ex.close()

    with_sidecar(t)


@pytest.mark.parametrize(
    "headers,body,status,code",
    [
        ({}, b"{oops", 400, "invalid_json"),
        (
            {},
            json.dumps({"messages": [{"role": "user", "content": "x" * 1000}]}).encode(),
            413,
            "prompt_too_long",
        ),
        ({"content_encoding": "gzip"}, None, 415, "unsupported_content_encoding"),
        ({"content_type": "text/plain"}, None, 415, "unsupported_media_type"),
    ],
)
def test_bad_requests_get_immediate_json_errors(
    headers: dict[str, str], body: bytes | None, status: int, code: str
) -> None:
    async def t(sidecar: Sidecar, stub: pb_grpc.ExternalProcessorStub) -> None:
        ex = Exchange(stub)
        await ex.send(headers_msg(**headers))
        resp = await ex.recv()
        if body is not None:
            assert resp.HasField("request_headers")
            await ex.send(body_msg(body))
            resp = await ex.recv()
        imm = resp.immediate_response
        assert imm.status.code == status
        assert set_headers(imm) == {"content-type": "application/json"}
        assert json.loads(imm.body)["error"]["code"] == code
        await ex.close()
        assert stats(sidecar) == (0, 0)

    with_sidecar(t)


def test_headers_only_post_is_an_empty_body() -> None:
    async def t(sidecar: Sidecar, stub: pb_grpc.ExternalProcessorStub) -> None:
        ex = Exchange(stub)
        await ex.send(headers_msg(eos=True))
        imm = (await ex.recv()).immediate_response
        assert imm.status.code == 400 and json.loads(imm.body)["error"]["code"] == "empty_body"
        await ex.close()
        assert finished(sidecar) == {"rejected_invalid": 1.0}

    with_sidecar(t)


async def admitted(stub: pb_grpc.ExternalProcessorStub) -> Exchange:
    ex = Exchange(stub)
    await ex.send(headers_msg())
    await ex.recv()
    await ex.send(body_msg(CHAT))
    assert (await ex.recv()).request_body.response.header_mutation.set_headers
    return ex


def test_queued_request_extends_timeout_then_is_admitted_on_release() -> None:
    async def t(sidecar: Sidecar, stub: pb_grpc.ExternalProcessorStub) -> None:
        holder = await admitted(stub)
        ex = Exchange(stub)
        await ex.send(headers_msg())
        await ex.recv()
        await ex.send(body_msg(CHAT))
        resp = await ex.recv()
        # queue_timeout 300ms + 1s margin
        assert resp.override_message_timeout.ToMilliseconds() == 1300
        assert stats(sidecar) == (1, 1)
        await holder.close()
        resp = await ex.recv()
        assert set_headers(resp.request_body.response)["x-llm-bucket"] == "solo"
        assert stats(sidecar) == (1, 0)
        await ex.close()
        assert stats(sidecar) == (0, 0)

    with_sidecar(t)


def test_queue_timeout_and_queue_full_are_429_with_retry_after() -> None:
    async def t(sidecar: Sidecar, stub: pb_grpc.ExternalProcessorStub) -> None:
        holder = await admitted(stub)
        queued = Exchange(stub)
        await queued.send(headers_msg())
        await queued.recv()
        await queued.send(body_msg(CHAT))
        assert (await queued.recv()).HasField("override_message_timeout")

        full = Exchange(stub)
        await full.send(headers_msg())
        await full.recv()
        await full.send(body_msg(CHAT))
        imm = (await full.recv()).immediate_response
        assert imm.status.code == 429
        assert json.loads(imm.body)["error"]["code"] == "queue_full"
        h = set_headers(imm)
        assert h["content-type"] == "application/json"
        assert int(h["retry-after"]) >= 1 and int(h["retry-after-ms"]) >= 1000
        await full.close()

        imm = (await queued.recv()).immediate_response  # evicted by the timer at 300ms
        assert imm.status.code == 429
        err = json.loads(imm.body)["error"]
        assert (err["code"], err["type"]) == ("queue_timeout", "rate_limit_error")
        assert int(set_headers(imm)["retry-after"]) >= 1
        await queued.close()
        await holder.close()
        assert stats(sidecar) == (0, 0)
        assert finished(sidecar) == {
            "admitted": 1.0,
            "rejected_queue_full": 1.0,
            "evicted_timeout": 1.0,
        }

    with_sidecar(t)


def test_stream_ending_while_queued_leaves_the_queue_at_once() -> None:
    async def t(sidecar: Sidecar, stub: pb_grpc.ExternalProcessorStub) -> None:
        holder = await admitted(stub)
        for end in ("half-close", "cancel"):
            ex = Exchange(stub)
            await ex.send(headers_msg())
            await ex.recv()
            await ex.send(body_msg(CHAT))
            assert (await ex.recv()).HasField("override_message_timeout")
            assert stats(sidecar) == (1, 1)
            if end == "half-close":
                await ex.close()
            else:
                ex.call.cancel()
            await until_async(
                lambda: stats(sidecar) == (1, 0), f"the queue empty after {end}", limit_s=5
            )
        await holder.close()
        assert stats(sidecar) == (0, 0)
        assert finished(sidecar) == {"admitted": 1.0, "cancelled_while_queued": 2.0}

    with_sidecar(t)


def test_cancel_while_admitted_releases_the_slot() -> None:
    async def t(sidecar: Sidecar, stub: pb_grpc.ExternalProcessorStub) -> None:
        holder = await admitted(stub)
        holder.call.cancel()
        await until_async(lambda: stats(sidecar) == (0, 0), "the slot given back", limit_s=5)
        assert finished(sidecar) == {"admitted": 1.0}

    with_sidecar(t)


def test_health_and_metrics_endpoints() -> None:
    async def t(sidecar: Sidecar, stub: pb_grpc.ExternalProcessorStub) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for service in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
                resp = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
        holder = await admitted(stub)
        base = f"http://127.0.0.1:{sidecar.metrics_port}"

        def get(path: str) -> str:
            with urllib.request.urlopen(base + path, timeout=5) as r:
                return r.read().decode()  # type: ignore[no-any-return]

        text = await asyncio.to_thread(get, "/metrics")
        assert 'llm_extproc_in_flight{bucket="solo"} 1.0' in text
        assert 'llm_extproc_queue_depth{bucket="solo"} 0.0' in text
        assert 'llm_extproc_capacity{bucket="solo"} 1.0' in text
        queues = json.loads(await asyncio.to_thread(get, "/debug/queues"))
        assert queues["solo"]["in_flight"] == 1
        await holder.close()
        text = await asyncio.to_thread(get, "/metrics")
        assert 'llm_extproc_requests_total{bucket="solo",outcome="admitted"} 1.0' in text
        assert 'llm_extproc_in_flight{bucket="solo"} 0.0' in text

    with_sidecar(t)


def test_unix_socket_listener(tmp_path: Path) -> None:
    async def main() -> None:
        path = tmp_path / "extproc.sock"
        sidecar = sidecar_on(TRANSPORT)(POLICY, listen=f"unix:{path}", metrics_listen=None)
        await sidecar.start()
        try:
            async with grpc.aio.insecure_channel(f"unix:{path}") as ch:
                ex = Exchange(pb_grpc.ExternalProcessorStub(ch))
                await ex.send(headers_msg())
                assert (await ex.recv()).HasField("request_headers")
                await ex.send(body_msg(CHAT))
                assert (await ex.recv()).request_body.response.header_mutation.set_headers
                await ex.close()
        finally:
            await sidecar.stop(0)

    asyncio.run(asyncio.wait_for(main(), 10))


def test_health_unknown_service_and_watch() -> None:
    async def t(sidecar: Sidecar, stub: pb_grpc.ExternalProcessorStub) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await health.Check(health_pb2.HealthCheckRequest(service="nope"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
            first = await watch.read()
            assert first.status == health_pb2.HealthCheckResponse.SERVING
            await sidecar._transport.health.enter_graceful_shutdown()
            second = await watch.read()
            assert second.status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()

    with_sidecar(t)
