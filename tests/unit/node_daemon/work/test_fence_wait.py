"""Index chatter between nodes and a queue server: a node tells its applied
index promptly only while reads wait for it there (``FenceWait``), now and
then otherwise; role moves at once; a full NodeStatus only on the messages
that carry it."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from node_daemon.raft import ConfState, Role
from node_daemon.work import queue_link
from node_daemon.work.handler import WorkHandler
from node_daemon.work.queue_link import INDEX_IDLE_S, QueueServerLink
from queue_server.config import QueueConfig
from queue_server.outgoing import Outgoing
from queue_server.queues import READS_FLOWING_S, Item, Kind, WorkQueues
from queue_server.server import QueueServer
from roadlog.limits import WORK_BATCH_BYTES
from roadlog.v1 import client_pb2, clients_pb2, work_pb2

pytestmark = pytest.mark.unit
_ids = itertools.count(1)


def _read(fence: int) -> Item:
    return Item(next(_ids), Kind.READ, "Fetch", b"", 1e12, 0.0, fence, client="c")


# ------------------------------------------------------------- WorkQueues


def test_the_awaited_fence_is_the_highest_no_worker_has_told() -> None:
    q = WorkQueues()
    q.connect(1, 1)
    q.connect(2, 2)
    q.update(1, False, 1, applied=10)
    q.update(2, False, 1, applied=4)
    assert q.awaited_fence() == 0  # no read queued
    q.submit(_read(8))  # node 1 has it (no read credit, but no fence to wait for)
    assert q.awaited_fence() == 0
    q.submit(_read(12))
    q.submit(_read(15))
    assert q.awaited_fence() == 15
    q.update(1, False, 1, applied=15)
    assert q.awaited_fence() == 0


def test_only_clients_fenced_reads_make_reads_flowing(tmp_path: Path) -> None:
    """The queue server's own fenced reads (each connecting client's
    Authenticate) do not have every leader tell each commit at once."""

    async def main() -> None:
        qs = _server(tmp_path)
        _session(qs, 1, 5, leader=True)
        req = clients_pb2.AuthenticateRequest(token_hash=b"h" * 32, min_applied_index=5)
        call = asyncio.ensure_future(qs.call("Authenticate", req.SerializeToString(), 5.0))
        await until_queued(qs)
        [queued] = list(qs.q.queues[Kind.READ])
        assert queued.fence == 5 and queued.own
        assert not qs.q.reads_flowing(time.monotonic())
        read = _read(5)  # a client's
        read.enqueued = time.monotonic()
        qs.q.submit(read)
        assert qs.q.reads_flowing(time.monotonic())
        call.cancel()

    asyncio.run(main())


async def until_queued(qs: QueueServer) -> None:
    for _ in range(100):
        if qs.q.depth(Kind.READ):
            return
        await asyncio.sleep(0)
    raise AssertionError("the call was never queued")


# ------------------------------------------------------------- QueueServer


def _server(tmp_path: Path) -> QueueServer:
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    return QueueServer(QueueConfig(secret_file=secret))


def _drain(q: asyncio.Queue[Any]) -> list[Any]:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def _session(qs: QueueServer, wid: int, applied: int, leader: bool = False) -> asyncio.Queue[Any]:
    q: asyncio.Queue[Any] = asyncio.Queue()
    qs._sessions[wid] = q
    qs._fence_told[wid] = (0, False)
    qs.q.connect(wid, wid)
    qs.q.update(wid, leader, 1, applied=applied)
    return q


def test_the_queue_server_asks_for_a_fence_only_while_reads_wait_for_it(tmp_path: Path) -> None:
    async def main() -> None:
        qs = _server(tmp_path)
        sessions = {wid: _session(qs, wid, 5, leader=wid == 1) for wid in (1, 2)}
        qs._kick()
        assert not _drain(sessions[1]) and not _drain(sessions[2])  # nothing waits: silence

        qs.q.submit(_read(9))  # no read credit, and no node told 9 yet
        qs.q.fenced_read_at = float("-inf")  # (not "lately": see the next test)
        qs._kick()
        for wid in (1, 2):
            [fw] = _drain(sessions[wid])
            assert isinstance(fw, work_pb2.FenceWait) and fw.index == 9 and not fw.reads
        qs._kick()
        assert not _drain(sessions[1]) and not _drain(sessions[2])  # told once

        # Node 1 tells 9: it stops by itself; node 2 still hurries, which is
        # no harm, and is told only once nothing waits for it any more.
        qs.q.update(1, True, 1, applied=9)
        qs._kick()
        assert not _drain(sessions[1])
        [fw] = _drain(sessions[2])
        assert fw.index == 0

        # A read nobody can reach is dropped: the nodes asked are told 0.
        qs.q.submit(_read(100))
        qs.q.fenced_read_at = float("-inf")
        qs._kick()
        assert [m.index for m in _drain(sessions[1])] == [100]
        assert [m.index for m in _drain(sessions[2])] == [100]
        qs.q.queues[Kind.READ].remove_if(lambda it: True)
        qs._expire(0.0)
        assert [m.index for m in _drain(sessions[1])] == [0]
        assert [m.index for m in _drain(sessions[2])] == [0]

    asyncio.run(main())


def test_while_fenced_reads_come_in_every_node_is_asked_to_hurry(tmp_path: Path) -> None:
    async def main() -> None:
        qs = _server(tmp_path)
        sessions = {wid: _session(qs, wid, 5, leader=wid == 1) for wid in (1, 2)}
        qs.q.grant(1, 0, 10)
        read = _read(5)
        read.enqueued = time.monotonic()
        qs.q.submit(read)  # served at once: it does not wait, but the next may
        qs._kick()
        out = {wid: _drain(sessions[wid]) for wid in (1, 2)}
        assert [m.id for m in out[1] if isinstance(m, Outgoing)] == [read.id]
        for wid in (1, 2):
            [fw] = [m for m in out[wid] if isinstance(m, work_pb2.FenceWait)]
            assert fw.reads and fw.index == 0
        qs._kick()
        assert not _drain(sessions[1]) and not _drain(sessions[2])  # told once
        qs.q.submit(_read(0))  # unfenced reads need no hurry
        qs.q.fenced_read_at -= READS_FLOWING_S  # none came in lately
        qs._expire(time.monotonic())
        for wid in (1, 2):
            [fw] = _drain(sessions[wid])
            assert not fw.reads

    asyncio.run(main())


# ---------------------------------------------------------- QueueServerLink


class _Node:
    """What QueueServerLink reads of a Replica."""

    def __init__(self) -> None:
        self.id = 1
        self.group = 0
        self.cfg = SimpleNamespace(address="n1:1")
        self.core = SimpleNamespace(
            role=Role.FOLLOWER,
            lead=2,
            term=3,
            log=SimpleNamespace(committed=0),
            conf=ConfState(frozenset({1, 2, 3})),
            conf_index=1,
            catching_up=False,
        )
        self.sm = SimpleNamespace(applied_index=0)

    @property
    def is_leader(self) -> bool:  # as a Replica's: its core's role
        return bool(self.core.role == Role.LEADER)

    @is_leader.setter
    def is_leader(self, leads: bool) -> None:
        self.core.role = Role.LEADER if leads else Role.FOLLOWER

    def address_of(self, node: int) -> str:
        return f"n{node}:1"

    def apply(self, index: int) -> None:
        self.core.log.committed = max(self.core.log.committed, index)
        self.sm.applied_index = index


class _Handler:
    """What QueueServerLink tells the WorkHandler."""

    def __init__(self) -> None:
        self.flowing: list[bool] = []

    def reads_flowing(self, link: object, on: bool) -> None:
        self.flowing.append(on)


class _Clock:
    """The links' clock in these tests: it moves only in ``_settle``, so
    that what a test does between two waits takes no time for the link (on
    a loaded machine real time could pass INDEX_EVERY_S there). Timers still
    wait on the event loop, as long as the clock moved."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


_CLOCK = _Clock()


def _link(monkeypatch: pytest.MonkeyPatch) -> tuple[QueueServerLink, _Node, list[int]]:
    monkeypatch.setattr(_CLOCK, "now", 1000.0)
    monkeypatch.setattr(queue_link, "_clock", _CLOCK)
    built: list[int] = []

    def status(n: Any, figures: Any = None) -> client_pb2.NodeStatus:
        built.append(n.sm.applied_index)
        return client_pb2.NodeStatus(id=n.id)

    monkeypatch.setattr(queue_link, "node_status", status)
    node = _Node()
    link = QueueServerLink("q:1", node, _Handler(), "t")  # type: ignore[arg-type]
    link.connected = True
    link._told_state(link.state())  # a new stream's first word
    return link, node, built


def _sent(link: QueueServerLink) -> list[work_pb2.WorkerState]:
    return [m.state for m in _drain(link.outbox) if m.HasField("state")]


async def _settle(seconds: float) -> None:
    """Let ``seconds`` pass, for the link's clock and for its timers."""
    _CLOCK.now += seconds
    await asyncio.sleep(seconds)


def test_without_waiting_reads_indexes_go_now_and_then_without_a_status_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def main() -> None:
        link, node, built = _link(monkeypatch)
        link.fence_wait(0, False)  # this queue server tells fences: none waits
        built.clear()
        for i in range(1, 50):
            node.apply(i)
            link.state_changed()
        assert not _sent(link) and not built  # nothing yet, and no status built for nothing
        await _settle(INDEX_IDLE_S + 0.05)
        [st] = _sent(link)
        assert st.applied_index == 49 and st.commit_index == 49
        assert len(built) <= 1  # at most one status, on the message that carries it

    asyncio.run(main())


def test_a_waiting_read_makes_the_node_tell_its_fence_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def main() -> None:
        link, node, built = _link(monkeypatch)
        link.fence_wait(0, False)
        node.apply(3)
        link.state_changed()
        assert not _sent(link)
        link.fence_wait(7, False)  # a read waits for 7: what we have goes promptly
        await _settle(queue_link.INDEX_EVERY_S + 0.02)
        [st] = _sent(link)
        assert st.applied_index == 3
        built.clear()
        node.apply(7)
        link.state_changed()
        [st] = _sent(link)  # reached: at once, not at the next period
        assert st.applied_index == 7 and not st.HasField("status") and not built
        node.apply(8)  # told 7: no read waits for more
        link.state_changed()
        assert not _sent(link)

    asyncio.run(main())


def test_a_queue_server_that_never_tells_fences_hears_every_move_promptly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def main() -> None:
        link, node, _ = _link(monkeypatch)
        link._told_at -= 1  # the first word was a while ago
        node.apply(1)
        link.state_changed()
        assert [s.applied_index for s in _sent(link)] == [1]
        node.apply(2)
        link.state_changed()  # within INDEX_EVERY_S of the last word: a timer
        assert not _sent(link)
        await _settle(queue_link.INDEX_EVERY_S + 0.02)
        assert [s.applied_index for s in _sent(link)] == [2]

    asyncio.run(main())


def test_a_role_move_goes_at_once_with_the_status(monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        link, node, _ = _link(monkeypatch)
        link.fence_wait(0, False)
        node.is_leader, node.core.lead, node.core.term = True, 1, 4
        link.state_changed()
        [st] = _sent(link)
        assert st.is_leader and st.term == 4 and st.leader_address == "n1:1"
        assert st.HasField("status")

    asyncio.run(main())


def test_a_status_rides_only_on_messages_that_carry_it(monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        link, node, built = _link(monkeypatch)
        link.fence_wait(0, False)
        built.clear()
        for i in range(1, 20):  # results carry the indexes, never a status
            node.apply(i)
            link._tell(work_pb2.WorkerMessage(state=link.state(False)))
            link.state_changed()  # nothing the results did not tell
        assert not built and all(not s.HasField("status") for s in _sent(link))
        # The status is refreshed now and then, on a message of its own.
        await _settle(INDEX_IDLE_S + 0.05)
        [st] = _sent(link)
        assert st.HasField("status") and st.applied_index == 19 and len(built) == 1

    asyncio.run(main())


def test_while_fenced_reads_come_in_the_node_tells_every_move_promptly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def main() -> None:
        link, node, _ = _link(monkeypatch)
        handler = link.executor
        link.fence_wait(0, True)
        assert handler.flowing == [True]  # type: ignore[attr-defined]
        link._told_at -= 1
        node.apply(1)
        link.state_changed()
        assert [s.applied_index for s in _sent(link)] == [1]  # at once: no read waits,
        node.apply(2)  # but followers can take the next one only if told
        link.state_changed()
        await _settle(queue_link.INDEX_EVERY_S + 0.02)
        assert [s.applied_index for s in _sent(link)] == [2]
        link.fence_wait(0, False)
        link.fence_wait(0, False)
        assert handler.flowing == [True, False]  # type: ignore[attr-defined]
        node.apply(3)
        link.state_changed()
        await _settle(queue_link.INDEX_EVERY_S + 0.02)
        assert not _sent(link)  # now and then again
        link.fence_wait(0, True)
        link.fence_wait_ended()  # the stream broke: no word any more
        assert handler.flowing == [True, False, True, False]  # type: ignore[attr-defined]

    asyncio.run(main())


def test_the_leader_tells_commits_at_once_while_any_queue_server_has_fenced_reads() -> None:
    submitted: list[bool] = []

    class _Core:
        def set_prompt_commit(self, on: bool) -> None:
            submitted.append(on)

    node = SimpleNamespace(submit=lambda fn: fn(_Core()))
    handler = WorkHandler.__new__(WorkHandler)
    handler.node = node  # type: ignore[assignment]
    handler._read_links = set()
    a, b = object(), object()
    handler.reads_flowing(a, True)
    handler.reads_flowing(b, True)
    handler.reads_flowing(a, False)
    assert submitted == [True]  # b still has them
    handler.reads_flowing(b, False)
    assert submitted == [True, False]


def test_a_worker_process_link_is_not_asked_for_group_0_fences_nor_shown_as_its_node(
    tmp_path: Path,
) -> None:
    """Node 1's main process (session 1) and its worker process (session 2,
    ``data_groups_only``): a group-0 read waiting for its fence asks the main
    process only, and the cluster's status shows node 1 as its main process
    tells it, once."""

    async def main() -> None:
        qs = _server(tmp_path)
        sessions: dict[int, asyncio.Queue[Any]] = {}
        for wid, only in ((2, True), (1, False)):  # the worker's link first
            sessions[wid] = asyncio.Queue()
            qs._sessions[wid] = sessions[wid]
            st = work_pb2.WorkerState(node_id=1, data_groups_only=only)
            if only:
                st.groups.add(group=1, is_leader=True, term=4, applied_index=7, commit_index=7)
            else:
                st.is_leader, st.term, st.applied_index, st.commit_index = True, 3, 5, 5
                st.status.id = 1
                st.status.applied_index = 5
            qs._worker_message(wid, work_pb2.WorkerMessage(state=st))
        assert not qs.q.workers[2].runs_group_0 and qs.q.workers[1].runs_group_0
        qs.q.submit(_read(9))
        qs.q.fenced_read_at = float("-inf")
        qs._kick()
        [fw] = [m for m in _drain(sessions[1]) if isinstance(m, work_pb2.FenceWait)]
        assert fw.index == 9
        assert not [m for m in _drain(sessions[2]) if isinstance(m, work_pb2.FenceWait)]
        cs = qs.status()
        assert [n.id for n in cs.nodes] == [1]
        assert cs.nodes[0].applied_index == 5 and cs.leader == 1 and cs.term == 3
        # A session may not switch between speaking for group 0 and not.
        with pytest.raises(ValueError):
            qs._worker_message(2, work_pb2.WorkerMessage(state=work_pb2.WorkerState(node_id=1)))

    asyncio.run(main())


# ------------------------------------------------------ results, batched


def _messages_now(link: QueueServerLink) -> list[work_pb2.WorkerMessage]:
    out = []
    while (m := link._next_nowait()) is not None:
        out.append(m)
    return out


def test_the_results_gathered_before_the_writer_takes_them_leave_as_one_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every result (of any group) that comes before the link's writer takes
    the outbox goes in one WorkerMessage with the credit of all its items
    and one state, told as the last state; an empty response is a result
    too; responses past WORK_BATCH_BYTES start another message."""

    async def main() -> None:
        link, node, _ = _link(monkeypatch)
        node.apply(7)
        big = b"x" * (WORK_BATCH_BYTES // 2 + 1)
        link._answer(work_pb2.WorkResult(id=1), work_pb2.WORK_KIND_WRITE)  # no response
        link._answer(work_pb2.WorkResult(id=2, response=b"ok"), work_pb2.WORK_KIND_WRITE)
        link._answer(work_pb2.WorkResult(id=3, response=b"r"), work_pb2.WORK_KIND_READ)
        [one] = _messages_now(link)
        assert [r.id for r in one.results] == [1, 2, 3]
        assert (one.credit.writes, one.credit.reads) == (2, 1)
        assert one.state.applied_index == 7 and link._told_applied == 7
        assert _messages_now(link) == []  # nothing more: one message for the three
        for i in (4, 5, 6):
            link._answer(work_pb2.WorkResult(id=i, response=big), work_pb2.WORK_KIND_WRITE)
        msgs = _messages_now(link)
        assert [[r.id for r in m.results] for m in msgs] == [[4], [5], [6]]
        assert sum(m.credit.writes for m in msgs) == 3
        assert all(m.state.applied_index == 7 for m in msgs)

    asyncio.run(main())
