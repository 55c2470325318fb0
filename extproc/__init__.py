"""llm-extproc: admission control for LLM inference as an Envoy ext_proc sidecar."""

from __future__ import annotations

import functools
from pathlib import Path

__all__ = ["DISTRIBUTION", "__version__", "version"]

DISTRIBUTION = "llm-extproc"


@functools.cache
def version() -> str:
    """The version pyproject.toml gives: the installed distribution's metadata, else (a source
    tree run without installing it) the pyproject.toml beside the package, else ``0+unknown``.
    Read on first use, not at import (importlib.metadata costs tens of milliseconds)."""
    import tomllib
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed(DISTRIBUTION)
    except PackageNotFoundError:
        pass
    try:
        with (Path(__file__).resolve().parent.parent / "pyproject.toml").open("rb") as f:
            return str(tomllib.load(f)["project"]["version"])
    except (OSError, tomllib.TOMLDecodeError, KeyError):
        return "0+unknown"


def __getattr__(name: str) -> str:
    if name == "__version__":
        return version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
