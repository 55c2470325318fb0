"""The committed policy stubs are what grpcio-tools makes of protos/ today (`make protos`)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from grpc_tools import protoc

REPO = Path(__file__).resolve().parents[2]
PROTO = "llm_extproc/v1/policy.proto"


def test_policy_stubs_are_current(tmp_path: Path) -> None:
    well_known = resources.files("grpc_tools") / "_proto"  # google/protobuf/*.proto
    rc = protoc.main(
        [
            "protoc",
            f"-I{REPO / 'protos'}",
            f"-I{well_known}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            str(REPO / "protos" / PROTO),
        ]
    )
    assert rc == 0
    for name in ("policy_pb2.py", "policy_pb2.pyi"):
        fresh = (tmp_path / "llm_extproc" / "v1" / name).read_text()
        committed = (REPO / "extproc" / "_proto" / "llm_extproc" / "v1" / name).read_text()
        assert committed == fresh, f"extproc/_proto/.../{name} is stale: run `make protos`"
