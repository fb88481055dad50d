"""The publish link on a real cluster (TLS, client identities): a
Publisher's calls go over it once it is up, every ping is stored exactly
once, through the SIGKILL of the queue server it goes to too; each batch on
it is admitted as a gRPC call would be (a token without the topic's produce
scope is refused, a revoked one stops working on the open link); only
clients that trust the cluster's CA get its greeting; and a queue server
run with ``publish_link_port = -1`` offers none, the publishes going over
gRPC."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from roadlog import columnar
from roadlog.client import Admin, Connection
from roadlog.client_tls import ClientTLS
from roadlog.errors import RoadlogError
from roadlog.publish_link import MAGIC
from roadlog.publisher import Publisher
from roadlog.runtime import eventloop
from roadlog.tools.localcluster import LocalCluster
from roadlog.v1 import client_pb2, pings_pb2
from tests.certs import ClusterCA
from tests.integration.conftest import (
    assert_exactly_once_in_order,
    create_topic,
    framed_greeting,
    make_pings,
    read_topic,
)

pytestmark = pytest.mark.integration


def _request(
    producer: str,
    start: int,
    n: int,
    topic: str = "munich",
    sent: list[tuple[str, int]] | None = None,
) -> bytes:
    """A publish of ``n`` pings named by (device, ts); ``sent`` gets them."""
    pings = make_pings(producer, start, n)
    if sent is not None:
        sent += zip(pings.device_of().tolist(), pings.ts_ms.tolist(), strict=True)
    batch = pings_pb2.PingBatch.FromString(columnar.encode(pings))
    return client_pb2.PublishRequest(topic=topic, batch=batch).SerializeToString()


def _link_port(lc: LocalCluster) -> int:
    q = lc.queue_servers[0]
    flags = [i for i, a in enumerate(q.argv) if a == "--publish-link-port"]
    return int(q.argv[flags[-1] + 1])


async def _publish_all(
    tls: ClientTLS, servers: list[str], requests: list[bytes]
) -> tuple[int, int]:
    """Publish in rounds of 8 at once: the calls answered over the link, and
    the fence that reads back what was published."""
    async with Publisher(servers, tls=tls) as pub:
        for i in range(0, len(requests), 8):
            await asyncio.gather(*(pub.publish(r) for r in requests[i : i + 8]))
        assert pub.stats.failed == 0
        return pub.linked, pub.fence


def _stored(lc: LocalCluster, fence: int) -> list[tuple[str, int]]:
    with Connection(lc.servers, tls=lc.tls()) as conn:
        conn.fence = fence  # read what the publisher wrote
        return sorted(row for rows in read_topic(conn, "munich").values() for row in rows)


def test_publishes_go_over_the_link_in_tls_and_each_ping_is_stored_once(
    make_cluster: Callable[..., LocalCluster], foreign_ca: ClusterCA
) -> None:
    lc = make_cluster(3, 1)
    ours = lc.tls()
    port = _link_port(lc)
    assert framed_greeting(port, ours.ssl_context()) == MAGIC
    assert framed_greeting(port, None) == b""  # plaintext: no
    d = foreign_ca.client()
    assert framed_greeting(port, ClientTLS(d / "ca.crt").ssl_context()) == b""  # not our server
    with Connection(lc.servers, tls=ours) as conn:
        create_topic(conn)
    sent: list[tuple[str, int]] = []
    requests = [_request("p", 50 * i, 50, sent=sent) for i in range(40)]
    linked, fence = eventloop.run(_publish_all(ours, lc.servers, requests))
    assert linked >= 3, linked  # after the first calls on the stream, over the link
    assert _stored(lc, fence) == sorted(sent)


def test_each_batch_on_the_link_is_admitted_by_its_token(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    lc = make_cluster(3, 1)
    admin = lc.tls()
    with Connection(lc.servers, tls=admin) as conn:
        create_topic(conn, "munich")
        create_topic(conn, "berlin")
        token = str(Admin(conn).create_client("van-1", ["produce:munich"]).token)
    van = ClientTLS(admin.ca_file, token=token)

    async def run() -> None:
        async with Publisher(lc.servers, tls=van, timeout=10) as pub:
            for i in range(6):  # the link comes up after the first calls
                await pub.publish(_request("van", 10 * i, 10, "munich"))
            assert pub.linked >= 2, pub.linked
            with pytest.raises(RoadlogError) as refused:
                await pub.publish(_request("van", 0, 10, "berlin"))
            assert refused.value.code.name == "PERMISSION_DENIED"
            linked = pub.linked
            with Connection(lc.servers, tls=admin) as conn:
                Admin(conn).revoke_client("van-1")
            # Revoked: refused on the link already open, within the cache's TTL.
            for attempt in range(60):
                try:
                    await pub.publish(_request("van", 1000 + attempt, 1, "munich"))
                except RoadlogError as e:
                    assert e.code.name == "UNAUTHENTICATED"
                    break
                await asyncio.sleep(0.5)
            else:
                raise AssertionError("a revoked token still publishes")
            assert pub.linked > linked  # those answers came over the link

    eventloop.run(run())


def test_a_queue_server_without_the_link_takes_publishes_over_grpc(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    lc = make_cluster(3, 1, queue_extra=["--publish-link-port", "-1"])
    assert _link_port(lc) == -1
    with Connection(lc.servers, tls=lc.tls()) as conn:
        create_topic(conn)
    sent: list[tuple[str, int]] = []
    requests = [_request("g", 20 * i, 20, sent=sent) for i in range(16)]
    linked, fence = eventloop.run(_publish_all(lc.tls(), lc.servers, requests))
    assert linked == 0
    assert _stored(lc, fence) == sorted(sent)


def test_idempotent_publishes_through_a_queue_server_kill_on_its_link_are_stored_once(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    """The queue server a publisher's link goes to is SIGKILLed under load:
    the batches out on the link are sent again to the other queue server,
    and each idempotent batch is stored exactly once."""
    lc = make_cluster(3, 2)
    with Connection(lc.servers, tls=lc.tls()) as conn:
        create_topic(conn)
        producers = [
            int(
                conn.call(
                    "InitProducer", client_pb2.InitProducerRequest(client_id=f"van{i}")
                ).producer_id
            )
            for i in range(4)
        ]
    acked: list[tuple[str, int]] = []
    errors: list[str] = []
    linked_at_kill: list[int] = []
    halfway = asyncio.Event()

    async def van(pub: Publisher, k: int, pid: int) -> None:
        for seq in range(1, 41):  # one batch out per producer: sequences stay in order
            pings = make_pings(f"van{k}", (seq - 1) * 20, 20)
            req = client_pb2.PublishRequest(
                topic="munich",
                producer_id=pid,
                sequence=seq,
                batch=pings_pb2.PingBatch.FromString(columnar.encode(pings)),
            )
            try:
                await pub.publish(req, timeout=60)
            except RoadlogError as e:
                errors.append(str(e))
                return
            acked.extend(zip(pings.device_of().tolist(), pings.ts_ms.tolist(), strict=True))
            if k == 0 and seq == 15:
                halfway.set()

    async def run() -> int:
        async with Publisher(lc.servers, tls=lc.tls()) as pub:
            pub._current = 0  # it starts at the queue server that dies

            async def killer() -> None:
                await halfway.wait()
                linked_at_kill.append(pub.linked)
                await asyncio.get_running_loop().run_in_executor(None, lc.kill_queue_server, 0)

            await asyncio.gather(killer(), *(van(pub, k, p) for k, p in enumerate(producers)))
            return pub.fence

    fence = eventloop.run(run())
    assert not errors, errors[:3]
    assert linked_at_kill[0] > 0  # the link was in use when its server died
    assert len(acked) == 4 * 40 * 20
    with Connection([lc.servers[1]], tls=lc.tls()) as conn:
        conn.fence = fence
        stored = read_topic(conn, "munich")
    assert_exactly_once_in_order(stored, acked)
