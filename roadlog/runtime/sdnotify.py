"""systemd's notify protocol (``Type=notify``), without a dependency: a
datagram to ``$NOTIFY_SOCKET``. Outside systemd (no socket) it does nothing."""

from __future__ import annotations

import os
import socket


def notify(state: str, env: dict[str, str] | None = None) -> bool:
    """Send ``state`` (e.g. "READY=1", "STOPPING=1", "STATUS=...") to
    systemd; False when not run under systemd's notify protocol."""
    path = (env if env is not None else os.environ).get("NOTIFY_SOCKET", "")
    if not path:
        return False
    if path.startswith("@"):  # an abstract socket
        path = "\0" + path[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.connect(path)
            s.sendall(state.encode())
        except OSError:
            return False
    return True
