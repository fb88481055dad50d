"""Finding queue servers from their announcements, for clients
(``roadlog ... --discover``): listen on the discovery port for a moment and
keep what is signed with the discovery key (``protocol.discovery_key``: a
client needs that key, not the cluster secret)."""

from __future__ import annotations

import socket
import time

from discovery.protocol import Rejected, ReplayGuard, decode

DEFAULT_PORT = 7499


def find_queue_servers(
    key: bytes,
    cluster: str | None = None,
    port: int = DEFAULT_PORT,
    wait_s: float = 3.0,
) -> list[str]:
    """gRPC addresses of the queue servers heard within ``wait_s`` (sooner
    once one was heard and a full announcement interval passed)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", port))
    found: dict[str, str] = {}  # address -> cluster
    guard = ReplayGuard()
    deadline = time.monotonic() + wait_s
    first = 0.0
    try:
        while time.monotonic() < deadline and not (first and time.monotonic() - first > 1.2):
            sock.settimeout(max(0.05, deadline - time.monotonic()))
            try:
                data, _ = sock.recvfrom(2048)
            except TimeoutError:
                break
            try:
                h = decode(data, key, cluster, int(time.time() * 1000), guard)
            except Rejected:
                continue
            if h.role == "queue":
                found[h.address] = h.cluster
                first = first or time.monotonic()
    finally:
        sock.close()
    if len(set(found.values())) > 1:
        names = ", ".join(sorted(set(found.values())))
        raise ValueError(f"queue servers of several clusters answer ({names}): name one")
    return sorted(found)
