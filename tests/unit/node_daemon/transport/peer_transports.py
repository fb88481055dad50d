"""A PeerTransport for the tests that run Raft traffic between two of them
(framed links, TLS identities): what reaches it is collected in ``got``;
unreachable peers, snapshot reports and snapshot files are not what those
tests are about."""

from __future__ import annotations

from pathlib import Path

from node_daemon.raft import Message
from node_daemon.transport.peer_transport import PeerTransport


async def no_snapshot(index: int, term: int) -> Path | None:
    """No snapshot here (these transports only receive)."""
    return None


def peer_transport(
    node_id: int, cluster: str, secret: bytes, tmp: Path, got: list[Message]
) -> PeerTransport:
    return PeerTransport(
        node_id,
        cluster,
        secret,
        tmp / f"snap{node_id}",
        on_message=got.append,
        on_unreachable=lambda to: None,
        on_snapshot_status=lambda to, ok: None,
        snapshot_file=no_snapshot,
    )
