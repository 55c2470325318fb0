"""A small gRPC server on asyncio: HTTP/2 framing written for the sidecar's two services.

Why not grpc.aio: profiling the sidecar under load when it ran on grpc.aio (docs/performance.md,
"Conclusions from earlier measurements") put ~85% of its CPU in grpc.aio's machinery (the
completion-queue poller thread, the hops between it and the event loop, per-call objects), not
in admission. Envoy is the only client that matters and it speaks plain gRPC over HTTP/2 on
long-lived connections, one stream per HTTP request. This package implements exactly that server
side, on the event loop's own transports (uvloop when installed), with no threads. ``H2Server``
is its entry point: it serves a table of methods (``Method``), each given a ``Call`` to ``await
read()`` (a message, or ``EOF`` once the client half-closed) and ``await write(msg)``; a method
ends its call by returning or by raising ``CallAbort`` (a gRPC status); a stream reset by the
client, or a connection lost, cancels the method's task, as grpc.aio does.

What it does not do, by design: server push, priorities (ignored), compressed messages
(refused with UNIMPLEMENTED), HTTP/1.1. grpc.aio serves the same servicer in the tests, as
their oracle (``testing/grpc_aio.py``).

The modules, from the bytes up (python-hyper's h11 and h2 are the model: a protocol state
machine that does no I/O, and a thin shell that does):

* ``frames``: frame types, flags, error codes, settings; building a frame; ``ConnectionFailure``.
* ``headers``: header blocks: the scan before decoding, HPACK decoding with the connection's
  cache, which requests are gRPC, and the blocks we send (response headers, trailers).
* ``limits``: every bound, its value and why (``H2Limits``, constants, ``Budget``, ``Counters``).
* ``call``: gRPC on a stream: length-prefixed messages, and the ``Call`` a method is given.
* ``connection``: the sans-IO connection: bytes in (``receive_data``, with the time), cut into
  frames; frames out and events as calls on its host, in the order they happen. It owns parts
  that do no I/O and do not know it: ``session`` (the calls, the output, the ends), ``flow``
  (the windows both ways), ``control`` (SETTINGS, PING, token buckets, timers).
* ``idle``: which connection a newcomer displaces at ``max_connections`` (``IdleOrder``).
* ``server``: the asyncio shell: ``H2Server`` (listeners, the tick, stop) and one
  ``ServerProtocol`` per connection, the host: it feeds its ``Connection``, writes what it is
  given, owns the timers and runs each call's method as a task.

Theory of operation: a hostile peer. The peer is meant to be Envoy, but the server must hold
whatever a broken or hostile HTTP/2 client sends. Every resource a peer can make us spend is
bounded by a constant of ``limits`` or an ``H2Server`` parameter (docs/transport.md: why each):

* Memory in: a stream may send at most one message beyond what its method has read (the
  stream window, ``max_message`` + 5), a connection at most ``connection_window`` bytes.
  Bytes are credited back (WINDOW_UPDATE) only when a method reads the message they carried,
  or when the stream ends: we buffer exactly what the windows allow; bytes beyond a window are
  a FLOW_CONTROL_ERROR. A window full of incomplete messages that none can complete would stop
  everything: the newest is then ended (RESOURCE_EXHAUSTED) until the oldest can (``flow``).
* Memory out: bytes waiting for the peer's window, and bytes the transport holds because the
  peer does not read, are each bounded by ``send_queue`` (ENHANCE_YOUR_CALM above it); above
  the transport's high-water mark we stop reading the peer, so it cannot make us produce more.
* Headers: a HEADERS frame and a whole header block are at most ``MAX_HEADER_BLOCK`` bytes,
  checked from the frame header; a block is scanned before it is decoded, so decoding is
  bounded per block; cached blocks are ``HEADER_CACHE_BYTES`` in all (``headers``).
* CPU: no frame costs work proportional to the number of calls, frames that do nothing useful
  or make us answer are rate-limited per connection (``control``), and the work per read is
  bounded (``SLICE_WORK``, ``connection``): the rest waits for the next turn of the loop.
* Time and connections: the handshake, idle connections and silent peers have timeouts; TCP
  keepalive finds peers that vanished without a FIN; at most ``max_connections`` connections
  (a newcomer beyond it displaces one that no call keeps in place, least recently used, so
  silent strangers cannot keep Envoy out: ``idle``; a call keeps its connection once its first
  message arrived, a watch never) and ``max_streams`` calls per connection (REFUSED_STREAM).
* Nothing the peer sent is echoed: errors carry fixed messages, a ``grpc-message`` is at most
  ``MAX_GRPC_MESSAGE`` bytes, GOAWAY debug data is a fixed short string per error (the detail
  goes to our log), and no frame we send exceeds the peer's SETTINGS_MAX_FRAME_SIZE.
"""

from extproc.transport.h2.call import EOF, Call, CallAbort, Method, StatusCode
from extproc.transport.h2.connection import Connection
from extproc.transport.h2.headers import modifies_table
from extproc.transport.h2.limits import H2Limits
from extproc.transport.h2.server import H2Server, H2Stats

__all__ = [
    "EOF",
    "Call",
    "CallAbort",
    "Connection",
    "H2Limits",
    "H2Server",
    "H2Stats",
    "Method",
    "StatusCode",
    "modifies_table",
]
