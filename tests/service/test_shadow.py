"""Tier 2: shadow mode gives a slot back exactly once, whatever ends the stream.

In shadow mode a request that would have queued is let through at once while a task keeps its
virtual place in the queue (``ExtProcService._shadow``). The servicer is driven here directly,
on a scripted stream whose messages are all there already: ``read`` never waits, so the stream
can end in the same turn of the loop as the shadow task is created, before that task has run.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc import stream
from extproc.config.policy import policy_from_yaml
from extproc.ops.metrics import Metrics
from extproc.pool.core.values import Entry
from extproc.pool.gate import Gate, Slot
from extproc.service import ExtProcService
from testing.wait import until_async

POLICY = policy_from_yaml(
    """
mode: shadow
buckets:
  - {name: b, max_concurrency: 1, queue_timeout: 5s, max_queue: 5}
"""
)
CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()


def request_messages() -> list[pb.ProcessingRequest]:
    headers = [(":path", "/v1/chat/completions"), (":method", "POST")]
    return [
        pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(
                headers=base_pb2.HeaderMap(
                    headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers]
                )
            )
        ),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=CHAT, end_of_stream=True)),
    ]


class Script:
    """A stream that has its messages already: ``read`` returns the next at once (no wait),
    then EOF, or waits for ``end`` when ``end`` is given (an event the test sets)."""

    def __init__(self, messages: list[pb.ProcessingRequest], end: asyncio.Event | None) -> None:
        self._messages = messages
        self._end = end
        self.sent: list[pb.ProcessingResponse] = []  # what the servicer answered

    async def read(self) -> Any:
        if self._messages:
            return self._messages.pop(0)
        if self._end is not None:
            await self._end.wait()
        return stream.EOF

    async def write(self, message: Any) -> None:
        if isinstance(message, bytes):  # answers are serialized ahead (``extproc.request.respond``)
            message = pb.ProcessingResponse.FromString(message)
        self.sent.append(message)


def bucket(gate: Gate) -> tuple[int, int]:
    s = gate.statistics()["b"]
    return s.in_flight, s.queued


async def other_tasks_done() -> None:
    """Let every task but this one finish (the shadow task, cancelled or not)."""
    others = asyncio.all_tasks() - {asyncio.current_task()}
    await asyncio.gather(*others, return_exceptions=True)


Ending = Callable[[Gate, Slot, asyncio.Event, "asyncio.Task[None]"], Awaitable[None]]


async def same_turn(gate: Gate, held: Slot, end: asyncio.Event, call: asyncio.Task[None]) -> None:
    """Nothing to do: the stream ended in the turn the shadow task was made."""


async def after_the_slot_was_handed_over(
    gate: Gate, held: Slot, end: asyncio.Event, call: asyncio.Task[None]
) -> None:
    await until_async(lambda: bucket(gate) == (1, 1), "the shadow request queued")
    held.release()  # the shadow request's virtual place is handed the slot ...
    await until_async(lambda: bucket(gate) == (1, 0), "the shadow task holds the slot")
    end.set()  # ... and then Envoy ends the stream


async def client_gone_while_queued(
    gate: Gate, held: Slot, end: asyncio.Event, call: asyncio.Task[None]
) -> None:
    await until_async(lambda: bucket(gate) == (1, 1), "the shadow request queued")
    call.cancel()  # the client left: the stream is cancelled


@pytest.mark.parametrize(
    "ending", [same_turn, after_the_slot_was_handed_over, client_gone_while_queued]
)
def test_a_shadow_place_in_the_queue_is_given_back_once_whatever_ends_the_stream(
    ending: Ending,
) -> None:
    async def main() -> None:
        gate = Gate(POLICY)
        metrics = Metrics(gate.statistics)
        service = ExtProcService(POLICY, gate, metrics)
        # The bucket's one slot: the shadow request would queue
        held = gate.enter(Entry(bucket="b", timeout_s=5.0))
        assert isinstance(held, Slot)
        end = asyncio.Event()
        script = Script(request_messages(), None if ending is same_turn else end)
        call = asyncio.ensure_future(service.Process(None, script))
        await ending(gate, held, end, call)
        await asyncio.gather(call, return_exceptions=True)
        await other_tasks_done()
        # Let through unchanged, at once, and counted once.
        assert script.sent[-1].HasField("request_body")
        finished = {
            s.labels["outcome"]: s.value
            for m in metrics.requests.collect()
            for s in m.samples
            if s.name.endswith("_total") and s.value
        }
        assert finished == {"admitted": 1.0}
        # Its virtual place is gone, and the slot it may have been handed went back.
        assert bucket(gate)[1] == 0
        held.release()
        assert bucket(gate) == (0, 0)
        # The slot is free for the next request: given back once, not kept by a task.
        nxt = gate.enter(Entry(bucket="b", timeout_s=5.0))
        assert isinstance(nxt, Slot) and bucket(gate) == (1, 0)
        nxt.release()
        await other_tasks_done()
        assert bucket(gate) == (0, 0)
        service.close()

    asyncio.run(main())
