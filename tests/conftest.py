"""Fixtures and hooks shared by the tests: what each test needs, checked; the stack's logs.

**Markers** say what a test needs beyond Python (registered, with what each means, in
pyproject.toml, which runs pytest with ``--strict-markers``): ``envoy`` (the real Envoy binary),
``redis`` (a real redis-server), ``docker`` (a compose CLI), ``promtool``, ``kubectl`` (its
``kubectl kustomize``), ``vllm`` (the real engine, ``make vllm-env``), ``slow`` (seconds or more
of wall time).
``make test-fast`` runs what needs none of them. A test gets its markers

- by where it is: :data:`NEEDS_BY_PATH`, the longest prefix of its node id that is listed
  (a folder's tier, a file, one test); the listed markers are all it gets from here;
- by the fixtures it uses: :data:`NEEDS_BY_FIXTURE`;
- by hand, ``@pytest.mark.<name>`` in its file, where only some tests of a file need a tool.

**Checks.** Every test runs with ``$LLM_EXTPROC_TOOL_LOG`` naming a fresh file; finding Envoy,
redis-server, promtool, kubectl or a compose CLI appends the marker to it (``testing.tools``), in
this process or in one a test started. A test that started a tool its markers do not name fails
at teardown, so ``-m "not envoy"`` really runs no Envoy. A test marked ``envoy`` or ``redis``
never skips: both come with the test extra, and a skip there is turned into a failure.
``docker``, ``promtool`` and ``kubectl`` tests skip for a user without the tool (the reason names
it and how to get it) and fail instead under ``LLM_EXTPROC_REQUIRE_TOOLS=1`` (``.ci/run``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Generator
from pathlib import Path

import pytest

from testing.stack import Stack
from testing.tools import OPTIONAL_SKIP, REQUIRE_TOOLS, TOOL_LOG, started

REQUIRED = frozenset({"envoy", "redis"})
OPTIONAL = frozenset({"docker", "promtool", "kubectl", "vllm"})
NEEDS = REQUIRED | OPTIONAL | {"slow"}  # the markers pyproject.toml registers

# Node-id prefix -> everything these tests need: a folder of one tier, a file whose tests all
# need the same, or one test (a mark in its file would do as well). The longest listed prefix
# wins: a test in a file with an entry of its own gets nothing from its folder's.
NEEDS_BY_PATH: dict[str, tuple[str, ...]] = {
    "tests/e2e/": ("envoy",),
    "tests/vllm/": ("vllm", "envoy", "slow"),  # the real engine, Envoy and the sidecar
    "tests/e2e/test_grpc_aio_path.py": ("slow",),  # the sidecar process alone, no Envoy
    "tests/e2e/test_demo.py": ("envoy", "slow"),
    "tests/e2e/test_slow_clients.py": ("envoy", "slow"),
    "tests/bench/test_compare.py::test_compare_end_to_end_small": ("envoy", "slow"),
    "tests/bench/test_compare.py::test_envoy_configs_load_in_the_real_envoy": ("envoy",),
    "tests/bench/test_compare.py::test_compare_halve_small": ("envoy", "slow"),
    "tests/bench/test_compare_replicas.py::test_replicas_end_to_end": ("envoy", "redis", "slow"),
    "tests/bench/test_sim_replicas.py": ("envoy",),
    "tests/deploy/test_render.py::test_envoy_accepts_the_shipped_configs": ("envoy",),
    "tests/deploy/test_render.py::test_rds_variant_starts_with_its_routes_file": ("envoy",),
    "tests/deploy/test_render.py::test_check_command_exits_1": ("slow",),  # CLI processes
    "tests/deploy/test_render.py::test_render_envoy_command": ("slow",),
    "tests/unit/test_policy.py::test_check_command": ("slow",),
    "tests/service/test_h2_fuzz.py::test_h2_answers_as_grpc_aio_does": ("slow",),
    "tests/service/test_h2_hostile.py::test_header_cache_is_bounded_in_bytes": ("slow",),
    "tests/service/test_h2_hostile.py::test_header_floods_cost_little[huffman]": ("slow",),
}
# Fixture name -> what a test using it needs.
NEEDS_BY_FIXTURE: dict[str, tuple[str, ...]] = {
    "redis_server": ("redis",),  # tests/shared/conftest.py: a real redis-server per test
    "cap": ("slow",),  # tests/bench/test_compare.py: the capacity model, seconds of simulation
}


def _by_path(nodeid: str) -> tuple[str, ...]:
    matches = [prefix for prefix in NEEDS_BY_PATH if nodeid.startswith(prefix)]
    return NEEDS_BY_PATH[max(matches, key=len)] if matches else ()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        needs = set(_by_path(item.nodeid))
        for fixture in getattr(item, "fixturenames", ()):
            needs.update(NEEDS_BY_FIXTURE.get(fixture, ()))
        for name in sorted(needs - {m.name for m in item.iter_markers()}):
            item.add_marker(name)


def needs(item: pytest.Item) -> set[str]:
    """The markers of ``item`` that name a need."""
    return {m.name for m in item.iter_markers() if m.name in NEEDS}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None]:
    """Each test with a fresh tool log, named in the environment its processes inherit."""
    path = Path(tempfile.gettempdir()) / f"llm-extproc-tool-log-{os.getpid()}"
    path.unlink(missing_ok=True)
    previous = os.environ.get(TOOL_LOG)
    os.environ[TOOL_LOG] = str(path)
    try:
        return (yield)
    finally:
        if previous is None:
            os.environ.pop(TOOL_LOG, None)
        else:
            os.environ[TOOL_LOG] = previous


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None]:
    """Fail a test that started a tool without its marker (after its own teardown ran)."""
    result = yield
    unmarked = started(os.environ.get(TOOL_LOG, "")) - needs(item)
    if unmarked:
        names = ", ".join(f"@pytest.mark.{m}" for m in sorted(unmarked))
        pytest.fail(
            f"{item.nodeid} started {', '.join(sorted(unmarked))} without {names}: "
            "add the marker (by hand, or in tests/conftest.py's NEEDS_BY_PATH)",
            pytrace=False,
        )
    return result  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stack")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Skips that must not happen become failures; failed end-to-end tests get the logs of
    their stack's processes."""
    report = yield
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        must_run = needs(item) & (REQUIRED | (OPTIONAL if os.environ.get(REQUIRE_TOOLS) else set()))
        # A test that needs Envoy and an optional tool (the vLLM tier) may skip for the optional
        # tool alone: testing.tools.optional_tool's reason says so.
        if needs(item) & OPTIONAL and OPTIONAL_SKIP in str(reason):
            must_run -= REQUIRED
        if must_run:
            report.outcome = "failed"
            report.longrepr = (
                f"{item.nodeid} needs {', '.join(sorted(must_run))}, which must not be skipped "
                f"(skipped: {reason})"
            )
    if report.failed and call.when == "call":
        stack = item.funcargs.get("stack") if hasattr(item, "funcargs") else None
        if isinstance(stack, Stack):
            sections = []
            for name, proc in stack.procs.items():
                sections.append(f"----- {name} -----\n{proc.log_text()[-4000:]}")
            report.sections.append(("stack logs", "\n".join(sections)))
    return report
