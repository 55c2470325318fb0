"""Tier 3: idle strangers on the sidecar's gRPC port cannot keep Envoy out.

300 connections complete the HTTP/2 handshake with the sidecar (preface, SETTINGS, SETTINGS
ACK) and then say nothing, more than its 256 places. A real Envoy started after them gets its
requests through: its connection displaces the oldest stranger (GOAWAY NO_ERROR), and only
strangers are closed. Before, the sidecar kept the first 256 and closed Envoy's connection at
once, and Envoy answered 500 for as long as the strangers stayed (``idle_timeout``, 10 min).
How fast Envoy's first request is answered: ``bench.bounds``, group ``lockout``.

The same with 256 connections that each hold one call Envoy would not make (issue 31): ext_proc's
``Process`` opened with no message, or a health ``Watch``. Each connection then had an open
call, none gave way, and Envoy was refused again; now only a call whose first message arrived
(a watch never) keeps its connection in place.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import yaml

from testing.clients import Reply, chat, post
from testing.envoy import render_envoy_config
from testing.harness import running_stack
from testing.stack import Stack, free_port, running_envoy
from tests.service.h2_peer import displaced, stranger, told_nothing
from tests.service.test_h2_silent_calls import hold_a_call

POLICY = "buckets: [{name: all, max_concurrency: 4, queue_timeout: 2s, max_queue: 10}]"
STRANGERS = 300
PLACES = 256  # the sidecar's max_connections


def test_envoy_started_after_idle_strangers_gets_through(tmp_path: Path) -> None:
    with running_stack(tmp_path / "stack", POLICY, start_envoy=False) as stack:
        strangers = [stranger(stack.extproc_port) for _ in range(STRANGERS)]
        try:
            replies = envoy_started_now(stack, tmp_path)
            assert [r.status for r in replies] == [200] * 3
            assert all(r.echo["headers"]["x-llm-bucket"] == "all" for r in replies)
            # The oldest 44 made room for the newest strangers, and Envoy's connection took the
            # place of the oldest left: only strangers were closed, oldest first.
            gone = STRANGERS - PLACES + 1
            assert all(displaced(p) for p in strangers[:gone])
            assert told_nothing(strangers[gone + 2 :])  # Envoy may have opened one more
        finally:
            for p in strangers:
                p.close()


def envoy_started_now(stack: Stack, tmp_path: Path) -> list[Reply]:
    """A real Envoy started only now in front of ``stack``'s sidecar: its replies to three
    requests (``requests``)."""
    listener = free_port()
    text = render_envoy_config(
        listener_port=listener,
        backend_port=stack.backend_port,
        extproc_port=stack.extproc_port,
        admin_port=free_port(),
    )
    with running_envoy(yaml.safe_load(text), tmp_path, listener):
        return asyncio.run(requests(f"http://127.0.0.1:{listener}"))


@pytest.mark.parametrize("how", ["process", "watch"])
def test_envoy_started_after_calls_that_are_not_its_own_gets_through(
    tmp_path: Path, how: str
) -> None:
    with running_stack(tmp_path / "stack", POLICY, start_envoy=False) as stack:
        holders = [hold_a_call(stack.extproc_port, how) for _ in range(PLACES)]
        try:
            replies = envoy_started_now(stack, tmp_path)
            assert [r.status for r in replies] == [200] * 3
            # Envoy's connection took the place of the oldest holder (Envoy may have opened
            # one more): only holders were closed.
            assert displaced(holders[0])
            if how == "process":
                assert told_nothing(holders[3:])
        finally:
            for p in holders:
                p.close()


async def requests(url: str) -> list[Reply]:
    async with aiohttp.ClientSession() as s:
        return [await post(s, url + "/v1/chat/completions", chat()) for _ in range(3)]
