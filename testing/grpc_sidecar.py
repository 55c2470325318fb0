"""``python -m testing.grpc_sidecar FLAGS``: ``llm-extproc serve FLAGS`` on grpc.aio.

The product's CLI, flags, checks, errors and signals included (``extproc.cli``), with one
change: the sidecar it builds runs on ``testing.grpc_aio.GrpcAioTransport``, the test oracle,
instead of the h2 transport. For tests that need the oracle as a process of its own (grpc.aio's
broken state cannot reach other tests there), e.g. ``tests/e2e/test_grpc_aio_path.py``; run it
from the repository, where ``testing`` is importable. ``testing.grpc_aio.serve_argv("grpc")``
is this command.
"""

from __future__ import annotations

import sys

from extproc import cli
from extproc.app import Sidecar
from testing.grpc_aio import GrpcAioSidecar


def main(argv: list[str] | None = None) -> int:
    # serve builds its sidecar as ``cli.Sidecar(...)``: in this process, the oracle's.
    built = cli.Sidecar  # type: ignore[attr-defined]
    assert built is Sidecar, "extproc.cli no longer builds its sidecar as cli.Sidecar"
    cli.Sidecar = GrpcAioSidecar  # type: ignore[attr-defined]
    return cli.main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
