"""A node process's gRPC port is its own: one another process (or server)
holds is refused, never shared (SO_REUSEPORT would split the connections
meant for one node's worker between two nodes on one host)."""

from __future__ import annotations

import pytest

from node_daemon.process.grpc_server import node_grpc_server
from roadlog.runtime.processes import free_port
from tests.unit.support.loops import run_bounded

pytestmark = pytest.mark.unit


def test_a_port_in_use_is_refused_not_shared() -> None:
    async def body() -> None:
        port = free_port()
        first = node_grpc_server("t")
        assert first.add_insecure_port(f"127.0.0.1:{port}") == port
        await first.start()
        second = node_grpc_server("t")
        try:
            try:
                bound = second.add_insecure_port(f"127.0.0.1:{port}")
            except RuntimeError:
                bound = 0
            assert bound == 0
        finally:
            await first.stop(None)
            await second.stop(None)

    run_bounded(body)
