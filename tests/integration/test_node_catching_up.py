"""A node that starts with an empty log among static peers catches up
before it votes, and keeps doing so across restarts until that is over
(node_daemon/replica/replica.py; issue 21, nemesis finding 2). In this process, LMDB
on disk; the peer it would ask never answers."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from node_daemon.config import NodeConfig
from node_daemon.raft import Role
from node_daemon.replica.catching_up import CATCHING_UP_FILE
from node_daemon.replica.replica import Replica
from roadlog.runtime.processes import free_port

pytestmark = pytest.mark.integration


def _started_and_stopped(cfg: NodeConfig) -> tuple[bool, Role]:
    """Whether the node was catching up, and its role, once it has led or
    has ticked through four of the longest election timeouts."""

    async def main() -> tuple[bool, Role]:
        node = Replica(cfg)
        ticks = [0]
        tick = node.core.tick

        def counted() -> None:
            ticks[0] += 1
            tick()

        node.core.tick = counted  # type: ignore[method-assign]
        await node.start()
        try:
            deadline = time.monotonic() + 30
            while not node.is_leader and ticks[0] < 4 * 2 * cfg.election_ticks:
                assert time.monotonic() < deadline, "the node did not tick"
                await asyncio.sleep(0.01)
            return node.core.catching_up, node.core.role
        finally:
            await node.stop()

    return asyncio.run(main())


def test_an_empty_node_with_peers_neither_campaigns_nor_forgets_it_on_restart(
    tmp_path: Path,
) -> None:
    me, silent = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    cfg = NodeConfig(
        node_id=1, data_dir=tmp_path / "n1", listen=me, peers={1: me, 2: silent}, tick_ms=10
    )
    marker = tmp_path / "n1" / "raft" / CATCHING_UP_FILE
    assert _started_and_stopped(cfg) == (True, Role.FOLLOWER)
    assert marker.exists()
    # Bootstrapped now (its log is not empty), and still catching up.
    assert _started_and_stopped(cfg) == (True, Role.FOLLOWER)
    assert marker.exists()


def test_a_one_node_cluster_starts_voting(tmp_path: Path) -> None:
    me = f"127.0.0.1:{free_port()}"
    cfg = NodeConfig(node_id=1, data_dir=tmp_path / "n1", listen=me, peers={1: me}, tick_ms=10)
    assert _started_and_stopped(cfg) == (False, Role.LEADER)
    assert not (tmp_path / "n1" / "raft" / CATCHING_UP_FILE).exists()
