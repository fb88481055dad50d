"""The Producer's batching rules, against a stand-in for the network (the
network is not what these tests are about; integration tests use the real one)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from roadlog import columnar
from roadlog.client import Producer, Unavailable
from roadlog.errors import Code
from roadlog.v1 import client_pb2, topics_pb2
from tests.waiting import wait_for

pytestmark = pytest.mark.unit


class FakeConnection:
    def __init__(self, fail: bool = False) -> None:
        self.published: list[client_pb2.PublishRequestView] = []
        self.fail = fail
        self.lock = threading.Lock()

    def call(
        self, method: str, request: Any, timeout: float | None = None, routing_group: int = 0
    ) -> Any:
        if method == "InitProducer":
            return client_pb2.InitProducerResponse(producer_id=7)
        if method == "DescribeTopic":  # a topic of group 0 (no data groups)
            return topics_pb2.TopicDescription()
        assert method == "Publish" and routing_group == 0
        if self.fail:
            raise Unavailable(Code.UNAVAILABLE, "no leader")
        with self.lock:
            self.published.append(request)
        n = len(columnar.decode(request.batch))
        return client_pb2.PublishResponse(
            offsets=[client_pb2.PartitionOffsets(partition=0, base_offset=0, count=n)]
        )


def test_a_lone_ping_goes_out_after_linger_without_another_call() -> None:
    conn = FakeConnection()
    p = Producer(conn, "t", linger_s=0.05)  # type: ignore[arg-type]
    assert p.send("car", 1_800_000_000_000, 48.1, 11.5) is None
    wait_for(lambda: len(conn.published) == 1, 5, "the lone ping sent", every=0.01)
    req = conn.published[0]
    assert (req.producer_id, req.sequence, len(columnar.decode(req.batch))) == (7, 1, 1)
    p.close()
    assert p.acked == 1


def test_a_full_batch_goes_out_at_once_with_increasing_sequences() -> None:
    conn = FakeConnection()
    p = Producer(conn, "t", batch_pings=3, linger_s=60)  # type: ignore[arg-type]
    acks = [p.send(f"d{i}", 1_800_000_000_000 + i, 48.1, 11.5) for i in range(7)]
    assert [a is not None for a in acks] == [False, False, True, False, False, True, False]
    p.close()  # sends the last ping
    assert [r.sequence for r in conn.published] == [1, 2, 3]
    assert [len(columnar.decode(r.batch)) for r in conn.published] == [3, 3, 1]


def test_a_background_failure_is_raised_by_the_next_call() -> None:
    conn = FakeConnection(fail=True)
    p = Producer(conn, "t", linger_s=0.02)  # type: ignore[arg-type]
    p.send("car", 1_800_000_000_000, 48.1, 11.5)
    wait_for(lambda: p._error is not None, 5, "the producer's error", every=0.01)
    with pytest.raises(Unavailable, match="no leader"):
        p.send("car", 1_800_000_000_001, 48.1, 11.5)
    conn.fail = False
    p.close()
