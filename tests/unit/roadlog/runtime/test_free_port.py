"""free_port hands out loopback ports that outgoing connections cannot take."""

from __future__ import annotations

import socket

import pytest

from roadlog.runtime.processes import _ephemeral_range, free_port

pytestmark = pytest.mark.unit


def test_ports_lie_outside_the_ephemeral_range_and_are_never_repeated() -> None:
    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(not low <= p <= high for p in ports)
    assert all(1024 < p <= 65535 for p in ports)


def test_a_handed_out_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        assert s.getsockname()[1] == port
