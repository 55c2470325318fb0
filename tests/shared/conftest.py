"""A real redis-server per test (a missing binary fails, never skips)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from testing.redis import RedisServer


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path) as server:
        yield server
