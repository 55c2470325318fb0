"""requirements.lock and pyproject.toml agree, and the environment the tests run in is the lock's.

The lock (`make lock`) names one version of every package the development environment
installs; `make test` and `make demo` install with it as pip constraints. It goes stale when
pyproject.toml changes without `make lock`: a new requirement the lock does not name (pip would
take the newest release that day), a range the locked version no longer meets, or a package
the lock still carries that nothing requires any more. Each is a failure here, naming the
package and the fix. The last test checks that the installed versions are the locked ones, so
a run on some other environment cannot pass for a run on the lock.
"""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
# What pip and the build need beside the packages themselves: in the lock, required by nobody.
BUILD_TOOLS = frozenset({"setuptools", "wheel"})
FIX = "run `make lock` and commit requirements.lock"


def locked() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for raw in (REPO / "requirements.lock").read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and version, f"requirements.lock: {line!r} is not NAME==VERSION"
        pins[canonicalize_name(name)] = Version(version)
    return pins


def project_requirements() -> list[tuple[Requirement, str]]:
    """Every requirement of pyproject.toml that applies here, with the extra it comes from
    (empty for the package's own dependencies); every extra is part of the lock."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    out = [(Requirement(r), "") for r in project["dependencies"]]
    for extra, reqs in project["optional-dependencies"].items():
        out += [(Requirement(r), extra) for r in reqs]
    return [(r, e) for r, e in out if r.marker is None or r.marker.evaluate({"extra": e})]


def closure(roots: list[Requirement]) -> set[str]:
    """The names of every installed distribution the roots need, through their metadata."""
    seen: set[str] = set()
    todo = [(r, frozenset(r.extras)) for r in roots]
    while todo:
        req, extras = todo.pop()
        name = canonicalize_name(req.name)
        key = f"{name}[{','.join(sorted(extras))}]"
        if key in seen:
            continue
        seen.add(key)
        try:
            specs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue  # not installed: the test of the ranges names it
        for spec in specs:
            dep = Requirement(spec)
            envs = [{"extra": e} for e in extras] or [{"extra": ""}]
            if dep.marker is None or any(dep.marker.evaluate(env) for env in envs):
                todo.append((dep, frozenset(dep.extras)))
    return {k.partition("[")[0] for k in seen}


def test_every_requirement_is_locked_within_its_range() -> None:
    pins = locked()
    problems = []
    for req, extra in project_requirements():
        where = f"[{extra}]" if extra else "dependencies"
        version = pins.get(canonicalize_name(req.name))
        if version is None:
            problems.append(f"{req} ({where}) is not in requirements.lock")
        elif not req.specifier.contains(version, prereleases=True):
            problems.append(f"{req} ({where}): the lock has {version}, outside the range")
    assert not problems, "; ".join(problems) + f": {FIX}"


def test_the_lock_carries_nothing_that_is_not_required() -> None:
    needed = closure([r for r, _ in project_requirements()])
    extra = sorted(set(locked()) - needed - BUILD_TOOLS)
    assert not extra, f"requirements.lock carries {extra}, which nothing requires: {FIX}"


def test_the_installed_environment_is_the_lock() -> None:
    differ = []
    for name, version in sorted(locked().items()):
        try:
            installed = Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            differ.append(f"{name} {version} is not installed")
            continue
        if installed != version:
            differ.append(f"{name} {installed} is installed, the lock has {version}")
    assert not differ, "; ".join(differ) + ": `make clean test` installs from the lock"


def test_protobuf_range_admits_what_the_generated_stubs_check_at_import() -> None:
    """The stubs call ValidateProtobufRuntimeVersion(major, minor, patch): the requirement's
    floor is that version and its ceiling the next major, which the check refuses."""
    stub = (REPO / "extproc/_proto/llm_extproc/v1/policy_pb2.py").read_text(encoding="utf-8")
    call = stub.split("ValidateProtobufRuntimeVersion(", 1)[1].split(")", 1)[0]
    major, minor, patch = (int(x.strip()) for x in call.split(",")[1:4])
    (req,) = [r for r, _ in project_requirements() if canonicalize_name(r.name) == "protobuf"]
    assert req.specifier == f">={major}.{minor}.{patch},<{major + 1}", str(req)
