"""The sidecar's answers to Envoy: what each one says, encoded straight to protobuf wire bytes.

The answers (the last stage of the request path):
- ``HEADERS_CONTINUE``: go on to the body; ``PASS_THROUGH``: not an LLM request, skip the body;
  ``continue_for(msg)``: a plain CONTINUE to any other message.
- ``timeout_override(s)``: while a request waits, Envoy's message timeout becomes ``s``.
- ``admitted(cls, rec)``: CONTINUE with the rewritten body (if max_tokens changed) and its
  content-length, the ``x-llm-*`` headers for the backend, and dynamic metadata for the access
  log; ``admitted_unchanged(rec)``: CONTINUE with metadata only (shadow mode).
- ``refusal(rejection, rec)``: an ImmediateResponse (status, JSON error, Retry-After) with the
  same metadata.

``rec`` is what the request went through, read through ``Facts`` (``extproc.record.RequestRecord``
is one: the record sits above the request path, which does not import it).

Why bytes:

Building ``ProcessingResponse`` messages with the protobuf API (five HeaderValueOptions, a
CommonResponse, a Struct of dynamic metadata) and serialising them cost more than everything
else the sidecar does for a request (about 35 us of a ~150 us budget; docs/performance.md,
"Conclusions from earlier measurements"). The answers have a fixed shape, so this module writes
their bytes directly: a handful of length-delimited fields. Field numbers are read from
Envoy's own descriptors at import, not typed in, and tests/unit/test_wire.py checks every
encoder against the message built with the protobuf API, field for field.

The gRPC method is registered with a serializer that passes ``bytes`` through unchanged and
serialises messages as usual (``serialize``), so both can be written to the stream.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import duration_pb2, struct_pb2

from extproc.contract import METADATA_NAMESPACE
from extproc.outcome import Outcome, Rejection
from extproc.request.classify import Classification

__all__ = [
    "HEADERS_CONTINUE",
    "PASS_THROUGH",
    "Facts",
    "admitted",
    "admitted_unchanged",
    "body_continue",
    "continue_for",
    "immediate",
    "metadata_struct",
    "refusal",
    "serialize",
    "timeout_override",
]


def _num(message: Any, field: str) -> int:
    return int(message.DESCRIPTOR.fields_by_name[field].number)


_LEN, _VARINT, _I64 = 2, 0, 1


def _tag(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


_SMALL = [bytes((i,)) for i in range(128)]


def _varint(n: int) -> bytes:
    if n < 128:
        return _SMALL[n]
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _ld(tag: bytes, payload: bytes) -> bytes:
    return tag + _varint(len(payload)) + payload


# ProcessingResponse
_T_REQUEST_BODY = _tag(_num(pb.ProcessingResponse, "request_body"), _LEN)
_T_IMMEDIATE = _tag(_num(pb.ProcessingResponse, "immediate_response"), _LEN)
_T_METADATA = _tag(_num(pb.ProcessingResponse, "dynamic_metadata"), _LEN)
# BodyResponse / CommonResponse / HeaderMutation / BodyMutation
_T_BODY_RESPONSE = _tag(_num(pb.BodyResponse, "response"), _LEN)
_T_HEADER_MUTATION = _tag(_num(pb.CommonResponse, "header_mutation"), _LEN)
_T_BODY_MUTATION = _tag(_num(pb.CommonResponse, "body_mutation"), _LEN)
_T_SET_HEADERS = _tag(_num(pb.HeaderMutation, "set_headers"), _LEN)
_T_MUTATION_BODY = _tag(_num(pb.BodyMutation, "body"), _LEN)
# ImmediateResponse
_T_IMM_STATUS = _tag(_num(pb.ImmediateResponse, "status"), _LEN)
_T_IMM_HEADERS = _tag(_num(pb.ImmediateResponse, "headers"), _LEN)
_T_IMM_BODY = _tag(_num(pb.ImmediateResponse, "body"), _LEN)
_T_IMM_DETAILS = _tag(_num(pb.ImmediateResponse, "details"), _LEN)
_T_STATUS_CODE = _tag(1, _VARINT)  # envoy.type.v3.HttpStatus.code
# HeaderValueOption / HeaderValue
_T_OPTION_HEADER = _tag(_num(base_pb2.HeaderValueOption, "header"), _LEN)
_OVERWRITE = _tag(_num(base_pb2.HeaderValueOption, "append_action"), _VARINT) + _varint(
    base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
)
_T_KEY = _tag(_num(base_pb2.HeaderValue, "key"), _LEN)
_T_RAW_VALUE = _tag(_num(base_pb2.HeaderValue, "raw_value"), _LEN)
# Struct / Value
_T_FIELDS = _tag(_num(struct_pb2.Struct, "fields"), _LEN)
_T_ENTRY_KEY, _T_ENTRY_VALUE = _tag(1, _LEN), _tag(2, _LEN)
_T_NUMBER = _tag(_num(struct_pb2.Value, "number_value"), _I64)
_T_STRING = _tag(_num(struct_pb2.Value, "string_value"), _LEN)
_T_STRUCT = _tag(_num(struct_pb2.Value, "struct_value"), _LEN)

# Header keys never change: encode each once.
_KEYS: dict[str, bytes] = {}


def _header_option(key: str, value: str) -> bytes:
    k = _KEYS.get(key)
    if k is None:
        k = _KEYS[key] = _ld(_T_KEY, key.encode())
    header = k + _ld(_T_RAW_VALUE, value.encode())
    return _ld(_T_SET_HEADERS, _ld(_T_OPTION_HEADER, header) + _OVERWRITE)


_PACK_DOUBLE = struct.Struct("<d").pack
# Struct keys are few and fixed (bucket, outcome, ...): encode each once.
_ENTRY_KEYS: dict[str, bytes] = {}


def _value(v: object) -> bytes:
    if isinstance(v, str):
        return _ld(_T_STRING, v.encode())
    if isinstance(v, Mapping):
        return _ld(_T_STRUCT, _struct(v))
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"unsupported metadata value {v!r}")
    return _T_NUMBER + _PACK_DOUBLE(float(v))


def _struct(fields: Mapping[str, object]) -> bytes:
    parts = []
    for key, v in fields.items():
        k = _ENTRY_KEYS.get(key)
        if k is None:
            k = _ENTRY_KEYS[key] = _ld(_T_ENTRY_KEY, key.encode())
        parts.append(_ld(_T_FIELDS, k + _ld(_T_ENTRY_VALUE, _value(v))))
    return b"".join(parts)


def metadata_struct(namespace: str, fields: Mapping[str, object]) -> bytes:
    """A serialised google.protobuf.Struct ``{namespace: fields}``."""
    return _struct({namespace: fields})


def body_continue(
    headers: Iterable[tuple[str, str]], body: bytes | None, metadata: bytes | None
) -> bytes:
    """ProcessingResponse{request_body: BodyResponse{response: CommonResponse{header_mutation,
    body_mutation}}, dynamic_metadata}."""
    options = b"".join(_header_option(k, v) for k, v in headers)
    common = _ld(_T_HEADER_MUTATION, options) if options else b""
    if body is not None:
        common += _ld(_T_BODY_MUTATION, _ld(_T_MUTATION_BODY, body))
    out = _ld(_T_REQUEST_BODY, _ld(_T_BODY_RESPONSE, common))
    if metadata is not None:
        out += _ld(_T_METADATA, metadata)
    return out


def immediate(
    status: int,
    headers: Iterable[tuple[str, str]],
    body: bytes,
    details: str,
    metadata: bytes | None,
) -> bytes:
    """ProcessingResponse{immediate_response: ImmediateResponse{status, headers, body,
    details}, dynamic_metadata}."""
    imm = (
        _ld(_T_IMM_STATUS, _T_STATUS_CODE + _varint(status))
        + _ld(_T_IMM_HEADERS, b"".join(_header_option(k, v) for k, v in headers))
        + _ld(_T_IMM_BODY, body)
        + _ld(_T_IMM_DETAILS, details.encode())
    )
    out = _ld(_T_IMMEDIATE, imm)
    if metadata is not None:
        out += _ld(_T_METADATA, metadata)
    return out


def serialize(message: Any) -> bytes:
    """The gRPC response serializer: bytes pass through; messages are serialised."""
    if isinstance(message, bytes):
        return message
    return message.SerializeToString()  # type: ignore[no-any-return]


# --- the answers -----------------------------------------------------------------------------

HEADERS_CONTINUE = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
PASS_THROUGH = pb.ProcessingResponse(
    request_headers=pb.HeadersResponse(),
    mode_override=processing_mode_pb2.ProcessingMode(
        request_body_mode=processing_mode_pb2.ProcessingMode.NONE
    ),
)


def continue_for(msg: pb.ProcessingRequest) -> pb.ProcessingResponse:
    """A plain CONTINUE answering whatever message Envoy sent."""
    kind = msg.WhichOneof("request")
    if kind in ("request_headers", "response_headers"):
        return pb.ProcessingResponse(**{kind: pb.HeadersResponse()})
    if kind in ("request_body", "response_body"):
        return pb.ProcessingResponse(**{kind: pb.BodyResponse()})
    if kind in ("request_trailers", "response_trailers"):
        return pb.ProcessingResponse(**{kind: pb.TrailersResponse()})
    return pb.ProcessingResponse()


def timeout_override(seconds: float) -> pb.ProcessingResponse:
    d = duration_pb2.Duration()
    d.FromNanoseconds(round(seconds * 1e9))
    return pb.ProcessingResponse(override_message_timeout=d)


class Facts(Protocol):
    """What the answers say of the request: the access log's metadata, the error's shape."""

    @property
    def anthropic(self) -> bool: ...  # refusals take Anthropic's error shape
    @property
    def bucket(self) -> str: ...
    @property
    def outcome(self) -> Outcome | None: ...
    @property
    def shadow_outcome(self) -> Outcome | None: ...
    @property
    def code(self) -> str | None: ...
    @property
    def prompt_tokens(self) -> int | None: ...
    @property
    def max_tokens(self) -> int | None: ...
    @property
    def queue_s(self) -> float: ...


def _metadata(rec: Facts) -> bytes:
    """Dynamic metadata for Envoy's access log: %DYNAMIC_METADATA(llm_extproc:bucket)% etc."""
    fields: dict[str, str | int] = {
        "bucket": rec.bucket,
        "outcome": str(rec.outcome),
        "queue_ms": round(rec.queue_s * 1000),
    }
    if rec.prompt_tokens is not None:
        fields["prompt_tokens"] = rec.prompt_tokens
    if rec.max_tokens is not None:
        fields["max_tokens"] = rec.max_tokens
    if rec.code is not None:
        fields["code"] = rec.code
    if rec.shadow_outcome is not None:
        fields["shadow_outcome"] = str(rec.shadow_outcome)
    return metadata_struct(METADATA_NAMESPACE, fields)


def refusal(rejection: Rejection, rec: Facts) -> bytes:
    body = anthropic_error(rejection) if rec.anthropic else rejection.body
    return immediate(
        rejection.status,
        rejection.headers(),
        body,
        f"llm_extproc_{rec.code}",
        _metadata(rec),
    )


# Anthropic's error types for the OpenAI ones the sidecar answers with, by status where the
# OpenAI type is too broad (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}


def anthropic_error(rejection: Rejection) -> bytes:
    """A refusal's body in Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``
    (the Messages API's clients read that), keeping the stable ``code``. Refusals only: the cost
    of re-reading the OpenAI body is paid off the admitted path."""
    error = json.loads(rejection.body)["error"]
    if rejection.status >= 500:
        kind = "overloaded_error" if rejection.status == 503 else "api_error"
    else:
        kind = _ANTHROPIC_TYPES.get(rejection.status, "invalid_request_error")
    shaped = {
        "type": "error",
        "error": {"type": kind, "message": error["message"], "code": rejection.code},
    }
    return json.dumps(shaped, separators=(",", ":")).encode()


def admitted(cls: Classification, rec: Facts) -> bytes:
    headers = [
        ("x-llm-bucket", cls.bucket.name),
        ("x-llm-queue-ms", str(round(rec.queue_s * 1000))),
        ("x-llm-prompt-tokens", str(cls.prompt_tokens)),
        # Echoed to the client by the route's response_headers_to_add (%REQ(x-llm-max-tokens)%),
        # which spares us a round trip on the response path.
        ("x-llm-max-tokens", str(cls.max_tokens)),
    ]
    if cls.new_body is not None:
        headers.append(("content-length", str(len(cls.new_body))))
    # Header values go out as raw_value bytes (``value`` alone gives Envoy empty headers),
    # with OVERWRITE_IF_EXISTS_OR_ADD.
    return body_continue(headers, cls.new_body, _metadata(rec))


def admitted_unchanged(rec: Facts) -> bytes:
    return body_continue((), None, _metadata(rec))
