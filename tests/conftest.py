"""Fixtures and hooks shared by the tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from testing.stack import Stack


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stack")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Print the stack's process logs when an end-to-end test fails."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.when == "call":
        stack = item.funcargs.get("stack") if hasattr(item, "funcargs") else None
        if isinstance(stack, Stack):
            sections = []
            for name, proc in stack.procs.items():
                sections.append(f"----- {name} -----\n{proc.log_text()[-4000:]}")
            report.sections.append(("stack logs", "\n".join(sections)))
