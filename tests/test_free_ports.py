"""Ports for the servers a test or a benchmark starts: free, and outside the range the kernel hands to outgoing
connections, so that none of the machine's connections takes one between the pick and the server's bind."""

from __future__ import annotations

import socket

from engine.free_ports import LOWEST, _ephemeral_start, free_port


def test_a_picked_port_is_free_and_below_the_ephemeral_range():
    ports = {free_port() for _ in range(20)}
    assert all(LOWEST <= port < _ephemeral_start() for port in ports)
    assert len(ports) > 1  # picked at random: two picks rarely meet
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))

