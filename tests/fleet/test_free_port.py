"""Ports for processes that bind them later (the fleet's engines, a process group's rendezvous): drawn below the kernel's ephemeral range, where no outgoing connection's local
end can take one between the draw and the engine's bind."""

from __future__ import annotations

import socket

from specfleet.engine.ports import PORT_FLOOR, ephemeral_floor, free_port


def test_a_free_port_is_below_the_ephemeral_range_and_bindable():
    ceiling = ephemeral_floor()
    assert ceiling > PORT_FLOOR  # Linux's default range starts at 32768; this host's too
    ports = {free_port() for _ in range(20)}
    assert all(PORT_FLOOR <= p < ceiling for p in ports)
    assert len(ports) > 1  # drawn, not one fixed port every process would race for
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_someone_listens_on_is_never_drawn():
    ceiling = ephemeral_floor()
    taken = []
    try:
        for port in range(PORT_FLOOR, ceiling, 37):  # a listener on every 37th port (~350 sockets)
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            s.listen()
            taken.append(s)
        held = {s.getsockname()[1] for s in taken}
        # unchecked, 200 draws would land on one with probability 1 - (36/37)^200 > 0.99
        assert held and not any(free_port() in held for _ in range(200))
    finally:
        for s in taken:
            s.close()
