"""Byte bounds on every hop, against a real cluster (issue 19, findings 6
and 7): a big request or a big answer gets through or gets a clear error,
and never breaks a node's work stream, stalls other clients' writes or
keeps the cluster electing."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from roadlog.client import Admin, Connection
from roadlog.client_tls import ClientTLS
from roadlog.columnar import PingColumns, encode
from roadlog.limits import CLIENT_MESSAGE_BYTES, PAGE_BYTES, WORK_MESSAGE_BYTES, grpc_options
from roadlog.tools.localcluster import LocalCluster
from roadlog.v1 import client_pb2, pings_pb2
from tests.integration.conftest import (
    ProducerRun,
    assert_exactly_once_in_order,
    create_topic,
    read_topic,
)

pytestmark = pytest.mark.integration


def big_publish(topic: str, name: str, target_bytes: int) -> client_pb2.PublishRequest:
    """A valid PublishRequest of about ``target_bytes`` (long device ids)."""
    per_ping = 90  # a 64-byte device id (each ping its own) and the numbers, encoded
    n = target_bytes // per_ping
    ts = 1_790_000_000_000 + np.arange(n, dtype=np.int64)
    cols = PingColumns.from_columns(
        [f"{name}-{i:08d}".ljust(64, "x") for i in range(n)],
        ts,
        (48.1 + (np.arange(n) % 1000) * 1e-5).astype(np.float64),
        (11.5 + (np.arange(n) % 1000) * 1e-5).astype(np.float64),
    )
    batch = pings_pb2.PingBatch.FromString(encode(cols))
    return client_pb2.PublishRequest(topic=topic, batch=batch, client_id=name)


def test_a_5_mib_publish_does_not_stall_another_clients_writes(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    """Before: the node's work stream took 4 MiB, so the publish broke it,
    went back to the front of the queue and out again, while every other
    client's writes failed."""
    lc = make_cluster(3)
    with Connection(lc.servers, timeout=30) as conn:
        create_topic(conn, partitions=4)
        other = ProducerRun(conn, "munich", "steady", batch=50, pause_s=0.02).start()
        big = big_publish("munich", "big", 5 << 20)
        assert big.ByteSize() > 5 << 20
        try:
            for _ in range(2):
                resp = conn.call("Publish", big, timeout=30)
                assert sum(p.count for p in resp.offsets) == len(big.batch.ts_ms)
        finally:
            other.join()
        assert other.errors == [], other.errors[:3]
        assert len(other.acked) > 0
        stored = read_topic(conn, "munich")
        assert_exactly_once_in_order(
            {p: [r for r in rows if r[0].startswith("steady")] for p, rows in stored.items()},
            other.acked,
        )
        # The big publish is stored once per send: the second is a new publish.
        assert sum(len(rows) for rows in stored.values()) == len(other.acked) + 2 * len(
            big.batch.ts_ms
        )


def test_32_concurrent_big_publishes_succeed_or_are_refused_never_unavailable(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    """Before: the queue server merged them into one stream message with no
    byte limit, over what the node's stream takes: 31 of 32 UNAVAILABLE."""
    lc = make_cluster(3)
    request_bytes = 1_300_000
    assert 32 * request_bytes > WORK_MESSAGE_BYTES  # merged with no bound, they break a stream
    with Connection(lc.servers, timeout=60) as conn:
        create_topic(conn, partitions=4)
        requests = [big_publish("munich", f"p{i:02d}", request_bytes) for i in range(32)]
        # Raw calls, no SDK retries: each code is what the server answered.
        opts = grpc_options(CLIENT_MESSAGE_BYTES)
        channel = ClientTLS.from_env().channel(lc.servers[0], options=opts)
        publish: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
            "/roadlog.v1.Roadlog/Publish"
        )

        fences: list[int] = []

        def send(req: client_pb2.PublishRequest) -> str:
            try:
                raw = publish(req.SerializeToString(), timeout=60)
            except grpc.RpcError as e:
                return f"{e.code().name}: {e.details()}"
            fences.append(client_pb2.PublishResponse.FromString(raw).applied_index)
            return "OK"

        with channel, ThreadPoolExecutor(32) as pool:
            codes = list(pool.map(send, requests))
        assert all(c == "OK" or c.startswith("RESOURCE_EXHAUSTED") for c in codes), codes
        assert codes.count("OK") > 0
        fenced = client_pb2.DescribeTopicRequest(name="munich", min_applied_index=max(fences))
        stored = sum(p.next_offset for p in conn.call("DescribeTopic", fenced).partitions)
        assert stored == codes.count("OK") * len(requests[0].batch.ts_ms)


def test_a_request_over_the_front_doors_limit_is_refused_clearly(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    lc = make_cluster(1)
    channel = ClientTLS.from_env().channel(
        lc.servers[0],
        options=[("grpc.max_send_message_length", CLIENT_MESSAGE_BYTES * 2)],
    )
    with channel:
        publish: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
            "/roadlog.v1.Roadlog/Publish"
        )
        with pytest.raises(grpc.RpcError) as e:
            publish(b"\x0a\x01m" + b"\x12" + b"\xff" * CLIENT_MESSAGE_BYTES, timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "over the limit" in (e.value.details() or "")
    with Connection(lc.servers, timeout=10) as conn:  # the server is fine
        create_topic(conn)
        assert Admin(conn).describe("munich").topic.spec.name == "munich"


def region_with_many_vertices(i: int) -> str:
    n = 9_999
    ring = [
        [
            11.5 + 0.1 * math.cos(2 * math.pi * k / n) + i * 1e-6,
            48.1 + 0.08 * math.sin(2 * math.pi * k / n),
        ]
        for k in range(n)
    ]
    ring.append(ring[0])
    return json.dumps({"type": "Polygon", "coordinates": [ring]})


def test_topics_bigger_than_any_answer_are_listed_in_pages_without_elections(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    """Before: 193 topics of 10,000-vertex regions made one 97 MB ListTopics
    answer that the queue server refused; the read went back to the front
    with no deadline check and the cluster kept electing. Here the topics
    hold more than one answer to a client may; they come in pages."""
    lc = make_cluster(3)
    with Connection(lc.servers, timeout=60) as conn:
        admin = Admin(conn)
        region_bytes = len(region_with_many_vertices(0))
        count = CLIENT_MESSAGE_BYTES // (region_bytes * 9 // 10) + 4  # stored regions are smaller
        names = [f"city{i:03d}" for i in range(count)]
        with ThreadPoolExecutor(8) as pool:
            list(
                pool.map(
                    lambda i: admin.create_topic(names[i], region_with_many_vertices(i), 1),
                    range(count),
                )
            )
        term = admin.status().term
        listed = admin.list_topics()  # every page, in name order
        assert [t.topic.spec.name for t in listed] == names
        assert sum(t.ByteSize() for t in listed) > CLIENT_MESSAGE_BYTES  # more than one answer
        page = conn.call("ListTopics", client_pb2.ListTopicsRequest(page_size=1000))
        assert page.next_page_token and 0 < page.ByteSize() <= PAGE_BYTES + region_bytes * 2
        assert admin.status().term == term  # nobody lost the leadership on the way
