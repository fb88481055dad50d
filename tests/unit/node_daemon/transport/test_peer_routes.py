"""Groups a peer runs in other processes (worker processes, docs/multiraft.md
step 5): a sender learns from the peer's main process which port runs each
group (``FramesEndpointReply.group_ports``) and sends each group's messages
there; a worker that restarts elsewhere is found again; a peer that names
no group ports gets every group at its main address, as before."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from node_daemon.raft import Message
from node_daemon.transport.peer_transport import GroupEndpoint, PeerTransport, with_port
from roadlog.v1 import raft_pb2_grpc
from tests.unit.node_daemon.transport.peer_transports import peer_transport
from tests.unit.node_daemon.transport.test_peer_frames import _append
from tests.unit.support.loops import run_bounded, until

pytestmark = pytest.mark.unit


async def no_snapshot(index: int, term: int) -> Path | None:
    """No snapshot here (these transports only receive)."""
    return None


SECRET = b"r" * 32
CLUSTER = "routes-test"


def _endpoint(got: list[Message], tmp: Path) -> GroupEndpoint:
    return GroupEndpoint(got.append, lambda to: None, lambda to, ok: None, no_snapshot, tmp)


async def _serve(t: PeerTransport, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    raft_pb2_grpc.add_RaftPeerServicer_to_server(t, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    assert await t.start_frames("127.0.0.1", 0) > 0
    return server, bound


async def _keep_sending(
    send: list[tuple[PeerTransport, int, Message]], arrived: list[list[Message]], what: str
) -> None:
    """Send until each message arrived where it should (the first may go to
    the peer's main process before the sender learnt its group ports, and
    be dropped there: Raft sends again, as this does)."""
    deadline = asyncio.get_running_loop().time() + 15
    while not all(m in got for (_, _, m), got in zip(send, arrived, strict=True)):
        assert asyncio.get_running_loop().time() < deadline, f"never arrived: {what}"
        for t, group, m in send:
            t.send([m], group=group)
        await asyncio.sleep(0.05)


def test_each_group_goes_to_the_process_that_runs_it_on_the_peer(tmp_path: Path) -> None:
    async def body() -> None:
        got0: list[Message] = []  # node 2's main process: group 0
        got_w: dict[int, list[Message]] = {1: [], 2: []}  # node 2's worker: groups 1, 2
        main = peer_transport(2, CLUSTER, SECRET, tmp_path, got0)
        worker = PeerTransport.bare(2, CLUSTER, SECRET)
        assert worker.groups == {}
        for g in (1, 2):
            worker.add_group(g, _endpoint(got_w[g], tmp_path))
        main_server, main_port = await _serve(main)
        worker_server, worker_port = await _serve(worker)
        main.set_group_ports({1: worker_port, 2: worker_port})
        # Node 1 runs every group in one process.
        sender = peer_transport(1, CLUSTER, SECRET, tmp_path, [])
        sender.add_group(1, _endpoint([], tmp_path))
        sender.add_group(2, _endpoint([], tmp_path))
        sender.set_addresses({2: f"127.0.0.1:{main_port}"})
        try:
            m0, m1, m2 = _append(1, 2, 1), _append(1, 2, 2), _append(1, 2, 3)
            await _keep_sending(
                [(sender, 0, m0), (sender, 1, m1), (sender, 2, m2)],
                [got0, got_w[1], got_w[2]],
                "groups 0, 1 and 2",
            )
            assert sender.routes[2] == {1: worker_port, 2: worker_port}
            assert sender.address_of(2, 1) == f"127.0.0.1:{worker_port}"
            assert sender.address_of(2, 0) == f"127.0.0.1:{main_port}"
            # One link per peer process: the worker's groups share one.
            assert sorted(addr for _, addr in sender.peers) == sorted(
                {f"127.0.0.1:{main_port}", f"127.0.0.1:{worker_port}"}
            )
            # Nothing of groups 1 and 2 is handed to group 0, or the reverse.
            assert all(m.entries[0].index == 1 for m in got0)
            assert all(m.entries[0].index == 2 for m in got_w[1])
            assert all(m.entries[0].index == 3 for m in got_w[2])
        finally:
            await sender.close()
            for t, s in ((main, main_server), (worker, worker_server)):
                await t.close()
                await s.stop(None)

    run_bounded(body)


def test_a_worker_that_restarts_elsewhere_is_found_again(tmp_path: Path) -> None:
    """The sender is itself a worker (runs no group 0): its messages reach
    the peer's worker, then, once that worker restarted on other ports and
    the peer's main process says so, the new one."""

    async def body() -> None:
        main = peer_transport(2, CLUSTER, SECRET, tmp_path, [])
        main_server, main_port = await _serve(main)
        got_old: list[Message] = []
        old = PeerTransport.bare(2, CLUSTER, SECRET)
        old.add_group(1, _endpoint(got_old, tmp_path))
        old_server, old_port = await _serve(old)
        main.set_group_ports({1: old_port})
        sender = PeerTransport.bare(1, CLUSTER, SECRET)
        sender.add_group(1, _endpoint([], tmp_path))
        sender.set_addresses({2: f"127.0.0.1:{main_port}"})
        new: PeerTransport | None = None
        new_server: grpc.aio.Server | None = None
        try:
            await _keep_sending([(sender, 1, _append(1, 2, 1))], [got_old], "the first worker")
            # The worker dies and comes back on other ports.
            await old.close()
            await old_server.stop(None)
            got_new: list[Message] = []
            new = PeerTransport.bare(2, CLUSTER, SECRET)
            new.add_group(1, _endpoint(got_new, tmp_path))
            new_server, new_port = await _serve(new)
            assert new_port != old_port
            main.set_group_ports({1: new_port})
            await _keep_sending([(sender, 1, _append(1, 2, 2))], [got_new], "the new worker")
            assert sender.routes[2] == {1: new_port}
            # The link to the dead worker is gone, and none goes to the main
            # process: this sender runs no group there.
            assert [addr for _, addr in sender.peers] == [f"127.0.0.1:{new_port}"]
        finally:
            await sender.close()
            await main.close()
            await main_server.stop(None)
            if new is not None and new_server is not None:
                await new.close()
                await new_server.stop(None)

    run_bounded(body)


def test_a_peer_without_group_ports_gets_every_group_at_its_main_address(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        got: dict[int, list[Message]] = {0: [], 4: []}
        peer = peer_transport(2, CLUSTER, SECRET, tmp_path, got[0])
        peer.add_group(4, _endpoint(got[4], tmp_path))
        server, port = await _serve(peer)
        sender = peer_transport(1, CLUSTER, SECRET, tmp_path, [])
        sender.add_group(4, _endpoint([], tmp_path))
        sender.set_addresses({2: f"127.0.0.1:{port}"})
        try:
            m0, m4 = _append(1, 2, 1), _append(1, 2, 2)
            sender.send([m0])
            sender.send([m4], group=4)
            await until(lambda: got[0] == [m0] and got[4] == [m4], "both, first time")
            await until(lambda: 2 in sender.routes, "the peer's answer")
            assert sender.routes[2] == {}
            assert [addr for _, addr in sender.peers] == [f"127.0.0.1:{port}"]
        finally:
            await sender.close()
            await peer.close()
            await server.stop(None)

    run_bounded(body)


def test_with_port() -> None:
    assert with_port("10.0.0.1:7000", 7100) == "10.0.0.1:7100"
    assert with_port("[::1]:7000", 7100) == "[::1]:7100"
    assert with_port("node-3.example:7000", 1) == "node-3.example:1"


def test_a_group_whose_worker_is_not_listening_yet_waits_for_it(tmp_path: Path) -> None:
    """The peer's main process says its worker for group 1 is not listening
    yet (port 0): group 1's messages are not sent to the main process (which
    would drop them, and the sender would never ask again while that link
    is up), and once the worker listens the sender finds it."""

    async def body() -> None:
        got0: list[Message] = []
        main = peer_transport(2, CLUSTER, SECRET, tmp_path, got0)
        main_server, main_port = await _serve(main)
        main.set_group_ports({1: 0})
        sender = peer_transport(1, CLUSTER, SECRET, tmp_path, [])
        sender.add_group(1, _endpoint([], tmp_path))
        sender.set_addresses({2: f"127.0.0.1:{main_port}"})
        worker: PeerTransport | None = None
        worker_server: grpc.aio.Server | None = None
        try:
            m0 = _append(1, 2, 1)
            await _keep_sending([(sender, 0, m0)], [got0], "group 0")
            await until(lambda: sender.routes.get(2) == {1: 0}, "the peer's answer")
            dropped = sender.dropped
            sender.send([_append(1, 2, 2)], group=1)
            assert sender.dropped == dropped + 1 and sender.address_of(2, 1) is None
            assert main.rejected == 0  # nothing of group 1 reached the main process
            got1: list[Message] = []
            worker = PeerTransport.bare(2, CLUSTER, SECRET)
            worker.add_group(1, _endpoint(got1, tmp_path))
            worker_server, worker_port = await _serve(worker)
            main.set_group_ports({1: worker_port})
            await _keep_sending([(sender, 1, _append(1, 2, 3))], [got1], "the worker, once up")
            assert main.rejected == 0
        finally:
            await sender.close()
            await main.close()
            await main_server.stop(None)
            if worker is not None and worker_server is not None:
                await worker.close()
                await worker_server.stop(None)

    run_bounded(body)
