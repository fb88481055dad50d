"""Local processes and loopback ports: a free port for a daemon to bind,
whether a process is alive, waiting for one to die.

Shared by the tools (the local cluster) and by what starts processes of its
own (the Spark standalone launcher), so neither imports the other.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from pathlib import Path

_LOWEST_PORT = 10000
_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A loopback TCP port that is free now and stays out of the way.

    Invariant: the port lies outside the kernel's ephemeral range, so no
    outgoing connection (of this process or any other) can take it between
    this call and the daemon's bind, which is what a port from bind(0)
    cannot promise; and this process never hands the same port out twice."""
    low, high = _ephemeral_range()
    spans = [(p, q) for p, q in ((_LOWEST_PORT, low - 1), (high + 1, 65535)) if q > p]
    rng = secrets.SystemRandom()
    for _ in range(1000):
        lo, hi = rng.choice(spans)
        port = rng.randint(lo, hi)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError("no free loopback port outside the ephemeral range")


def alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
        if waited == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return True


def wait_dead(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.02)
    return not alive(pid)
