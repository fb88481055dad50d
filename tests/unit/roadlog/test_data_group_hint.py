"""The routing hint of multi-raft's fast path: the SDK writes a publish's
data group first in the message (``with_leading_varint``), protobuf reads
it as the field it is, and the queue server reads it without parsing the
message (``leading_varint``); a message without it leading has no hint.
``ping_groups`` gives each ping the group the cluster puts its partition in."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from roadlog.columnar import PingColumns
from roadlog.partitioning import partition_of, ping_groups
from roadlog.protowire import leading_varint, with_leading_varint
from roadlog.v1 import client_pb2

pytestmark = pytest.mark.unit


@given(st.integers(0, 2**32 - 1), st.binary(max_size=64), st.lists(st.binary(max_size=8)))
def test_a_leading_group_is_read_back_by_both(group: int, batch: bytes, reqs: list[bytes]) -> None:
    one = client_pb2.PublishRequestView(topic="t", batch=batch).SerializeToString()
    hinted = with_leading_varint(one, 7, group)
    assert client_pb2.PublishRequestView.FromString(hinted).group == group
    assert leading_varint(hinted, 7) == group
    many = client_pb2.PublishBatchRequestView(requests=reqs).SerializeToString()
    hinted = with_leading_varint(many, 2, group)
    assert client_pb2.PublishBatchRequestView.FromString(hinted).group == group
    assert leading_varint(hinted, 2) == group


def test_a_hint_that_does_not_lead_is_no_hint() -> None:
    tail = client_pb2.PublishRequestView(topic="t", group=3).SerializeToString()
    assert client_pb2.PublishRequestView.FromString(tail).group == 3
    assert leading_varint(tail, 7) == 0  # protobuf wrote it last: not read
    assert leading_varint(b"", 7) == 0
    assert leading_varint(b"\x38" + b"\xff" * 12, 7) == 0  # not a varint in 10 bytes
    assert leading_varint(b"\x38\x05", 2) == 0  # another field leads


def test_each_ping_gets_its_partitions_group() -> None:
    devices = [f"dev-{i}" for i in range(40)]
    cols = PingColumns.from_columns(devices * 2, np.arange(80), [48.1] * 80, [11.5] * 80)
    groups = [1, 2, 3, 1, 2, 3]
    got = ping_groups(cols, groups)
    want = [groups[partition_of(d, 6)] for d in devices * 2]
    assert got.tolist() == want
