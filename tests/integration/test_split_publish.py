"""Publishes routed to data groups (issue 18, multi-raft step 3;
docs/multiraft.md): a 3-node cluster with ``data_groups = 3`` and
``place_topics`` places each topic's partitions in the data groups. The
SDK sends each group's pings to that group's leader (the fast path: a
group refuses pings of another's partitions); a publish that names no
group (HTTP, other clients) is validated and split by group 0's leader,
the queue server hands each part to its group's leader and answers once
every part is stored. Reads follow: a fetch reads the partition's group on the node that
takes it, fenced per group; a topic's offsets come from the data groups.
Real processes on loopback, a leader SIGKILLed under idempotent writes."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Callable

import pytest

from bench.cpu import spawned_children as children  # a node's worker processes
from roadlog.client import (
    Admin,
    Connection,
    FailedPrecondition,
    GroupConsumer,
    InvalidArgument,
    PermissionDenied,
    Producer,
)
from roadlog.columnar import encode
from roadlog.errors import RoadlogError
from roadlog.tools.localcluster import LocalCluster
from roadlog.v1 import client_pb2
from tests.integration.conftest import (
    assert_exactly_once_in_order,
    contribute,
    create_topic,
    make_pings,
    read_topic,
    wait_for,
)
from tests.integration.test_front_door import heatmap, http
from tests.integration.test_raft_groups import every_group_led_and_agreed, leaders, views

pytestmark = pytest.mark.integration

PLACED = ["--data-groups", "3", "--place-topics"]


def rows(cols: object) -> list[tuple[str, int]]:
    return list(zip(cols.device_of().tolist(), cols.ts_ms.tolist(), strict=True))  # type: ignore[attr-defined]


def split_calls(lc: LocalCluster) -> float:
    """Calls the queue server had group 0's leader split (not routed by group)."""
    url = lc.metrics_url(lc.queue_servers[0])
    with urllib.request.urlopen(url, context=lc.ssl_context(), timeout=5) as r:
        text = r.read().decode()
    m = re.search(r'^roadlog_queue_split_publishes_total\{what="calls"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def placed_cluster(make_cluster: Callable[..., LocalCluster], workers: int = 1) -> LocalCluster:
    """3 nodes, 3 data groups, topics placed in them; every group led. With
    ``workers`` 2, the data groups run in two worker processes a node, and
    group 0 reads them across processes."""
    lc = make_cluster(nodes=3, extra=[*PLACED, "--workers", str(workers)])
    ids = [n.id for n in lc.nodes]
    wait_for(lambda: every_group_led_and_agreed(lc, ids), 60, "every group led, everywhere")
    return lc


def test_publishes_go_to_the_data_groups_and_are_read_back(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    lc = placed_cluster(make_cluster)
    with Connection(lc.servers) as conn:
        create_topic(conn, "munich", partitions=6)
        d = Admin(conn).describe("munich")
        assert sorted({p.group for p in d.partitions}) == [1, 2, 3]  # every data group
        producer = Producer(conn, "munich")
        splits = split_calls(lc)
        acked: list[tuple[str, int]] = []
        batch = make_pings("van", 0, 300, devices=24)  # devices in every partition
        ack = producer.send_batch(batch)
        acked += rows(batch)
        assert ack.count == 300 and not ack.duplicate and ack.applied_index == 0
        assert sorted(p for p, _, _ in ack.offsets) == list(range(6))
        assert sorted(conn.group_fences) == [1, 2, 3]  # a fence per group written
        # The same batch again (its answer was lost): every part a duplicate.
        producer.sequence -= 1
        again = producer.send_batch(batch)
        assert again.duplicate and sorted(again.offsets) == sorted(ack.offsets)
        # Unary publishes without a producer id, and over HTTP.
        plain = Producer(conn, "munich", idempotent=False)
        more = make_pings("car", 0, 120, devices=12)
        assert plain.send_batch(more).count == 120
        acked += rows(more)
        # The SDK sent each group's pings to that group: nothing was split.
        assert split_calls(lc) == splits
        # A publish that says group 1 but holds pings of other groups' partitions.
        wrong = client_pb2.PublishRequestView(topic="munich", batch=encode(make_pings("x", 0, 50)))
        with pytest.raises(FailedPrecondition, match="map changed"):
            conn.call("Publish", wrong, routing_group=1)
        now = int(time.time() * 1000)
        phones = [(f"phone-{i}", now - i) for i in range(30)]
        pings = [{"device_id": d, "ts_ms": ts, "lat": 48.1, "lon": 11.5} for d, ts in phones]
        code, _, body = http(
            "POST",
            f"{lc.queue_servers[0].http}/v1/topics/munich/pings",
            {"client_id": "c", "pings": pings},
        )
        assert code == 200 and body["count"] == 30, body
        assert sorted(body["group_fences"]) == ["1", "2", "3"], body
        for g, index in body["group_fences"].items():  # read what HTTP wrote, too
            conn.raise_group_fence(int(g), index)
        acked += phones
        assert split_calls(lc) == splits + 1  # phones in every group: group 0's leader split it
        # One phone's publish lies in one group: the queue server routes it there.
        one = [
            {"device_id": "phone-x", "ts_ms": now + i, "lat": 48.1, "lon": 11.5} for i in range(5)
        ]
        code, _, body = http(
            "POST",
            f"{lc.queue_servers[0].http}/v1/topics/munich/pings",
            {"client_id": "c", "pings": one},
        )
        assert code == 200 and body["count"] == 5 and len(body["group_fences"]) == 1, body
        for g, index in body["group_fences"].items():
            conn.raise_group_fence(int(g), index)
        # Read it back over HTTP, fenced in its group (any node that answers has it).
        (placed,) = body["offsets"]
        fences = ",".join(f"{g}:{i}" for g, i in body["group_fences"].items())
        url = f"{lc.queue_servers[0].http}/v1/topics/munich/partitions/{placed['partition']}"
        code, _, got = http(
            "GET", f"{url}/pings?offset={placed['base_offset']}&group_fences={fences}"
        )
        assert code == 200, got
        assert [p["device_id"] for p in got["pings"]][:5] == ["phone-x"] * 5
        code, _, got = http("GET", f"{url}/pings?group_fences=one:2")
        assert code == 400 and "group_fences" in got["error"]["reason"], got
        acked += [("phone-x", now + i) for i in range(5)]
        assert split_calls(lc) == splits + 1
        # Read back through the data groups, fenced per group.
        stored = read_topic(conn, "munich")
        assert_exactly_once_in_order(stored, acked)
        assert sum(len(v) for v in stored.values()) == 455
        d = Admin(conn).describe("munich")
        assert sum(p.next_offset for p in d.partitions) == 455
        # A bad ping refuses its publish whole, in every group.
        bad = make_pings("bad", 0, 40, devices=8)
        bad.lat[5] = 95.0
        with pytest.raises(RoadlogError, match="lat"):
            plain.send_batch(bad)
        assert sum(p.next_offset for p in Admin(conn).describe("munich").partitions) == 455


def test_idempotent_writes_through_a_data_group_leaders_crash_are_stored_once(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    lc = placed_cluster(make_cluster)
    ids = [n.id for n in lc.nodes]
    with Connection(lc.servers, timeout=60) as conn:
        create_topic(conn, "munich", partitions=6)
        producer = Producer(conn, "munich", deadline_s=60)
        acked: list[tuple[str, int]] = []
        victim = 0
        for i in range(12):  # bounded: 12 batches, one crash among them
            if i == 4:
                victim = leaders(views(lc))[2]  # the leader of data group 2
                lc.kill(victim)
            batch = make_pings("van", i * 100, 100, devices=24)
            assert producer.send_batch(batch).count == 100
            acked += rows(batch)
        lc.start(victim)
        wait_for(lambda: every_group_led_and_agreed(lc, ids), 60, "the node back in every group")
        stored = read_topic(conn, "munich")
        assert_exactly_once_in_order(stored, acked)
        assert sum(len(v) for v in stored.values()) == 1200


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "2-workers"])
def test_give_to_get_counts_what_the_data_groups_stored(
    make_cluster: Callable[..., LocalCluster], workers: int
) -> None:
    """Contributions are recorded where the pings are stored, in the data
    groups; a heat map (group 0's) is given to whoever they list."""
    lc = placed_cluster(make_cluster, workers)
    base = lc.queue_servers[0].http
    tokens = {}
    for name in ("alice", "bob"):
        code, _, body = http("POST", f"{base}/v1/clients", {})
        assert code == 201, body
        tokens[name] = body["token"]
    with (
        Connection(lc.servers) as admin,
        Connection(lc.servers, token=tokens["alice"]) as alice,
        Connection(lc.servers, token=tokens["bob"]) as bob,
    ):
        create_topic(admin, "munich", partitions=6)
        now = int(time.time() * 1000)
        fence = Admin(admin).put_heatmap(heatmap(now - 300_000))
        for who in (alice, bob):
            who.raise_fence(fence)
        sender = Producer(alice, "munich")
        # A contribution (issue 39): SMALL_PINGS over SMALL_SECONDS, in every group alice writes.
        contribute(lambda k: sender.send_batch(make_pings("a", 60 * k, 60, devices=12)))
        got = Admin(alice).heatmap("munich")  # fenced in every group alice wrote
        assert got.heatmap.window_start_ms == now - 300_000 and got.contributed_ms > 0
        with pytest.raises(PermissionDenied, match="has not published"):
            Admin(bob).heatmap("munich")


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "2-workers"])
def test_a_consumer_group_reads_and_commits_what_the_data_groups_hold(
    make_cluster: Callable[..., LocalCluster], workers: int
) -> None:
    """Consumer groups live in group 0, the pings in the data groups: a
    member reads every ping once, its commits are checked against the data
    groups' ends (by group 0's leader), and one past the end is refused."""
    lc = placed_cluster(make_cluster, workers)
    with Connection(lc.servers) as conn:
        create_topic(conn, "munich", partitions=6)
        batch = make_pings("van", 0, 240, devices=24)
        assert Producer(conn, "munich").send_batch(batch).count == 240
        member = GroupConsumer(conn, "munich", "readers", client="r1", session_timeout_ms=5000)
        member.join()
        seen: list[tuple[str, int]] = []
        deadline = time.monotonic() + 30
        while len(seen) < 240 and time.monotonic() < deadline:
            for f in member.poll(max_pings=100):
                seen += rows(f.pings)
        assert sorted(seen) == sorted(rows(batch))  # every ping once
        assert member.commit()
        offsets = {o.partition: o.offset for o in Admin(conn).describe_group("readers").offsets}
        d = Admin(conn).describe("munich")
        assert offsets == {p.partition: p.next_offset for p in d.partitions if p.next_offset}
        too_far = client_pb2.CommitOffsetsRequest(
            group="readers", member_id=member.member_id, generation=member.generation
        )
        too_far.offsets.add(partition=member.assigned[0], offset=10_000)
        with pytest.raises(InvalidArgument, match="past the end"):
            conn.call("CommitOffsets", too_far)
        member.close()


def test_corked_parts_through_a_worker_crash_lose_and_duplicate_nothing(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    """Four idempotent producers that do not route by group (every batch
    split by group 0's leader), at once, so a data group's leader takes
    parts of several publishes in one turn and corks them; the worker
    process of group 1's leader is SIGKILLed meanwhile. Every acknowledged
    ping is read back once, in order."""
    lc = placed_cluster(make_cluster, workers=2)
    ids = [n.id for n in lc.nodes]
    with Connection(lc.servers, timeout=60) as conn:
        create_topic(conn, "munich", partitions=6)
    acked: dict[int, list[tuple[str, int]]] = {k: [] for k in range(4)}
    errors: list[BaseException] = []
    started = threading.Barrier(5, timeout=60)

    def produce(k: int) -> None:
        try:
            with Connection(lc.servers, timeout=60) as c:
                producer = Producer(c, "munich", deadline_s=60)
                producer._groups = []  # as a client that does not route by group
                started.wait()
                for i in range(10):  # bounded: 10 batches a producer
                    batch = make_pings(f"p{k}-", i * 100, 100, devices=24)
                    assert producer.send_batch(batch).count == 100
                    acked[k] += rows(batch)
        except BaseException as e:  # reported by the test's thread
            errors.append(e)

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    splits = split_calls(lc)
    started.wait()
    wait_for(lambda: split_calls(lc) >= splits + 8, 60, "split publishes under way")
    leader = next(n for n in lc.nodes if n.id == leaders(views(lc))[1])
    victim = children(leader.pid)[0]  # group g runs in worker (g - 1) mod 2
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    wait_for(lambda: every_group_led_and_agreed(lc, ids), 90, "every group led again")
    with Connection(lc.servers, timeout=60) as conn:
        stored = read_topic(conn, "munich")
    every = [r for k in range(4) for r in acked[k]]
    assert_exactly_once_in_order(stored, every)
    assert sum(len(v) for v in stored.values()) == len(every) == 4000
