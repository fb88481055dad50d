"""The pipe between a node's main process and a worker process: whole
messages in order, sends that never block the event loop however far the
other side is behind (droppable ones left out then), EOF when the other
side goes, and no oversized message in either direction. Its messages are
the typed dataclasses of ``pipe_messages``, each kind coming back as sent;
a frame that is not one of them is logged and skipped, never taken."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import pickle

import pytest

from node_daemon.process import pipe as process_pipe
from node_daemon.process import pipe_messages as pm
from node_daemon.process.pipe import HIGH_WATER, BarrierAsks, ProcessPipe
from node_daemon.raft import Role
from node_daemon.replica.status import GroupFigures
from roadlog.errors import RoadlogError
from tests.unit.support.loops import run_bounded

pytestmark = pytest.mark.unit

FIGURES = GroupFigures(1, Role.LEADER, 3, 2, 40, 39, (1, 2, 3), (4,), 12, False)
# One message of every kind, as each side sends it.
EVERY_KIND: list[pm.Message] = [
    pm.Group0(12, (1, 2, 3), (4,), {1: "n1:7400", 2: "n2:7400"}, ("q1:7501",)),
    pm.HandOver(2),
    pm.HandOver(),
    pm.Stop(),
    pm.AskMetrics(),
    pm.Ports(7410, 7411),
    pm.Ports(7410, 0),
    pm.Groups((FIGURES, GroupFigures(3, Role.FOLLOWER, 3, 2, 40, 38, (1, 2), (), 12, True))),
    pm.Groups(()),
    pm.Metrics('roadlog_raft_group_term{group="1"} 3.0\n'),
    pm.ReadBarrier(7, 0),
    pm.Barrier(7, index=41),
    pm.Barrier(8, error="not the leader"),
]


def test_every_kind_comes_back_as_sent() -> None:
    for msg in EVERY_KIND:
        assert pm.decode(pm.encode(msg)) == msg
    assert {type(m) for m in EVERY_KIND} == set(pm.Message.__args__)


def test_the_encoding_is_plain_values_no_class_named() -> None:
    raw = pickle.loads(pm.encode(pm.Groups((FIGURES,))))
    assert raw == ("Groups", ((1, 3, 3, 2, 40, 39, (1, 2, 3), (4,), 12, False),))
    decoded = pm.decode(pm.encode(pm.Groups((FIGURES,))))
    assert isinstance(decoded, pm.Groups) and decoded.figures[0].role is Role.LEADER
    assert len(pm.encode(EVERY_KIND[0])) < 100  # small: kind name and values only


@pytest.mark.parametrize(
    "data",
    [
        b"not a pickle",
        pickle.dumps(["Ports", 7410, 0]),  # a list, not a tuple
        pickle.dumps(("Nope", 1)),  # no such kind
        pickle.dumps(("Ports", 7410)),  # a field missing
        pickle.dumps(("Ports", 7410, 0, 1)),  # one too many
        pickle.dumps(("Ports", True, 0)),  # a bool where an int goes
        pickle.dumps(("Ports", "7410", 0)),  # a str where an int goes
        pickle.dumps(("Ports", -1, 0)),  # its invariant broken
        pickle.dumps(("Stop", pm.Stop())),  # a class named in the pickle
        pickle.dumps(("Metrics", b"bytes")),
        pickle.dumps(("Group0", 1, (2, 1), (), {}, ())),  # voters not sorted
        pickle.dumps(("Group0", 1, (1,), (1,), {}, ())),  # both voter and learner
        pickle.dumps(("Group0", 1, (1,), (), {"1": "a"}, ())),  # a str node id
        pickle.dumps(("Groups", ((0, 3, 3, 2, 40, 39, (1,), (), 1, False),))),  # group 0
        pickle.dumps(("Groups", ((1, 9, 3, 2, 40, 39, (1,), (), 1, False),))),  # no such role
        pickle.dumps(("Groups", ((1, 3, 3, 2, 40, 39, (1,), (), 1),))),  # a figure missing
        pickle.dumps(("Groups", ((1, 3, 3, 2, 40, 39, (2, 1), (), 1, False),))),  # unsorted
        pickle.dumps(("Groups", ((1, 3, 3, 2, 40, 39, (1,), (), 1, False),) * 2)),  # twice
        pickle.dumps(("Barrier", 1, 5, "and an error")),
    ],
)
def test_what_is_not_a_message_is_refused_by_name(data: bytes) -> None:
    with pytest.raises(pm.MalformedMessage):
        pm.decode(data)


def test_only_messages_are_sent() -> None:
    with pytest.raises(TypeError):
        pm.encode({"kind": "stop"})  # type: ignore[arg-type]


def test_messages_arrive_whole_in_order_and_sends_never_block() -> None:
    async def body() -> None:
        a_conn, b_conn = multiprocessing.Pipe()
        a, b = await ProcessPipe.open(a_conn), await ProcessPipe.open(b_conn)
        try:
            for i in range(100):
                assert a.send(pm.Metrics("x" * (i * 997)))
            got = [await b.recv() for _ in range(100)]
            assert [len(m.text) for m in got if isinstance(m, pm.Metrics)] == [
                i * 997 for i in range(100)
            ]
            # The other side reads nothing: sends go on without blocking, the
            # droppable ones stop once HIGH_WATER bytes wait, the others not.
            big = pm.Metrics("y" * (64 << 10))
            sent = sum(a.send(big, droppable=True) for _ in range(200))
            assert sent < 200 and a.backlog() > HIGH_WATER
            assert a.send(pm.Stop())  # never dropped
            for _ in range(sent):
                assert await b.recv() == big
            assert await b.recv() == pm.Stop()
            with pytest.raises(ValueError):
                a.send(pm.Metrics("z" * (process_pipe.MAX_MESSAGE + 1)))
        finally:
            a.close()
        with pytest.raises(EOFError):
            await asyncio.wait_for(b.recv(), 5)
        b.close()

    run_bounded(body)


def test_a_frame_that_is_no_message_is_logged_and_skipped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def body() -> None:
        a_conn, b_conn = multiprocessing.Pipe()
        a, b = await ProcessPipe.open(a_conn), await ProcessPipe.open(b_conn, peer="worker 3")
        try:
            for junk in (b"\x80garbage", pickle.dumps(("Nope",)), pickle.dumps(("Ports", 0, 0))):
                a._writer.write(process_pipe._LEN.pack(len(junk)) + junk)
            assert a.send(pm.HandOver(2))
            assert await asyncio.wait_for(b.recv(), 5) == pm.HandOver(2)
            assert b.unreadable == 3
        finally:
            a.close()
            b.close()

    with caplog.at_level(logging.ERROR, logger="roadlog.node.pipe"):
        run_bounded(body)
    skipped = [r for r in caplog.records if r.name == "roadlog.node.pipe"]
    assert len(skipped) == 3
    assert all(getattr(r, "peer", None) == "worker 3" for r in skipped)
    assert "no message is called 'Nope'" in getattr(skipped[1], "error", "")


def test_a_barrier_asked_is_answered_by_its_id() -> None:
    async def body() -> None:
        a_conn, b_conn = multiprocessing.Pipe()
        a, b = await ProcessPipe.open(a_conn), await ProcessPipe.open(b_conn)
        asks = BarrierAsks()
        try:
            first = asyncio.ensure_future(asks.ask(a, 2))
            second = asyncio.ensure_future(asks.ask(a, 3))
            one, two = await b.recv(), await b.recv()
            assert isinstance(one, pm.ReadBarrier) and isinstance(two, pm.ReadBarrier)
            assert (one.group, two.group) == (2, 3)
            asks.answered(pm.Barrier(two.id, error="no leader"))
            asks.answered(pm.Barrier(one.id, index=17))
            asks.answered(pm.Barrier(one.id, index=18))  # late, twice: ignored
            assert await first == 17
            with pytest.raises(RoadlogError, match="no leader"):
                await second
        finally:
            a.close()
            b.close()

    run_bounded(body)
