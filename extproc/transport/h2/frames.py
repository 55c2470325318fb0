"""HTTP/2 frames (RFC 9113 sections 4 and 6): the numbers the server speaks, and the two byte
shapes it handles on its own, a frame and the start of something still incomplete.

A frame is a 9-byte header (24-bit length, type, flags, 31-bit stream id) and its payload.
``HEADER`` packs and unpacks the header with the length as (high byte, low 16 bits), which is
what ``struct`` can do in one call; ``frame`` builds a whole frame. The connection reads
frames straight out of the bytes it is given (``connection.Connection``) and keeps the start
of a frame that is not complete yet in a ``Pieces``, as ``call.Call`` does for a gRPC message.
A ``ConnectionFailure`` is a protocol error that ends the connection (GOAWAY).
"""

from __future__ import annotations

import struct

__all__ = [
    "ACK",
    "CANCEL",
    "COMPRESSION_ERROR",
    "CONTINUATION",
    "DATA",
    "DEFAULT_FRAME",
    "DEFAULT_WINDOW",
    "END_HEADERS",
    "END_STREAM",
    "ENHANCE_YOUR_CALM",
    "FLOW_CONTROL_ERROR",
    "FRAME_SIZE_ERROR",
    "GOAWAY",
    "HEADER",
    "HEADERS",
    "INTERNAL_ERROR",
    "LARGEST_FRAME",
    "MAX_WINDOW",
    "NO_ERROR",
    "PADDED",
    "PING",
    "PREFACE",
    "PRIORITY",
    "PRIORITY_FLAG",
    "PROTOCOL_ERROR",
    "PUSH_PROMISE",
    "REFUSED_STREAM",
    "RST_STREAM",
    "SETTING",
    "SETTINGS",
    "S_ENABLE_PUSH",
    "S_HEADER_TABLE_SIZE",
    "S_INITIAL_WINDOW_SIZE",
    "S_MAX_CONCURRENT_STREAMS",
    "S_MAX_FRAME_SIZE",
    "S_MAX_HEADER_LIST_SIZE",
    "U32",
    "WINDOW_UPDATE",
    "ConnectionFailure",
    "Pieces",
    "frame",
    "goaway",
    "rst_stream",
    "window_update",
]

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types (RFC 9113 section 6) and flags.
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# Error codes.
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 0x6, 0x7, 0x8, 0x9
ENHANCE_YOUR_CALM = 0xB
# SETTINGS identifiers.
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS = 1, 2, 3
S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE = 4, 5, 6

MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65535
DEFAULT_FRAME = 16384
# The largest SETTINGS_MAX_FRAME_SIZE a peer may announce (RFC 9113 6.5.2).
LARGEST_FRAME = 2**24 - 1

HEADER = struct.Struct(">BHBBL")  # 24-bit length as (high byte, low 16 bits), type, flags, id
U32 = struct.Struct(">L")
SETTING = struct.Struct(">HL")
_GOAWAY = struct.Struct(">LL")


def frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return HEADER.pack(n >> 16, n & 0xFFFF, ftype, flags, stream_id) + payload


def rst_stream(stream_id: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream_id, U32.pack(code))


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, U32.pack(increment))


def goaway(last_id: int, code: int, debug: bytes) -> bytes:
    return frame(GOAWAY, 0, 0, _GOAWAY.pack(last_id, code) + debug)


class ConnectionFailure(Exception):
    """A protocol error that ends the connection: GOAWAY with ``code`` and the fixed debug
    string ``why``; ``detail`` goes to our log only."""

    def __init__(self, code: int, why: str, detail: str = "") -> None:
        super().__init__(why)
        self.code = code
        self.why = why
        self.detail = detail


class Pieces:
    """The start of something incomplete (a frame, a gRPC message) and the pieces that follow,
    joined once when ``need`` bytes are there, instead of re-copied on every read (a large
    body arrives in many 16 KiB frames)."""

    __slots__ = ("have", "need", "parts")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.have = 0
        self.need = 0

    def keep(self, start: bytes, need: int) -> None:
        self.parts = [start]
        self.have = len(start)
        self.need = need

    def add(self, data: bytes) -> bytes | None:
        """All the bytes so far once ``need`` of them are there (and forget them), else None."""
        self.parts.append(data)
        self.have += len(data)
        if self.have < self.need:
            return None
        joined = b"".join(self.parts)
        self.parts = []
        self.have = 0
        return joined

    def clear(self) -> None:
        self.parts = []
        self.have = 0
