"""A node's PublishBatch handling against a stub node (no Raft, no LMDB):
each request answered on its own, a given-up proposal answered as retryable."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from node_daemon.state.responses import OpResult
from node_daemon.work import handler
from node_daemon.work.handler import WorkHandler
from roadlog.columnar import PingColumns, encode
from roadlog.errors import Code, RoadlogError
from roadlog.geo import bbox_region
from roadlog.limits import CLIENT_MESSAGE_BYTES
from roadlog.v1 import client_pb2, pings_pb2, topics_pb2, work_pb2

pytestmark = pytest.mark.unit

REGION = bbox_region(11.4, 48.05, 11.75, 48.25).geojson


def publish(n: int = 5) -> bytes:
    cols = PingColumns.from_columns(
        [f"d{i % 2}" for i in range(n)], [1_790_000_000_000] * n, [48.1] * n, [11.5] * n
    )
    batch = pings_pb2.PingBatch.FromString(encode(cols))
    return client_pb2.PublishRequest(topic="munich", batch=batch).SerializeToString()


class StubNode:
    """What the WorkHandler asks of a leader; proposals end as ``outcome`` says."""

    def __init__(self, outcome: str) -> None:
        self.outcome = outcome
        self.cfg = SimpleNamespace(merge_publishes=True)
        self.group = 0  # the metadata group
        self.core = SimpleNamespace(lead=1)
        self.is_leader = True
        topic = topics_pb2.Topic(id=7)
        topic.spec.name, topic.spec.partitions, topic.spec.region_geojson = "munich", 2, REGION
        self.sm = SimpleNamespace(topic=lambda name: topic, data_groups=lambda: 1)

    async def proposals_taken(self) -> None:
        return None

    async def wait_caught_up_as_leader(self, timeout: float) -> None:
        return None

    async def propose_op(self, op: Any, deadline: float | None = None) -> OpResult:
        if self.outcome == "cancelled":
            raise asyncio.CancelledError  # the node stopped with it in flight
        spans = tuple(OpResult(response=b"ok") for _ in op.append.spans)
        return OpResult(spans=spans)


def run_batch(outcome: str, requests: list[bytes]) -> work_pb2.WorkResult:
    async def go() -> work_pb2.WorkResult:
        ex = WorkHandler(StubNode(outcome))  # type: ignore[arg-type]
        body = client_pb2.PublishBatchRequestView(requests=requests).SerializeToString()
        return await ex.run(work_pb2.WorkItem(id=1, method="PublishBatch", request=body))

    return asyncio.run(go())


def test_each_request_of_a_batch_gets_its_own_answer() -> None:
    good = publish()
    res = run_batch("ok", [good, b"\xff\xff", good])
    assert res.code == 0
    out = client_pb2.PublishBatchResponseView.FromString(res.response)
    assert [r.code for r in out.results] == [0, grpc.StatusCode.INVALID_ARGUMENT.value[0], 0]
    assert out.results[0].response == b"ok"


def test_a_proposal_given_up_is_answered_as_retryable_not_dropped() -> None:
    good = publish()
    res = run_batch("cancelled", [good, good])
    assert res.code == 0
    out = client_pb2.PublishBatchResponseView.FromString(res.response)
    assert [r.code for r in out.results] == [grpc.StatusCode.UNAVAILABLE.value[0]] * 2
    assert "stopped" in out.results[0].message


class LaggingNode:
    """A node that has applied up to ``applied`` and catches up when told."""

    def __init__(self, applied: int) -> None:
        self.cfg = SimpleNamespace(merge_publishes=True)
        self.group = 0  # the metadata group
        self.applied = asyncio.Condition()
        desc = topics_pb2.TopicDescription()
        desc.topic.spec.name = "munich"
        self.sm: Any = SimpleNamespace(applied_index=applied, describe=lambda name: desc)
        self.sm.topics_page = lambda after, limit, max_bytes: (
            ([desc] if self.sm.applied_index >= 5 else []),
            "",
        )

    async def wait_applied(self, index: int, timeout: float | None = None) -> None:
        async with self.applied:
            await asyncio.wait_for(
                self.applied.wait_for(lambda: self.sm.applied_index >= index), timeout
            )

    async def catch_up(self, index: int) -> None:
        async with self.applied:
            self.sm.applied_index = index
            self.applied.notify_all()


@pytest.mark.parametrize(
    ("method", "request_bytes"),
    [
        ("ListTopics", client_pb2.ListTopicsRequest(min_applied_index=5).SerializeToString()),
        (
            "DescribeTopic",
            client_pb2.DescribeTopicRequest(name="munich", min_applied_index=5).SerializeToString(),
        ),
    ],
)
def test_topic_reads_wait_for_their_fence(method: str, request_bytes: bytes) -> None:
    """Read your writes: a node behind a read's min_applied_index answers
    only once it has applied that far (the create it must reflect)."""

    async def go() -> tuple[bool, work_pb2.WorkResult]:
        node = LaggingNode(applied=3)
        ex = WorkHandler(node)  # type: ignore[arg-type]
        item = work_pb2.WorkItem(id=1, method=method, request=request_bytes)
        answer = asyncio.ensure_future(ex.run(item))
        for _ in range(20):  # let it run as far as it can: up to waiting for index 5
            await asyncio.sleep(0)
        early = answer.done()
        await node.catch_up(5)
        return early, await asyncio.wait_for(answer, 10)

    early, res = asyncio.run(go())
    assert not early and res.code == 0
    if method == "ListTopics":
        assert [
            t.topic.spec.name for t in client_pb2.ListTopicsResponse.FromString(res.response).topics
        ] == ["munich"]


def test_an_answer_too_big_for_the_client_hop_is_refused_not_sent() -> None:
    """Finding 7 of issue 19: a node sent an answer the queue server refused,
    which broke the node's work stream; it is now a clear error instead."""

    async def big(item: work_pb2.WorkItem) -> OpResult:
        return OpResult(response=b"x" * (CLIENT_MESSAGE_BYTES + 1))

    async def go() -> work_pb2.WorkResult:
        ex = WorkHandler(StubNode("ok"))  # type: ignore[arg-type]
        return await ex.run(work_pb2.WorkItem(id=1, method="ListTopics"), big)

    res = asyncio.run(go())
    assert res.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert res.response == b"" and "over the limit" in res.message


class SpanNamingNode(StubNode):
    """Answers each span of an append op with its own name, and counts the
    ops proposed: a mixed-up answer or an unmerged call shows."""

    def __init__(self) -> None:
        super().__init__("ok")
        self.proposed = 0
        self.ops = 0

    async def propose_op(self, op: Any, deadline: float | None = None) -> OpResult:
        self.ops += 1
        first = self.proposed
        self.proposed += len(op.append.spans)
        return OpResult(
            spans=tuple(
                OpResult(response=b"span%d" % (first + k)) for k in range(len(op.append.spans))
            )
        )


def test_calls_merged_into_one_proposal_each_get_their_own_publishes_answers() -> None:
    """Two PublishBatch calls waiting together are validated and proposed
    together (one future per call, not per publish); each call's answer has
    its own publishes' results in its own order, a refused one in its place."""
    good = publish()

    async def go() -> tuple[SpanNamingNode, list[work_pb2.WorkResult]]:
        node = SpanNamingNode()
        ex = WorkHandler(node)  # type: ignore[arg-type]
        items = [
            client_pb2.PublishBatchRequestView(requests=reqs).SerializeToString()
            for reqs in ([good, b"\xff", good], [good])
        ]
        results = await asyncio.gather(
            *(
                ex.run(work_pb2.WorkItem(id=i, method="PublishBatch", request=body))
                for i, body in enumerate(items)
            )
        )
        return node, list(results)

    node, (first, second) = asyncio.run(go())
    a = client_pb2.PublishBatchResponseView.FromString(first.response)
    b = client_pb2.PublishBatchResponseView.FromString(second.response)
    assert (node.ops, node.proposed) == (1, 3)  # the three good publishes, in one op
    assert [r.response for r in a.results] == [b"span0", b"", b"span1"]
    assert a.results[1].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert [r.response for r in b.results] == [b"span2"]


class CatchingUpNode(StubNode):
    """A new leader that has not applied its own term's first entry yet:
    a write its predecessor acknowledged may still be missing from its state."""

    def __init__(self) -> None:
        super().__init__("ok")
        self.caught_up = asyncio.Event()
        self.proposed = 0

    async def wait_caught_up_as_leader(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self.caught_up.wait(), timeout)
        except TimeoutError:
            raise RoadlogError(Code.UNAVAILABLE, "still applying: try again") from None

    async def propose_op(self, op: Any, deadline: float | None = None) -> OpResult:
        self.proposed += 1
        return await super().propose_op(op, deadline)


def _write_item() -> work_pb2.WorkItem:
    body = client_pb2.PublishBatchRequestView(requests=[publish()]).SerializeToString()
    return work_pb2.WorkItem(
        id=1, method="PublishBatch", request=body, kind=work_pb2.WORK_KIND_WRITE
    )


def test_a_new_leader_takes_a_write_in_only_once_it_caught_up() -> None:
    async def go() -> None:
        node = CatchingUpNode()
        task = asyncio.ensure_future(WorkHandler(node).run(_write_item()))  # type: ignore[arg-type]
        for _ in range(50):
            await asyncio.sleep(0)
        assert not task.done() and node.proposed == 0  # nothing read or proposed yet
        node.caught_up.set()
        res = await asyncio.wait_for(task, 10)
        assert res.code == 0 and node.proposed == 1

    asyncio.run(go())


def test_a_leader_that_does_not_catch_up_in_time_answers_try_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(handler, "LEADER_CATCH_UP_S", 0.05)

    async def go() -> work_pb2.WorkResult:
        node = CatchingUpNode()
        res = await WorkHandler(node).run(_write_item())  # type: ignore[arg-type]
        assert node.proposed == 0
        return res

    res = asyncio.run(go())
    assert res.code == Code.UNAVAILABLE and "try again" in res.message
