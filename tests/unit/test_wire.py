"""extproc.request.respond writes the same messages the protobuf API would, field for field."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from extproc.request import respond as wire

HEADERS = [
    ("x-llm-bucket", "batch"),
    ("x-llm-queue-ms", "12"),
    ("content-length", "1234"),
    ("x-odd", "é ü \x7f"),
]
FIELDS: dict[str, object] = {
    "bucket": "batch",
    "outcome": "admitted",
    "queue_ms": 0,
    "prompt_tokens": 123456,
    "code": "",
    "x": 0.5,
    "big": 2**40,
}


def option(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def reference_struct() -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update({"llm_extproc": FIELDS})
    return s


def test_metadata_struct() -> None:
    got = struct_pb2.Struct.FromString(wire.metadata_struct("llm_extproc", FIELDS))
    assert got == reference_struct()


def test_body_continue_with_and_without_mutations() -> None:
    body = b'{"max_tokens": 5, "x": "\xc3\xa9"}' * 100  # > 127 bytes: multi-byte lengths
    got = pb.ProcessingResponse.FromString(
        wire.body_continue(HEADERS, body, wire.metadata_struct("llm_extproc", FIELDS))
    )
    want = pb.ProcessingResponse(
        request_body=pb.BodyResponse(
            response=pb.CommonResponse(
                header_mutation=pb.HeaderMutation(set_headers=[option(k, v) for k, v in HEADERS]),
                body_mutation=pb.BodyMutation(body=body),
            )
        ),
        dynamic_metadata=reference_struct(),
    )
    assert got == want
    bare = pb.ProcessingResponse.FromString(wire.body_continue((), None, None))
    assert bare == pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse()))
    assert bare.HasField("request_body")


def test_immediate() -> None:
    body = b'{"error": {"code": "queue_timeout"}}'
    headers = [("content-type", "application/json"), ("retry-after", "3")]
    got = pb.ProcessingResponse.FromString(
        wire.immediate(
            429,
            headers,
            body,
            "llm_extproc_queue_timeout",
            wire.metadata_struct("llm_extproc", FIELDS),
        )
    )
    want = pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=429),  # type: ignore[arg-type]
            headers=pb.HeaderMutation(set_headers=[option(k, v) for k, v in headers]),
            body=body,
            details="llm_extproc_queue_timeout",
        ),
        dynamic_metadata=reference_struct(),
    )
    assert got == want


def test_serialize_passes_bytes_and_serialises_messages() -> None:
    msg = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
    assert wire.serialize(b"abc") == b"abc"
    assert wire.serialize(msg) == msg.SerializeToString()
