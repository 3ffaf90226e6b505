"""Free TCP ports for the servers and rendezvous this machine starts, picked below the kernel's ephemeral range.

A port found free by binding port 0 comes from the ephemeral range, which the kernel also hands to the local end
of every outgoing connection; between the pick and the server's own bind, one of the machine's many connections
(Ray's processes open dozens) may take it, and the server then fails with "address already in use". A port below
that range is never handed out that way, so only another pick could take it. Ray's workers listen on 10002-19999
by default, so picks start above them.
"""

from __future__ import annotations

import secrets
import socket
from pathlib import Path

LOWEST = 20000
TRIES = 64


def free_port(host: str = "127.0.0.1") -> int:
    """A port of `host` that nothing listens on now, below the ephemeral range where the machine has room there."""
    highest = _ephemeral_start() - 1
    for _ in range(TRIES if highest > LOWEST else 0):
        port = LOWEST + secrets.randbelow(highest - LOWEST + 1)
        if _bindable(host, port):
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux); IANA's 49152 elsewhere."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
