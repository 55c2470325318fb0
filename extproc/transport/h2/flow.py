"""Flow control both ways, two parts of the connection that, like python-hyper h2's
``WindowManager``, do no I/O and know no connection: told what happened, each changes its own
state and the fields it keeps on calls, and returns the frames to send (b"": none).

``Inbound``, what the peer may send: ``window + credit + buffered == connection_window``, where
``buffered`` is held in calls (incomplete messages, messages not read yet) and ``credit`` was
read (or dropped) but not given back yet (WINDOW_UPDATE: in batches, a quarter of the
connection window or half a stream window, or at once when the peer's window runs low or a
stream waits to complete a message). If the window fills with incomplete messages that none
can complete (``stalled``), the newest are ended (``victim``) until the oldest can.

``Outbound``, what we may send: a call's window is the peer's initial window plus its
``send_delta``, so a SETTINGS change is one assignment however many calls are open. What the
windows do not take waits on its call (``pending``, trailers behind it; the call ``blocked``);
a window that grows sets ``flush_wanted``: one flush at the end of the batch of frames.
"""

from __future__ import annotations

from typing import TypeGuard

from extproc.transport.h2 import frames
from extproc.transport.h2.call import PREFIX, Call
from extproc.transport.h2.frames import DATA, HEADER, ConnectionFailure, frame, window_update
from extproc.transport.h2.headers import RESPONSE_HEADERS
from extproc.transport.h2.limits import H2Limits

__all__ = ["Inbound", "Outbound"]


class Inbound:
    """The receive windows (and the calls' ``recv_window``, ``recv_credit``, ``held``)."""

    __slots__ = ("_at", "_low", "_stream_at", "buffered", "credit", "partials", "window")

    def __init__(self, limits: H2Limits) -> None:
        self.window = frames.DEFAULT_WINDOW
        self.credit = 0
        self.buffered = 0
        self.partials: dict[int, Call] = {}  # calls holding an incomplete message, oldest first
        self._at = max(1, limits.connection_window // 4)
        self._stream_at = max(1, limits.stream_window // 2)
        self._low = limits.stream_window

    def open(self, size: int) -> bytes:  # the connection window, from the default to ``size``
        grow = size - self.window
        self.window = size
        return window_update(0, grow) if grow > 0 else b""

    def take(self, call: Call | None, size: int) -> TypeGuard[Call]:
        """DATA for ``call``: whether it takes it (open, within its window)."""
        self.window -= size
        if self.window < 0:
            raise ConnectionFailure(frames.FLOW_CONTROL_ERROR, "flow control", "connection window")
        if call is None or call.eof or call.reset:
            return False
        call.recv_window -= size
        return call.recv_window >= 0

    def give_back(self, size: int) -> bytes:
        """Bytes no longer held (read, dropped, padding) that the peer may send again."""
        self.credit += size
        return self.announce() if self.credit >= self._at or self.window < self._low else b""

    def announce(self) -> bytes:
        credit, self.credit = self.credit, 0
        self.window += credit
        return window_update(0, credit) if credit else b""

    def announce_stream(self, call: Call) -> bytes:
        credit, call.recv_credit = call.recv_credit, 0
        call.recv_window += credit
        return window_update(call.id, credit) if credit else b""

    def release(self, call: Call, size: int, held: bool = False, due: bool = True) -> bytes:
        """A call's bytes read as they came, dropped (``held`` before) or padding, given back."""
        if held:
            self.buffered -= size
        out = self.give_back(size)
        call.recv_credit += size
        if due and call.recv_credit >= self._stream_at:
            out += self.announce_stream(call)
        return out

    def received(self, call: Call, n: int, taken: int) -> bytes:
        """``n`` bytes of DATA cut into messages, ``taken`` of them by a waiting read; what
        was read goes back at once for an incomplete message, so that it can complete."""
        self.buffered += n - taken
        call.held += n - taken
        out = b""
        if taken:  # read as it came: given back as ``read`` does
            self.credit += taken
            if self.credit >= self._at or self.window < self._low:
                out = self.announce()
            call.recv_credit += taken
            if call.recv_credit >= self._stream_at:
                out += self.announce_stream(call)
        if call.failure is None and call.partial.parts:  # (a bad message keeps nothing)
            self.partials[call.id] = call
            need = call.partial_need()
            if need > call.recv_window and call.recv_credit:
                out += self.announce_stream(call)
            if need > self.window and self.credit:
                out += self.announce()
        elif self.partials:
            self.partials.pop(call.id, None)
        return out

    def read(self, call: Call, size: int) -> bytes:
        """A method read a message of ``size`` bytes."""
        self.buffered -= size
        call.held -= size
        self.credit += size
        out = self.announce() if self.credit >= self._at or self.window < self._low else b""
        if not call.eof and not call.reset:
            call.recv_credit += size
            if call.recv_credit >= self._stream_at or call.partial.parts:
                out += self.announce_stream(call)
        return out

    def ended(self, call: Call) -> None:  # the client ended it: nothing incomplete completes
        self.partials.pop(call.id, None)

    def forget(self, call: Call) -> bytes:  # the call is over: what it held goes back
        if self.partials:
            self.partials.pop(call.id, None)
        held = call.drop_input()
        self.buffered -= held
        return self.give_back(held) if held else b""

    def stalled(self) -> Call | None:
        """The oldest incomplete call if none can complete and no complete message waits to be
        read (reading it gives window back): nothing can move."""
        partial_bytes = 0
        for call in self.partials.values():
            need = call.partial_need()
            if need <= self.window and need <= call.recv_window + call.recv_credit:
                return None  # it can finish
            partial_bytes += call.partial.have
        return None if self.buffered > partial_bytes else next(iter(self.partials.values()))

    def victim(self) -> Call | None:
        """In a stall, the newest incomplete call, while the oldest cannot complete."""
        partials = self.partials
        if len(partials) < 2:
            return None
        oldest = next(iter(partials.values()))
        need = oldest.partial_need()
        if need <= self.window and need <= oldest.recv_window + oldest.recv_credit:
            return None
        return next(reversed(partials.values()))

    def clear(self) -> None:
        self.partials.clear()
        self.buffered = 0


class Outbound:
    """The send windows, what waits for them (calls' ``send_delta``, ``pending``, ``closed``)."""

    __slots__ = ("_max_frame", "_peer_window", "blocked", "flush_wanted", "queued", "window")

    def __init__(self) -> None:
        self.window = frames.DEFAULT_WINDOW  # the connection's
        self._peer_window = frames.DEFAULT_WINDOW  # SETTINGS_INITIAL_WINDOW_SIZE
        self._max_frame = frames.DEFAULT_FRAME  # SETTINGS_MAX_FRAME_SIZE
        self.blocked: dict[int, Call] = {}  # calls with DATA waiting for window, in order
        self.queued = 0
        self.flush_wanted = False

    def settings(self, payload: bytes) -> None:
        """The peer's SETTINGS (checked by ``control.Control.settings``)."""
        for ident, value in frames.SETTING.iter_unpack(payload):
            if ident == frames.S_INITIAL_WINDOW_SIZE:
                if value > self._peer_window and self.blocked:
                    self.flush_wanted = True
                self._peer_window = value
            elif ident == frames.S_MAX_FRAME_SIZE:
                self._max_frame = value

    def opened(self, increment: int) -> None:  # WINDOW_UPDATE for the connection
        self.window += increment
        if self.window > frames.MAX_WINDOW:
            raise ConnectionFailure(frames.FLOW_CONTROL_ERROR, "flow control", "window overflow")
        if self.blocked:
            self.flush_wanted = True

    def stream_opened(self, call: Call, increment: int) -> int:
        """A WINDOW_UPDATE for a call's stream: 0, or the stream error it is."""
        if not increment:
            return frames.PROTOCOL_ERROR
        if self._peer_window + call.send_delta + increment > frames.MAX_WINDOW:
            return frames.FLOW_CONTROL_ERROR
        call.send_delta += increment
        return 0

    def message(self, call: Call, payload: bytes) -> bytes:
        """A gRPC message on an open call (the response headers first if they have not gone)."""
        n = len(payload)
        data = PREFIX.pack(0, n) + payload
        head = b""
        if not call.headers_sent:
            call.headers_sent = True
            head = frame(frames.HEADERS, frames.END_HEADERS, call.id, RESPONSE_HEADERS)
        size = n + 5
        if (
            not call.pending
            and size <= self.window
            and size <= self._peer_window + call.send_delta
            and size <= self._max_frame
        ):
            self.window -= size
            call.send_delta -= size
            return head + HEADER.pack(size >> 16, size & 0xFFFF, DATA, 0, call.id) + data
        call.pending.append([data, 0, False])
        self.queued += size
        self.blocked[call.id] = call
        return head + self.flush(call)

    def trailers(self, call: Call, status: bytes) -> bytes:
        """The call's end (``status``: its status block): now, or b"" behind its DATA."""
        block = status if call.headers_sent else RESPONSE_HEADERS + status
        call.headers_sent = True
        call.closed = True
        trailers = frame(frames.HEADERS, frames.END_HEADERS | frames.END_STREAM, call.id, block)
        if call.pending:
            call.pending.append([trailers, 0, True])
            return b""
        return trailers

    def flush(self, call: Call) -> bytes:
        """What the windows now take of the call's waiting output."""
        pending = call.pending
        out = []
        while pending:
            entry = pending[0]
            data, offset, is_frame = entry
            if is_frame:  # the trailers, queued behind data: they need no window
                pending.popleft()
                out.append(data)
                continue
            room = min(self.window, self._peer_window + call.send_delta, self._max_frame)
            if room <= 0:
                break
            chunk = data[offset : offset + room]
            n = len(chunk)
            self.window -= n
            call.send_delta -= n
            self.queued -= n
            out.append(frame(DATA, 0, call.id, chunk))
            if offset + n < len(data):
                entry[1] = offset + n
            else:
                pending.popleft()
        if not pending:
            self.blocked.pop(call.id, None)
        return b"".join(out)

    def flushing(self) -> list[Call]:  # the blocked calls, in the order they got blocked
        self.flush_wanted = False
        return list(self.blocked.values())

    def drop(self, call: Call) -> None:  # the stream is over: forget what waits
        if call.pending:
            for data, offset, is_frame in call.pending:
                if not is_frame:
                    self.queued -= len(data) - offset
            call.pending.clear()
        self.blocked.pop(call.id, None)

    def clear(self) -> None:
        self.blocked.clear()
        self.queued = 0
