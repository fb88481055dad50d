"""A write is never put in the log after its deadline (nemesis finding 17).

The HTTP producer (no producer id) had its request stored after its next
one: the request waited past its deadline, the client heard nothing, went on
with its next request, and the first was stored after it all the same. The
queue server now tells each write's deadline as the milliseconds left when
it hands it out (``WorkItem.budget_ms``); the node counts them on its own
monotonic clock from receipt, and a write not in the log by then (the node
was paused, or busy) is answered DEADLINE_EXCEEDED and never proposed."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest

from node_daemon.replica import commands
from node_daemon.state.responses import OpResult
from node_daemon.work import handler as handler_mod
from node_daemon.work.handler import MAX_WORK_LAG_S, WorkHandler, item_deadline
from queue_server.http_api import request_timeout
from queue_server.outgoing import Outgoing
from queue_server.queues import Item, Kind
from roadlog.errors import Code, RoadlogError
from roadlog.v1 import client_pb2, command_pb2, work_pb2
from tests.unit.node_daemon.work.test_handler_publish_batch import StubNode, publish

pytestmark = pytest.mark.unit

DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]


class Clock:
    """The worker's monotonic clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class PausedNode(StubNode):
    """A leader whose event loop stops for ``pause_s`` while the publishes
    wait for the previous proposals (a SIGSTOP, or a loop busy that long),
    and that records what it was asked to propose."""

    def __init__(self, clock: Clock, pause_s: float) -> None:
        super().__init__("ok")
        self.clock, self.pause_s = clock, pause_s
        self.proposed: list[float | None] = []

    async def proposals_taken(self) -> None:
        self.clock.now += self.pause_s

    async def propose_op(self, op: Any, deadline: float | None = None) -> OpResult:
        self.proposed.append(deadline)
        return OpResult(spans=tuple(OpResult(response=b"ok") for _ in op.append.spans))


def run_publish(
    pause_s: float, budget_ms: int, monkeypatch: pytest.MonkeyPatch, deadline_unix_ms: int = 0
) -> tuple[work_pb2.WorkResult, PausedNode, Clock]:
    clock = Clock()
    monkeypatch.setattr(handler_mod, "_monotonic", clock)  # the worker's receipt and checks
    node = PausedNode(clock, pause_s)

    async def go() -> work_pb2.WorkResult:
        ex = WorkHandler(node)  # type: ignore[arg-type]
        item = work_pb2.WorkItem(
            id=1,
            kind=work_pb2.WORK_KIND_WRITE,
            method="Publish",
            request=publish(),
            budget_ms=budget_ms,
            deadline_unix_ms=deadline_unix_ms,
        )
        return await ex.run(item)

    return asyncio.run(go()), node, clock


def test_a_publish_whose_deadline_passed_while_it_waited_is_not_proposed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    res, node, _ = run_publish(pause_s=3.0, budget_ms=2000, monkeypatch=monkeypatch)
    assert res.code == DEADLINE_EXCEEDED
    assert "deadline passed before the leader could put it in the log" in res.message
    assert node.proposed == []  # nothing of it can be stored later


def test_a_publish_in_time_is_proposed_with_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    res, node, _ = run_publish(pause_s=0.5, budget_ms=2000, monkeypatch=monkeypatch)
    assert res.code == 0
    assert node.proposed == [pytest.approx(1002.0)]  # receipt (1000.0) + 2 s, for the log


def test_an_item_without_a_budget_has_no_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """A queue server that says no budget (older): nothing is refused."""
    res, node, _ = run_publish(pause_s=3600.0, budget_ms=0, monkeypatch=monkeypatch)
    assert res.code == 0
    assert node.proposed == [None]


def test_the_leader_drops_proposals_whose_deadline_passed_before_the_log() -> None:
    """The last check, as the driver takes proposals into the log."""

    async def go() -> tuple[list[Any], list[asyncio.Future[OpResult]]]:
        loop = asyncio.get_running_loop()
        futs = [loop.create_future() for _ in range(3)]
        ops = [
            (command_pb2.Op(), futs[0], 9.0),  # passed
            (command_pb2.Op(), futs[1], 11.0),  # in time
            (command_pb2.Op(), futs[2], None),  # none
        ]
        return commands.in_time(ops, 10.0), futs

    kept, futs = asyncio.run(go())
    assert [p[1] for p in kept] == futs[1:]
    err = futs[0].exception()
    assert isinstance(err, RoadlogError) and err.code == Code.DEADLINE_EXCEEDED
    assert not futs[1].done() and not futs[2].done()


def test_the_queue_server_hands_out_the_time_left() -> None:
    it = Item(5, Kind.WRITE, "Publish", b"x", 107.25, 100.0, 0, client="c")
    sent = work_pb2.WorkItem.FromString(b"".join(Outgoing.of(it, now=104.0).parts()[1:]))
    assert sent.budget_ms == 3250
    late = work_pb2.WorkItem.FromString(b"".join(Outgoing.of(it, now=108.0).parts()[1:]))
    assert late.budget_ms == 1  # never 0 ("not said"): the node refuses it at once


def test_a_publish_batch_past_its_deadline_stores_none_of_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock()
    monkeypatch.setattr(handler_mod, "_monotonic", clock)  # the worker's receipt and checks
    node = PausedNode(clock, pause_s=5.0)

    async def go() -> work_pb2.WorkResult:
        ex = WorkHandler(node)  # type: ignore[arg-type]
        body = client_pb2.PublishBatchRequestView(requests=[publish()] * 3).SerializeToString()
        item = work_pb2.WorkItem(
            id=2, kind=work_pb2.WORK_KIND_WRITE, method="PublishBatch", request=body, budget_ms=800
        )
        return await ex.run(item)

    res = asyncio.run(go())
    out = client_pb2.PublishBatchResponseView.FromString(res.response)
    assert [r.code for r in out.results] == [DEADLINE_EXCEEDED] * 3
    assert node.proposed == []


def test_an_http_deadline_counts_what_passed_before_the_request_was_read() -> None:
    """``X-Deadline-Unix-Ms`` bounds the wait from the client's send, not
    from this server's read: a request read late (a backlog, a restart, a
    pause) gets what is left of it, and one read after it is refused."""
    now = 1_800_000_000.0
    assert request_timeout({}, now) is None
    assert request_timeout({"X-Timeout-Ms": "8000"}, now) == 8.0
    sent = {"X-Timeout-Ms": "8000", "X-Deadline-Unix-Ms": str(int((now + 1.5) * 1000))}
    assert request_timeout(sent, now) == pytest.approx(1.5)  # read 6.5 s late
    assert request_timeout({"X-Deadline-Unix-Ms": str(int((now + 20) * 1000))}, now) == (
        pytest.approx(20.0)
    )
    with pytest.raises(RoadlogError, match=r"passed 2\.000 s before this server read") as e:
        request_timeout({"X-Deadline-Unix-Ms": str(int((now - 2) * 1000))}, now)
    assert e.value.code == Code.DEADLINE_EXCEEDED


def test_a_write_that_waited_unread_at_a_paused_node_counts_the_wait() -> None:
    """The budget runs from the node's receipt; the wall-clock deadline
    beside it also counts a wait before the node read the item (a leader
    SIGSTOPped with work in its socket). A node whose clock says the item
    waited longer than MAX_WORK_LAG_S is taken to have a wrong clock."""
    now, wall = 500.0, 1_800_000_000.0
    sent_at = wall - 9.5  # handed out with 10 s left, read 9.5 s later
    item = work_pb2.WorkItem(budget_ms=10_000, deadline_unix_ms=int((sent_at + 10) * 1000))
    assert item_deadline(item, now, wall) == pytest.approx(now + 0.5)
    fresh = work_pb2.WorkItem(budget_ms=10_000, deadline_unix_ms=int((wall + 10) * 1000))
    assert item_deadline(fresh, now, wall) == pytest.approx(now + 10)
    behind = work_pb2.WorkItem(budget_ms=10_000, deadline_unix_ms=int((wall + 3600) * 1000))
    assert item_deadline(behind, now, wall) == pytest.approx(now + 10)  # a slow clock: the budget
    ahead = work_pb2.WorkItem(
        budget_ms=10_000, deadline_unix_ms=int((wall - MAX_WORK_LAG_S - 1) * 1000)
    )
    assert item_deadline(ahead, now, wall) == pytest.approx(now + 10)  # a fast clock: not believed
    assert item_deadline(work_pb2.WorkItem(budget_ms=3000), now, wall) == pytest.approx(now + 3)


def test_a_paused_leader_does_not_propose_what_it_read_after_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    late = int((time.time() - 2) * 1000)  # read 2 s after its deadline
    res, node, _ = run_publish(0.0, 5000, monkeypatch, deadline_unix_ms=late)
    assert res.code == DEADLINE_EXCEEDED
    assert node.proposed == []
