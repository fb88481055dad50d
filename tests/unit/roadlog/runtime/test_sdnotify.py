"""systemd notify messages reach the socket systemd names, and nothing
happens outside systemd."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from roadlog.runtime.sdnotify import notify

pytestmark = pytest.mark.unit


def test_notify_sends_to_the_named_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as srv:
        srv.bind(path)
        srv.settimeout(5)
        assert notify("READY=1", {"NOTIFY_SOCKET": path})
        assert srv.recv(64) == b"READY=1"


def test_without_systemd_nothing_is_sent() -> None:
    assert not notify("READY=1", {})
    assert not notify("READY=1", {"NOTIFY_SOCKET": "/nonexistent/socket"})
