"""The Dockerfile, its build context and container command lines, read without Docker.

No Docker daemon runs where the tests run, so ``tests/deploy/`` checks the container files by
reading them: the Dockerfile's stages and instructions (``dockerfile_stages``, ``instruction``,
``exec_form``, ``healthcheck_command``), the files ``docker build .`` would send
(``dockerignore_allows``, ``docker_context``) and the value of a flag in a container's command
line (``flag``: Dockerfile CMD, compose ``command``, Kubernetes ``args``).
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
from pathlib import Path

from testing.envoy import REPO

__all__ = [
    "docker_context",
    "dockerfile_stages",
    "dockerignore_allows",
    "exec_form",
    "flag",
    "healthcheck_command",
    "instruction",
]

Stage = list[tuple[str, str]]


def dockerfile_stages(path: Path = REPO / "Dockerfile") -> dict[str, Stage]:
    """{stage name: [(INSTRUCTION, arguments)]}, in file order; continuation lines joined,
    `FROM x AS y` opening a stage; a stage built FROM another starts with its instructions."""
    text = path.read_text().replace("\\\n", " ")
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, rest = line.partition(" ")
        key, rest = key.upper(), " ".join(rest.split())
        if key == "ARG" and current is None:
            name, _, value = rest.partition("=")
            args[name] = value
        elif key == "FROM":
            m = re.fullmatch(r"(\S+) AS (\S+)", rest, re.IGNORECASE)
            assert m, f"every stage is named: {line}"
            base = re.sub(r"\$\{(\w+)\}", lambda a: args[a.group(1)], m.group(1))
            current = copy.copy(stages.get(base, [("BASE", base)]))
            stages[m.group(2)] = current
        else:
            assert current is not None, line
            current.append((key, rest))
    return stages


def instruction(stage: Stage, key: str) -> str:
    """The last value of an instruction in a stage (the one in force)."""
    values = [v for k, v in stage if k == key]
    assert values, f"no {key}"
    return values[-1]


def exec_form(value: str) -> list[str]:
    parsed = json.loads(value)
    assert isinstance(parsed, list) and all(isinstance(a, str) for a in parsed), value
    return parsed


def healthcheck_command(stage: Stage) -> list[str]:
    value = instruction(stage, "HEALTHCHECK")
    m = re.search(r"\bCMD (\[.*\])$", value)
    assert m, value
    return exec_form(m.group(1))


def dockerignore_allows(rel: str, dockerignore: Path = REPO / ".dockerignore") -> bool:
    """Docker's .dockerignore rules, for the patterns used there: in order, the last pattern
    matching the path or one of its parent folders wins; `!` re-includes; `*` stays within one
    path segment, `**` spans several."""
    patterns = [
        line.strip()
        for line in dockerignore.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    allowed = True
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern.lstrip("!").strip("/")
        regex = "".join(
            ".*" if tok == "**" else "[^/]*" if tok == "*" else re.escape(tok)
            for tok in re.split(r"(\*\*|\*)", body)
        )
        if any(re.fullmatch(regex, p) for p in prefixes):
            allowed = negate
    return allowed


def docker_context(root: Path = REPO) -> list[str]:
    """The files `docker build` sends from `root`: those git tracks or would track (untracked
    but not ignored), minus what .dockerignore keeps out; repository-relative, sorted."""
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        text=True,
        check=True,
        cwd=root,
    ).stdout.split()
    return sorted(
        f for f in files if (root / f).is_file() and dockerignore_allows(f, root / ".dockerignore")
    )


def flag(command: list[str], name: str) -> str:
    """The value of --name=V or --name V in an argument list."""
    for i, arg in enumerate(command):
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
        if arg == name:
            return command[i + 1]
    raise AssertionError(f"{name} not in {command}")
