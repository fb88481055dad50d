"""The "disk low" bit on every batch: what a sender says of its disk, and
what a receiver keeps of it (``node_daemon.transport.peer_disk``)."""

from __future__ import annotations

import pytest

from node_daemon.raft import Message, MessageType
from node_daemon.transport.batch_wire import encode_batch
from node_daemon.transport.peer_disk import STALE_S, PeerDisks, stale_after
from roadlog.v1 import raft_pb2

pytestmark = pytest.mark.unit


def heartbeat(frm: int, to: int) -> Message:
    return Message(MessageType.HEARTBEAT, to, frm, 3)


@pytest.mark.parametrize("low", [True, False])
def test_a_batch_says_whether_its_sender_is_low(low: bool) -> None:
    parts = encode_batch("c", 2, [(0, heartbeat(2, 1)), (1, heartbeat(2, 1))], low)
    batch = raft_pb2.RaftBatch.FromString(b"".join(parts))
    assert batch.disk_low is low
    assert getattr(batch, "from") == 2 and len(batch.messages) == 2


def test_a_batch_of_an_older_sender_says_not_low() -> None:
    """A peer of a version without the bit: the field is absent."""
    old = raft_pb2.RaftBatch(cluster="c")
    assert raft_pb2.RaftBatch.FromString(old.SerializeToString()).disk_low is False
    assert raft_pb2.RaftBatch.FromString(b"".join(encode_batch("c", 1, []))).disk_low is False


def test_news_holds_until_stale_then_is_unknown() -> None:
    d = PeerDisks(stale_s=5.0)
    assert d.low(2, 0.0) is None  # never heard of
    d.heard(2, True, 10.0)
    d.heard(3, False, 10.0)
    assert d.low(2, 10.0) is True and d.low(3, 12.0) is False
    assert d.low(2, 15.0) is True  # just within
    assert d.low(2, 15.1) is None and d.low(3, 15.1) is None  # stale: unknown
    assert d.known_low([2, 3, 4], 11.0) == {2}
    assert d.known_not_low([2, 3, 4], 11.0) == {3}
    assert d.known_low([2, 3], 20.0) == frozenset()


def test_the_latest_batch_wins() -> None:
    d = PeerDisks()
    d.heard(2, True, 1.0)
    d.heard(2, False, 2.0)  # room again
    assert d.low(2, 2.0) is False
    d.heard(2, True, 3.0)
    assert d.low(2, 3.0) is True


def test_news_holds_longer_on_a_slow_ticking_cluster() -> None:
    assert stale_after(20, 5, 25) == STALE_S  # the defaults: 100 ms heartbeats
    assert stale_after(1000, 5, 25) == 50.0  # 5 s heartbeats, 25 s elections
