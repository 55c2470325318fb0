"""Header blocks: what the server reads of a request's headers, and the few it writes.

In: a block is scanned before it is decoded (``scan_block``: table-size updates only at its
start and at most two, RFC 7541 4.2; no more fields than could fit ``MAX_HEADER_LIST``), so
that decoding is bounded per block, then decoded by the ``hpack`` package, one decoder per
connection (``HeaderDecoder``). Envoy sends the same block for every ext_proc stream (only
indexed fields and a literal ``:path``): blocks that leave the HPACK dynamic table alone
decode the same way until the table changes, so they are cached, ``HEADER_CACHE_BYTES`` in
all, and the cache is forgotten whenever a block changes the table. A request is served only
if it is gRPC (``request_path``); the method is then looked up by its ``:path``.

Out: every block we send is literal without indexing (or a static-table entry), so the peer's
HPACK table settings never matter to us, and nothing the peer sent is echoed: the answers to
an unknown method or a request that is not gRPC are fixed, and a ``grpc-message`` is
percent-encoded and cut to ``MAX_GRPC_MESSAGE`` bytes.
"""

from __future__ import annotations

from typing import cast

import grpc
import hpack

from extproc.transport.h2.frames import COMPRESSION_ERROR, ConnectionFailure
from extproc.transport.h2.limits import (
    DECODE_COST_SHIFT,
    HEADER_CACHE_BYTES,
    HEADER_FIELD_COST,
    MAX_GRPC_MESSAGE,
    MAX_HEADER_FIELDS,
    MAX_HEADER_LIST,
)

__all__ = [
    "NOT_GRPC",
    "OK_TRAILERS",
    "RESPONSE_HEADERS",
    "UNKNOWN_METHOD",
    "BadBlock",
    "HeaderDecoder",
    "Headers",
    "modifies_table",
    "percent_encode",
    "request_path",
    "scan_block",
    "status_block",
]

Headers = list[tuple[bytes, bytes]]


def _hpack_int(value: int, prefix_bits: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((value,))
    out = bytearray((limit,))
    value -= limit
    while value >= 128:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: bytes, value: bytes) -> bytes:
    """A header as 'literal without indexing, new name': touches no HPACK dynamic table, so
    the peer's table size settings never matter to us."""
    return b"\x00" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value


# :status 200 is entry 8 of HPACK's static table; content-type (entry 31) with a literal value.
RESPONSE_HEADERS = b"\x88" + _hpack_int(31, 4) + _hpack_int(16, 7) + b"application/grpc"
OK_TRAILERS = _literal(b"grpc-status", b"0")
# :status 415 (static name, literal value), for a request that is not gRPC.
NOT_GRPC = _hpack_int(8, 4) + b"\x03415"


def percent_encode(message: str) -> bytes:
    """grpc-message encoding: bytes outside 0x20-0x7E, and '%', as %XX; cut to
    MAX_GRPC_MESSAGE bytes, never inside an escape."""
    out = bytearray()
    for b in message.encode("utf-8"):
        piece = bytes((b,)) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b
        if len(out) + len(piece) > MAX_GRPC_MESSAGE:
            break
        out += piece
    return bytes(out)


def status_block(code: grpc.StatusCode, message: str) -> bytes:
    """Trailers with ``grpc-status`` and, if there is one, ``grpc-message``."""
    block = _literal(b"grpc-status", str(code.value[0]).encode())
    if message:
        block += _literal(b"grpc-message", percent_encode(message))
    return block


# A fixed message: nothing the peer sent is echoed back.
UNKNOWN_METHOD = RESPONSE_HEADERS + status_block(grpc.StatusCode.UNIMPLEMENTED, "unknown method")


def request_path(headers: Headers) -> bytes | None:
    """The ``:path`` of a gRPC request (its content-type is ``application/grpc``, with or
    without a suffix), or None for a request that is not gRPC."""
    path = b""
    content_type = b""
    for name, value in headers:
        if name == b":path":
            path = value
        elif name == b"content-type":
            content_type = value
    return path if content_type.startswith(b"application/grpc") else None


def _read_int(block: bytes, pos: int, prefix_bits: int) -> tuple[int, int]:
    limit = (1 << prefix_bits) - 1
    value = block[pos] & limit
    pos += 1
    if value < limit:
        return value, pos
    shift = 0
    while True:
        b = block[pos]
        pos += 1
        value += (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, pos
        if shift > 28:  # no integer we accept needs more than 4 continuation bytes
            raise ValueError("HPACK integer too long")


class BadBlock(ValueError):
    """A header block refused before decoding, or one the decoder could not decode."""


def scan_block(block: bytes) -> tuple[bool, int]:
    """Walk a header block's representations without decoding anything: refuse table-size
    updates that are not at its start or more than two of them (RFC 7541 4.2), and more
    fields than could fit MAX_HEADER_LIST. Returns whether decoding it changes the HPACK
    dynamic table (a literal with incremental indexing, or a size update), and its number of
    fields."""
    pos, n = 0, len(block)
    fields = updates = 0
    modifies = False
    try:
        while pos < n:
            b = block[pos]
            if b & 0x80:  # indexed field
                pos = _read_int(block, pos, 7)[1]
            elif b & 0xE0 == 0x20:  # dynamic table size update
                if fields:
                    raise BadBlock("table size update after a field")
                updates += 1
                if updates > 2:
                    raise BadBlock("more than two table size updates")
                modifies = True
                pos = _read_int(block, pos, 5)[1]
                continue
            else:  # a literal: 01xxxxxx indexes, 0000xxxx / 0001xxxx do not
                indexing = bool(b & 0x40)
                modifies = modifies or indexing
                index, pos = _read_int(block, pos, 6 if indexing else 4)
                if index == 0:
                    length, pos = _read_int(block, pos, 7)
                    pos += length
                length, pos = _read_int(block, pos, 7)
                pos += length
            fields += 1
            if fields > MAX_HEADER_FIELDS:
                raise BadBlock("too many header fields")
    except IndexError:
        raise BadBlock("truncated header block") from None
    except ValueError as e:
        if isinstance(e, BadBlock):
            raise
        raise BadBlock(str(e)) from None
    if pos != n:
        raise BadBlock("truncated header block")
    return modifies, fields


def modifies_table(block: bytes) -> bool:
    """Whether decoding this header block changes the HPACK dynamic table (a literal with
    incremental indexing, or a table size update). Errs on the side of yes."""
    try:
        return scan_block(block)[0]
    except BadBlock:
        return True


class HeaderDecoder:
    """One connection's HPACK decoder and its cache of decoded blocks.

    ``cache`` maps a block to its fields; the connection looks a block up there first (the
    path every Envoy stream takes) and calls ``decode`` only for a block it does not hold.
    ``cached_bytes`` is what the cache holds, counted as ``HEADER_CACHE_BYTES`` bounds it."""

    __slots__ = ("_decoder", "cache", "cached_bytes")

    def __init__(self) -> None:
        self._decoder = hpack.Decoder(max_header_list_size=MAX_HEADER_LIST)
        self.cache: dict[bytes, Headers] = {}
        self.cached_bytes = 0

    def decode(self, block: bytes) -> tuple[Headers, int]:
        """The block's fields, and the work its decoding cost (``SLICE_WORK`` units: 0 from
        the cache); a block that is refused or does not decode is a COMPRESSION_ERROR."""
        headers = self.cache.get(block)
        if headers is not None:
            return headers, 0
        try:
            modifies, fields = scan_block(block)
            headers = cast(Headers, self._decoder.decode(block, raw=True))
        except (hpack.HPACKError, ValueError, IndexError) as e:
            why = str(e) if isinstance(e, BadBlock) else type(e).__name__
            raise ConnectionFailure(COMPRESSION_ERROR, "compression error", why) from None
        work = (len(block) >> DECODE_COST_SHIFT) + 2 * fields
        if modifies:
            self.clear()
        else:
            cost = len(block) + sum(len(k) + len(v) + HEADER_FIELD_COST for k, v in headers)
            if self.cached_bytes + cost > HEADER_CACHE_BYTES:
                self.clear()
            if cost <= HEADER_CACHE_BYTES:
                self.cache[block] = headers
                self.cached_bytes += cost
        return headers, work

    def clear(self) -> None:
        self.cache.clear()
        self.cached_bytes = 0
