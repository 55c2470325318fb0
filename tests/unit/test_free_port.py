"""testing.stack.free_port: ports for servers that start later, safe from outgoing connections."""

from __future__ import annotations

import socket

from testing.stack import _ephemeral_start, free_port


def test_ports_are_below_the_ephemeral_range_and_never_repeat() -> None:
    top = _ephemeral_start()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(port < top for port in ports)


def test_an_outgoing_connection_cannot_take_a_handed_out_port() -> None:
    """The CI failure: a client socket's source port equal to a port handed out for a listener."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        clients = [socket.create_connection(server.getsockname()) for _ in range(20)]
        try:
            sources = {c.getsockname()[1] for c in clients}
            assert all(port >= _ephemeral_start() for port in sources)
            assert not sources & {free_port() for _ in range(20)}
        finally:
            for c in clients:
                c.close()
