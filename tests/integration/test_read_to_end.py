"""A read to the end sees every ping acknowledged before it began, in
every data group (issue 41), on the product's default layout (3 data
groups in worker processes, TLS, tokens).

The short read it reproduces: 20,000 pings acknowledged, the node leading
a data group SIGKILLed, 20,000 more acknowledged, the node started again,
and a read to the end right after returned 23,200 of the 40,000 with no
error: the restarted replica, still catching up, served the read and its
end was taken for the partition's end."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from roadlog.client import Admin, Connection, Consumer, Producer
from roadlog.status import ask_node
from roadlog.tools.localcluster import LocalCluster
from tests.integration.conftest import create_topic, make_pings, wait_for

pytestmark = pytest.mark.integration

DEFAULT = ["--data-groups", "3", "--place-topics"]  # the product's default on three voters
BEFORE, WHILE_DOWN = 20_000, 120_000  # what the returning node missed takes it a while
READS_AFTER_RESTART = 30


def group_leaders(lc: LocalCluster) -> dict[int, int]:
    """data group -> the node leading it, at the highest term a node says."""
    claims: dict[int, tuple[int, int]] = {}
    for n in lc.nodes:
        v: dict[str, Any] | None = ask_node(n.address, 2.0, lc.tls())
        for g in (v or {}).get("groups", []):
            if g["id"] and g["role"] == "leader" and g["term"] >= claims.get(g["id"], (0, 0))[0]:
                claims[g["id"]] = (g["term"], n.id)
    return {g: nid for g, (_, nid) in claims.items()}


def publish(conn: Connection, producer: str, start: int, n: int) -> int:
    """``n`` pings of 40 devices, acknowledged; returns how many."""
    p = Producer(conn, "porto", client=producer)
    acked = 0
    for at in range(start, start + n, 1000):
        ack = p.send_batch(make_pings(producer, at, 1000, devices=40))
        acked += sum(count for _, _, count in ack.offsets)
    return acked


def read_all(lc: LocalCluster) -> int:
    """Every partition read to its end by a new reader (a fresh connection:
    nothing it wrote or was served before fences it)."""
    with Connection(lc.servers, tls=lc.tls()) as conn:
        partitions = len(Admin(conn).describe("porto").partitions)
        c = Consumer(conn, "porto")
        return sum(len(b.pings) for p in range(partitions) for b in c.read_to_end(p))


def read_all_http(lc: LocalCluster, partitions: int) -> int:
    """The same over HTTP: each partition paged to its end, each page's
    fences (X-Roadlog-Group-Fences) passed back with the next."""
    base = lc.queue_servers[0].http
    ctx = lc.tls().ssl_context()
    opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=ctx))
    total = 0
    for p in range(partitions):
        offset, fences = 0, ""
        while True:
            url = f"{base}/v1/topics/porto/partitions/{p}/pings?offset={offset}&limit=5000"
            req = urllib.request.Request(url + (f"&group_fences={fences}" if fences else ""))
            req.add_header("Authorization", f"Bearer {lc.admin_token}")
            with opener.open(req, timeout=60) as r:
                body = json.loads(r.read())
                fences = r.headers.get("X-Roadlog-Group-Fences", "")
            total += len(body["pings"])
            offset = body["next_offset"]
            if offset >= body["end_offset"]:
                break
    return total


def test_a_read_to_end_right_after_a_group_leader_returns_sees_every_acknowledged_ping(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    lc = make_cluster(nodes=3, extra=DEFAULT)
    with Connection(lc.servers, tls=lc.tls()) as conn:
        create_topic(conn, "porto", partitions=8)
        wait_for(lambda: len(group_leaders(lc)) == 3, 60, "every data group led")
        acked = publish(conn, "a", 0, BEFORE)
        # The node leading a data group that holds porto's partitions goes down.
        placed = {p.group for p in Admin(conn).describe("porto").partitions}
        victim = next(nid for g, nid in sorted(group_leaders(lc).items()) if g in placed)
        lc.kill(victim)
        acked += publish(conn, "b", BEFORE, WHILE_DOWN)
        assert acked == BEFORE + WHILE_DOWN
        lc.start(victim)
        # As soon as it takes work again, and while it catches up: every read
        # sees all of them.
        wait_for(lambda: victim in {n.id for n in Admin(conn).status().nodes}, 60, "the node back")
    seen: list[tuple[str, int]] = []
    deadline = time.monotonic() + 60
    while len(seen) < READS_AFTER_RESTART and time.monotonic() < deadline:
        seen.append(("sdk", read_all(lc)))
        seen.append(("http", read_all_http(lc, 8)))
    assert seen and all(n == acked for _, n in seen), (acked, seen)
