"""Corked publishing (roadlog.publisher over PublishBatch) on a real cluster:
each publish is answered on its own, bad ones alone are refused, retries
through a leader's death store each idempotent batch exactly once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest

from roadlog.client import Admin, Connection, InvalidArgument, NotFound
from roadlog.client_tls import ClientTLS
from roadlog.columnar import PingColumns, encode
from roadlog.publisher import Publisher
from roadlog.runtime.processes import alive
from roadlog.tools.localcluster import LocalCluster
from roadlog.v1 import client_pb2, pings_pb2
from tests.integration.conftest import (
    assert_exactly_once_in_order,
    create_topic,
    make_pings,
    read_topic,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MakeCluster = Callable[..., LocalCluster]


def request(
    topic: str, cols: PingColumns, producer_id: int = 0, sequence: int = 0
) -> client_pb2.PublishRequest:
    return client_pb2.PublishRequest(
        topic=topic,
        producer_id=producer_id,
        sequence=sequence,
        batch=pings_pb2.PingBatch.FromString(encode(cols)),
    )


def outside(cols: PingColumns) -> PingColumns:
    lon = cols.lon.copy()
    lon[3] = 13.0  # far east of the region
    return PingColumns(**{**cols.__dict__, "lon": lon})


def rows(cols: PingColumns) -> list[tuple[str, int]]:
    return list(zip(cols.device_of().tolist(), cols.ts_ms.tolist(), strict=True))


def test_concurrent_publishes_are_corked_and_answered_one_by_one(
    make_cluster: MakeCluster,
) -> None:
    lc = make_cluster(3)
    with Connection(lc.servers) as conn:
        create_topic(conn, "munich", 4)
    good = [make_pings(f"p{i}", 0, 50) for i in range(120)]
    bad_at = {7: "outside", 50: "unknown", 99: "outside"}

    async def run() -> tuple[list[object], Publisher]:
        async with Publisher(lc.servers, max_in_flight=2) as pub:
            jobs = []
            for i, cols in enumerate(good):
                if bad_at.get(i) == "outside":
                    jobs.append(pub.publish(request("munich", outside(cols))))
                elif bad_at.get(i) == "unknown":
                    jobs.append(pub.publish(request("no-such-topic", cols)))
                else:
                    jobs.append(pub.publish(request("munich", cols)))
            results = await asyncio.gather(*jobs, return_exceptions=True)
            return list(results), pub

    results, pub = asyncio.run(run())
    for i, r in enumerate(results):
        if bad_at.get(i) == "outside":
            assert isinstance(r, InvalidArgument), r
            assert "#3: outside the topic's region" in str(r)
        elif bad_at.get(i) == "unknown":
            assert isinstance(r, NotFound), r
        else:
            assert isinstance(r, client_pb2.PublishResponse), r
            assert sum(o.count for o in r.offsets) == 50
    # 120 publishes, at most 2 calls out at a time: most of them travelled together.
    assert pub.stats.sent == 120
    assert pub.stats.calls < 60
    # Fences to read its writes at: group 0's, or each data group's (the default).
    assert pub.fence > 0 or pub.group_fences
    acked = [row for i, cols in enumerate(good) if i not in bad_at for row in rows(cols)]
    with Connection(lc.servers) as conn:
        conn.fence = pub.fence
        conn.group_fences = dict(pub.group_fences)
        stored = read_topic(conn, "munich")
    assert sum(len(v) for v in stored.values()) == len(acked)  # the refused ones: nothing
    assert_exactly_once_in_order(stored, acked)


def test_idempotent_publishes_through_a_leader_kill_are_stored_exactly_once(
    make_cluster: MakeCluster,
) -> None:
    lc = make_cluster(3)
    with Connection(lc.servers) as conn:
        create_topic(conn, "munich", 4)
        producers = [
            int(
                conn.call(
                    "InitProducer", client_pb2.InitProducerRequest(client_id=f"dev{i}")
                ).producer_id
            )
            for i in range(6)
        ]
    acked: list[tuple[str, int]] = []
    errors: list[str] = []
    killed = asyncio.Event()

    async def device(pub: Publisher, k: int, pid: int) -> None:
        # One batch in flight per producer (its sequence numbers stay in order);
        # the six producers' batches are corked together.
        for seq in range(1, 61):
            cols = make_pings(f"dev{k}", (seq - 1) * 20, 20)
            try:
                await pub.publish(request("munich", cols, pid, seq), timeout=60)
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")
                return
            acked.extend(rows(cols))
            if k == 0 and seq == 20:
                killed.set()

    victim: list[int] = []
    acked_at_kill: list[int] = []

    async def killer() -> None:
        await killed.wait()
        victim.append(lc.status()["leader"])
        await asyncio.get_running_loop().run_in_executor(None, lc.kill, victim[0])
        acked_at_kill.append(len(acked))

    async def run() -> Publisher:
        async with Publisher(lc.servers) as pub:
            await asyncio.gather(killer(), *(device(pub, k, p) for k, p in enumerate(producers)))
            return pub

    pub = asyncio.run(run())
    assert not errors, errors[:3]
    assert len(acked) == 6 * 60 * 20
    assert acked_at_kill[0] < len(acked) / 2  # most were published after the kill
    with Connection(lc.servers) as conn:
        wait_for(lambda: Admin(conn).status().leader not in (0, victim[0]), 30, "a new leader")
        conn.fence = pub.fence
        stored = read_topic(conn, "munich")
    assert_exactly_once_in_order(stored, acked)


def test_malformed_and_oversized_batches_are_refused_whole(make_cluster: MakeCluster) -> None:
    lc = make_cluster(1)
    with Connection(lc.servers) as conn:
        create_topic(conn, "munich", 2)
    one = request("munich", make_pings("x", 0, 5)).SerializeToString()
    cases = {
        "garbage": b"\x0a\xff\xff\xff",
        "empty": b"",
        "too many": client_pb2.PublishBatchRequestView(requests=[one] * 4097).SerializeToString(),
    }
    with ClientTLS.from_env().channel(lc.servers[0]) as ch:
        call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = ch.unary_unary(
            "/roadlog.v1.Roadlog/PublishBatch"
        )
        for what, body in cases.items():
            with pytest.raises(grpc.RpcError) as e:
                call(body, timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
            assert "PublishBatch" in (e.value.details() or ""), what
        # A batch whose one request is not a PublishRequest: that one alone fails.
        mixed = client_pb2.PublishBatchRequestView(requests=[one, b"\xff\xff", one])
        resp = client_pb2.PublishBatchResponse.FromString(
            call(mixed.SerializeToString(), timeout=30)
        )
    codes = [r.code for r in resp.results]
    assert codes[0] == codes[2] == 0
    assert codes[1] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    with Connection(lc.servers) as conn:
        d = Admin(conn).describe("munich")
        assert sum(p.next_offset for p in d.partitions) == 10  # the two good ones only
    assert all(alive(p.pid) for p in [*lc.nodes, *lc.queue_servers])  # nobody died of it


def test_each_acknowledged_offset_range_holds_exactly_that_publishs_pings(
    make_cluster: MakeCluster,
) -> None:
    """Plain publishes in a closed loop of corked senders (as the ingest
    benchmark), where the leader answers at commit with answers it told
    while the entry was being written: every range an acknowledgement
    names holds exactly that publish's pings of that partition, in order."""
    lc = make_cluster(3)
    with Connection(lc.servers) as conn:
        create_topic(conn, "munich", 4)
    senders, rounds = 8, 12

    async def run() -> tuple[list[tuple[PingColumns, client_pb2.PublishResponse]], int]:
        out: list[tuple[PingColumns, client_pb2.PublishResponse]] = []
        async with Publisher(lc.servers) as pub:

            async def sender(k: int) -> None:
                for r in range(rounds):
                    cols = make_pings(f"s{k}", r * 40, 40, devices=8)
                    out.append((cols, await pub.publish(request("munich", cols))))

            await asyncio.gather(*(sender(k) for k in range(senders)))
            return out, pub.fence

    answered, fence = asyncio.run(run())
    assert len(answered) == senders * rounds
    with Connection(lc.servers) as conn:
        conn.fence = fence
        stored = read_topic(conn, "munich")
    placed = 0
    for cols, resp in answered:
        mine = rows(cols)
        got = [
            row
            for o in resp.offsets
            for row in stored[o.partition][o.base_offset : o.base_offset + o.count]
        ]
        assert sorted(got) == sorted(mine), "an acknowledged range holds other pings"
        placed += len(got)
    assert placed == sum(len(v) for v in stored.values())  # every stored ping acknowledged once
