"""What a released tool carries: its version (``llm-extproc --version``, read from the
distribution's metadata, or pyproject.toml in a source tree never installed) and the licence
pyproject.toml names, in full."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest

import extproc
from testing.stack import cli

REPO = Path(__file__).resolve().parents[2]


def pyproject() -> dict[str, object]:
    with (REPO / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)["project"]  # type: ignore[no-any-return]


def test_version_is_pyprojects_installed_or_not(monkeypatch: pytest.MonkeyPatch) -> None:
    assert extproc.version() == pyproject()["version"] == extproc.__version__

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    extproc.version.cache_clear()
    try:
        assert extproc.version() == pyproject()["version"]
    finally:
        extproc.version.cache_clear()


@pytest.mark.slow  # a CLI process
def test_version_flag() -> None:
    out = cli("--version")
    assert (out.returncode, out.stdout, out.stderr) == (
        0,
        f"llm-extproc {pyproject()['version']}\n",
        "",
    )


def test_license_is_the_apache_license_2_0_that_pyproject_names() -> None:
    assert pyproject()["license"] == {"text": "Apache-2.0"}
    text = (REPO / "LICENSE").read_text(encoding="utf-8")
    assert text.split()[:5] == ["Apache", "License", "Version", "2.0,", "January"]
    # The nine sections of the terms, in order, then the appendix with our copyright line.
    sections = [
        "1. Definitions.",
        "2. Grant of Copyright License.",
        "3. Grant of Patent License.",
        "4. Redistribution.",
        "5. Submission of Contributions.",
        "6. Trademarks.",
        "7. Disclaimer of Warranty.",
        "8. Limitation of Liability.",
        "9. Accepting Warranty or Additional Liability.",
        "END OF TERMS AND CONDITIONS",
        "APPENDIX: How to apply the Apache License to your work.",
        "Copyright 2026 The llm-extproc authors",
        'Licensed under the Apache License, Version 2.0 (the "License");',
    ]
    at = [text.find(s) for s in sections]
    assert -1 not in at and at == sorted(at), dict(zip(sections, at, strict=True))
    assert "[yyyy]" not in text and len(text.split()) > 1500
