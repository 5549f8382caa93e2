"""Loopback ports for a process that binds them itself later (an engine server, a process group's
rendezvous): drawn below the kernel's ephemeral range, from which every outgoing connection takes its local
port, so a port found free here is not taken by one between the draw and the bind. (A port picked by
binding 0 and closing lies in that range: an outgoing connection took one in a `specfleet up` fleet's start.)
A server that binds its own port should bind 0 and read the kernel's choice back instead."""

from __future__ import annotations

import secrets
import socket
from pathlib import Path

PORT_FLOOR = 20000  # the draw's lowest port: above the registered services most hosts run
PORT_TRIES = 64  # draws before the kernel's choice: a range this wide is never that full


def ephemeral_floor() -> int:
    """The lowest port the kernel gives outgoing connections (Linux's default 32768 where unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on: drawn below the ephemeral range where there is room there, else the
    kernel's choice."""
    with socket.socket() as s:
        ceiling = ephemeral_floor()
        for _ in range(PORT_TRIES if ceiling > PORT_FLOOR else 0):
            port = secrets.randbelow(ceiling - PORT_FLOOR) + PORT_FLOOR
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
        s.bind((host, 0))
        return int(s.getsockname()[1])
