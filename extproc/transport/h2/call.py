"""gRPC on one HTTP/2 stream: length-prefixed messages and the call object a method is given.

A gRPC message on the wire is a 5-byte prefix (a compression flag, then a 32-bit length) and
the message. ``Call.on_data`` cuts the stream's DATA into messages (none compressed: refused
with UNIMPLEMENTED; none over ``max_message``: RESOURCE_EXHAUSTED; one that does not parse:
INTERNAL), keeping the start of an incomplete one; ``PREFIX`` frames the answers.

A ``Call`` is one stream's state, in two parts. The connection's part (windows, bytes held,
output waiting for the peer's window, whether it was reset or finished) is kept and changed by
the connection's parts alone (``flow.Inbound``, ``flow.Outbound``, ``session.Session``). The
method's part is the two coroutines the servicer uses, ``await read()`` (the next message, or
``EOF`` once the client half-closed) and ``await write(msg)``, which tell the call's ``Owner``
(the connection's session) what was read, to credit it back to the peer, and what to send. A
message that arrives while a read waits is handed to it at once (``deliver``), and the
connection credits it then, so that the windows reflect what the method has read at every
frame. ``take`` is ``read`` without the waiting, for a driver with no event loop (the sans-IO
tests).

A bad message behind good ones the method has not read yet is raised by ``read`` after them,
in order, as grpc.aio does (``fail_after_queued``).
"""

from __future__ import annotations

import asyncio
import struct
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import grpc

from extproc.transport.h2.frames import Pieces

__all__ = ["EOF", "PREFIX", "Call", "CallAbort", "Method", "Owner", "StatusCode"]

EOF = grpc.aio.EOF
StatusCode = grpc.StatusCode

PREFIX = struct.Struct(">BL")  # compressed flag, length
_U32 = struct.Struct(">L")


class CallAbort(Exception):
    """Ends a call with a gRPC status: raised by a method, or for a bad message."""

    def __init__(self, code: StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Method:
    """A method: (call) -> awaitable, plus how its messages are read and written.

    ``keeps_connection``: whether an open call of this method, once its first message has
    arrived, keeps its connection from being displaced at ``max_connections`` (see
    ``idle``). True for Envoy's calls; False for a call Envoy never makes that may stay open
    as long as its client likes (grpc.health.v1 ``Watch``), so that such calls cannot keep
    Envoy out."""

    __slots__ = ("deserialize", "handler", "keeps_connection", "serialize")

    def __init__(
        self,
        handler: Callable[[Call], Awaitable[None]],
        deserialize: Callable[[bytes], Any],
        serialize: Callable[[Any], bytes],
        *,
        keeps_connection: bool = True,
    ) -> None:
        self.handler = handler
        self.deserialize = deserialize
        self.serialize = serialize
        self.keeps_connection = keeps_connection


class Owner(Protocol):
    """What a call's coroutines need of its connection."""

    def consumed(self, call: Call, size: int) -> None:
        """The method read a message of ``size`` bytes: credit them to the peer."""

    def send_message(self, call: Call, payload: bytes) -> None:
        """Send one serialized message on the call's stream."""


class Call:
    """One gRPC call (one HTTP/2 stream): the context object handed to a method."""

    __slots__ = (
        "_conn",
        "_deserialize",
        "_messages",
        "_reader",
        "_serialize",
        "closed",
        "eof",
        "failure",
        "first_due",
        "headers_sent",
        "held",
        "id",
        "keeps_place",
        "partial",
        "pending",
        "recv_credit",
        "recv_window",
        "reset",
        "send_delta",
        "task",
    )

    def __init__(self, conn: Owner, stream_id: int, recv_window: int, method: Method) -> None:
        self._conn = conn
        self.id = stream_id
        # Displacement (``idle``): ``first_due`` while the call's method would keep its
        # connection in place but its first message has not arrived; ``keeps_place`` once it
        # has (the connection counts it in ``keeping`` until the call ends).
        self.first_due = method.keeps_connection
        self.keeps_place = False
        # Our send window on this stream is the peer's initial window plus this (window
        # updates received minus bytes sent), so a SETTINGS change costs nothing per call.
        self.send_delta = 0
        self.recv_window = recv_window  # what the peer may still send on this stream
        self.recv_credit = 0  # bytes read by the method, not yet given back to the peer
        self.held = 0  # bytes of this stream's DATA we hold: partial message + unread messages
        self._deserialize = method.deserialize
        self._serialize = method.serialize
        self.partial = Pieces()  # the start of an incomplete message
        self._messages: deque[tuple[Any, int]] = deque()  # (message, its bytes on the wire)
        self._reader: asyncio.Future[Any] | None = None
        # A bad message: read() raises it once the good ones before it are read, and input
        # after it is dropped.
        self.failure: CallAbort | None = None
        self.eof = False  # the client half-closed
        self.reset = False  # the stream was reset (by the client, or because of an error)
        self.closed = False  # we sent our END_STREAM
        self.headers_sent = False
        self.pending: deque[list[Any]] = deque()  # [bytes, offset, is_frame] waiting for window
        self.task: asyncio.Task[None] | None = None  # the method's, set by the server

    # --- what a method uses --------------------------------------------------------------------

    async def read(self) -> Any:
        """The next message, or ``EOF`` once the client has half-closed the stream."""
        if self._messages:
            message, size = self._messages.popleft()
            self._conn.consumed(self, size)
            return message
        if self.failure is not None or self.eof:
            return self.take()  # the failure, or EOF
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._reader = fut
        try:
            return await fut
        finally:
            self._reader = None

    def take(self) -> Any:
        """What ``read`` returns without waiting: the next message, ``EOF``, or None when
        there is nothing yet; raises a bad message's failure once the good ones before it are
        read."""
        if self._messages:
            message, size = self._messages.popleft()
            self._conn.consumed(self, size)
            return message
        if self.failure is not None:
            raise self.failure
        if self.eof:
            return EOF
        return None

    async def write(self, message: Any) -> None:
        """Send one message. Never blocks: what the peer's window does not take yet is sent
        when it opens (up to the connection's ``send_queue``)."""
        if self.reset:
            return  # the client is gone (the task is being cancelled): nobody to write to
        if self.closed:
            raise asyncio.InvalidStateError("write on a finished call")
        self._conn.send_message(self, self._serialize(message))

    # --- fed by the connection -----------------------------------------------------------------

    def deliver(self, message: Any, size: int) -> bool:
        """A message arrived: handed to a read that waits (True: the connection credits it
        now), else queued for the next read."""
        reader = self._reader
        if reader is not None and not reader.done():
            reader.set_result(message)
            return True
        self._messages.append((message, size))
        return False

    def partial_need(self) -> int:
        """Bytes still missing from the incomplete message (0: none)."""
        return self.partial.need - self.partial.have if self.partial.parts else 0

    def on_data(self, data: bytes, max_message: int) -> int:
        """Take DATA bytes (already counted in ``held``): cut them into messages, each given
        to ``deliver``. Returns the size of the message a waiting read took (0: none; a read
        takes one message, so at most one is), which the connection credits as read; whether
        an incomplete message remains is ``partial.parts``. A bad message stops the cutting and
        becomes the call's ``failure``, for the connection to end the call."""
        if self.partial.parts:
            joined = self.partial.add(data)
            if joined is None:
                return 0
            data = joined
        buf = data
        pos, n = 0, len(buf)
        need = 5
        taken = 0
        while n - pos >= 5:
            compressed = buf[pos]
            length = _U32.unpack_from(buf, pos + 1)[0]
            if length > max_message:
                self.failure = CallAbort(
                    StatusCode.RESOURCE_EXHAUSTED, f"message larger than {max_message} bytes"
                )
                return taken
            if compressed:
                self.failure = CallAbort(
                    StatusCode.UNIMPLEMENTED, "compressed messages not supported"
                )
                return taken
            end = pos + 5 + length
            if end > n:
                need = 5 + length
                break
            try:
                message = self._deserialize(buf[pos + 5 : end])
            except Exception as e:
                self.failure = CallAbort(StatusCode.INTERNAL, "cannot parse the message")
                self.failure.__cause__ = e
                return taken
            if self.deliver(message, 5 + length):
                taken = 5 + length
            pos = end
        if pos < n:
            self.partial.keep(buf[pos:], need)
        return taken

    def on_end_stream(self) -> None:
        self.eof = True
        reader = self._reader
        if reader is not None and not reader.done():
            reader.set_result(EOF)

    def fail_after_queued(self) -> bool:
        """The ``failure`` just arrived: if good messages wait to be read, it comes after them
        (as grpc.aio does) and the incomplete rest is dropped; returns whether it did (else
        the call fails now)."""
        if not self._messages:
            return False
        self.partial.clear()
        self.held = sum(size for _, size in self._messages)  # the rest is dropped
        return True

    def drop_input(self) -> int:
        """Forget every byte held (the stream is over); returns how many."""
        held = self.held
        self.held = 0
        self._messages.clear()
        self.partial.clear()
        return held
