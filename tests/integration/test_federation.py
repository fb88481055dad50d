"""Federation (issue 43) on loopback: a directory and two member clusters,
made with the CLI as a user does (`roadlog directory up`, `roadlog cluster
up --name NAME --directory DD --tags k=v`), TLS and tokens on, as the
product runs.

Every cluster has one node: nothing here is about replication (each
cluster is a roadlog cluster, whose replication the rest of the tier
proves); three clusters of three nodes would triple the tier's cost for no
more proof. The directory's SIGKILL is of its one node and its queue
server: the whole directory gone, the harshest outage it can have.

The module shares one federation (its tests run in order; the last kills
the directory).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from roadlog.client import Admin, Connection, Consumer, Producer, RoadlogError
from roadlog.errors import Code
from roadlog.federation.home import HOME_HEADER, home_in_metadata
from roadlog.publisher import Publisher
from roadlog.tools.localcluster import LocalCluster
from roadlog.tools.localdirectory import directory_of, load_directory
from roadlog.v1 import client_pb2
from tests.integration.conftest import (
    ProducerRun,
    assert_exactly_once_in_order,
    make_pings,
    read_topic,
    wait_for,
)

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
PARIS = "2.2,48.8,2.5,48.95"
DENVER = "-105.1,39.6,-104.8,39.9"
MUNICH = "11.4,48.05,11.75,48.25"  # make_pings' pings lie here


def roadlog(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ROADLOG_CLIENT_ID": "federation-test"}
    for k in ("ROADLOG_SERVERS", "ROADLOG_TOKEN", "ROADLOG_DIRECTORY"):
        env.pop(k, None)
    return subprocess.run(
        [sys.executable, "-m", "roadlog.cli", *args],
        capture_output=True,
        stdin=subprocess.DEVNULL,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
        check=check,
    )


def read_json(*args: str) -> Any:
    done = roadlog(*args, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


class Federation:
    def __init__(self, root: Path) -> None:
        self.dd, self.eu_dir, self.us_dir = root / "dd", root / "eu", root / "us"

    @property
    def eu(self) -> LocalCluster:
        return LocalCluster.load(self.eu_dir)

    @property
    def us(self) -> LocalCluster:
        return LocalCluster.load(self.us_dir)

    def status(self) -> dict[str, Any]:
        return read_json("directory", "status", "--directory", str(self.dd), "--json")  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Federation]:
    f = Federation(tmp_path_factory.mktemp("federation"))
    try:
        roadlog("directory", "up", "--nodes", "1", "--dir", str(f.dd))
        for name, d, tags in (("eu", f.eu_dir, "region=eu"), ("us", f.us_dir, "region=us")):
            up = roadlog(
                "cluster", "up", "--nodes", "1", "--name", name, "--directory", str(f.dd),
                "--tags", tags, "--dir", str(d), check=False,
            )  # fmt: skip
            assert up.returncode == 0, up.stderr
        yield f
    finally:
        for d in (f.eu_dir, f.us_dir):
            roadlog("cluster", "down", "--dir", str(d), check=False)
        roadlog("directory", "down", "--dir", str(f.dd), check=False)


def test_members_register_and_topics_are_placed_by_name_tags_and_load(fed: Federation) -> None:
    st = fed.status()
    clusters = {c["name"]: c for c in st["clusters"]}
    assert set(clusters) == {"eu", "us"}
    assert all(c["healthy"] for c in clusters.values())
    assert clusters["eu"]["queue_servers"] == fed.eu.servers
    assert clusters["us"]["queue_servers"] == fed.us.servers
    dd = str(fed.dd)
    paris = read_json(
        "topic", "create", "paris", "--bbox", PARIS, "--directory", dd, "--on", "eu", "--json"
    )
    denver = read_json(
        "topic", "create", "denver", "--bbox", DENVER, "--directory", dd,
        "--tags", "region=us", "--json",
    )  # fmt: skip
    assert (paris["cluster"], denver["cluster"]) == ("eu", "us")
    # Least loaded: one topic each and no publishes yet; the name breaks the tie.
    munich = read_json("topic", "create", "munich", "--bbox", MUNICH, "--directory", dd, "--json")
    assert munich["cluster"] == "eu"
    munich_us = read_json(
        "topic", "create", "munich-us", "--bbox", MUNICH, "--directory", dd, "--on", "us", "--json"
    )  # fmt: skip
    assert munich_us["cluster"] == "us"
    homes = {"paris": "eu", "denver": "us", "munich": "eu", "munich-us": "us"}
    # One home a name, in the whole federation.
    again = roadlog(
        "topic", "create", "paris", "--bbox", PARIS, "--directory", dd, "--on", "us", check=False
    )
    assert again.returncode != 0 and "has its home in cluster 'eu'" in again.stderr
    assert fed.status()["topics"] == homes
    # Each was made on its home only.
    assert sorted(
        t.topic.spec.name for t in Admin(Connection(fed.eu.servers, tls=fed.eu.tls())).list_topics()
    ) == ["munich", "paris"]
    listed = read_json("topic", "list", "--directory", dd, "--json")
    assert {t["name"]: t["cluster"] for t in listed} == homes
    described = read_json("topic", "describe", "denver", "--directory", dd, "--json")
    assert described["cluster"] == "us" and described["name"] == "denver"
    # A creation its home refuses gives the name up again.
    bad = roadlog(
        "topic", "create", "nowhere", "--bbox", PARIS, "--partitions", "100000",
        "--directory", dd, "--on", "us", check=False,
    )  # fmt: skip
    assert bad.returncode != 0 and "partitions must be" in bad.stderr
    assert fed.status()["topics"] == homes


def test_produce_and_consume_through_the_directory(fed: Federation, tmp_path: Path) -> None:
    now = int(time.time() * 1000)
    rows = [f"dev{i},{now - 1000 + i},48.85,2.3{i % 10},5,90" for i in range(40)]
    (tmp_path / "p.csv").write_text(
        "device_id,ts_ms,lat,lon,speed_mps,heading_deg\n" + "\n".join(rows) + "\n"
    )
    dd = str(fed.dd)
    assert read_json(
        "produce", "paris", "--file", str(tmp_path / "p.csv"), "--directory", dd, "--json"
    ) == {"acknowledged": 40}
    out = roadlog("consume", "paris", "--directory", dd).stdout.strip().splitlines()
    assert len(out) == 41 and {r.split(",")[2] for r in out[1:]} == {f"dev{i}" for i in range(40)}
    # The SDK: the directory asked once per topic, then its home directly.
    with directory_of(dd) as d:
        conn = d.connection("munich")
        assert conn.servers == fed.eu.servers
        Producer(conn, "munich").send_batch(make_pings("sdk", 0, 50))
        stored = read_topic(conn, "munich")
        assert sum(len(r) for r in stored.values()) == 50


def test_a_member_names_the_home_of_a_topic_it_does_not_hold(fed: Federation) -> None:
    eu, us = fed.eu, fed.us
    # gRPC: FAILED_PRECONDITION with the home in the trailing metadata.
    with eu.tls().channel(eu.servers[0]) as ch, pytest.raises(grpc.RpcError) as e:
        describe: Any = ch.unary_unary("/roadlog.v1.Roadlog/DescribeTopic")
        describe(client_pb2.DescribeTopicRequest(name="denver").SerializeToString(), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    home = home_in_metadata(e.value.trailing_metadata())
    assert home is not None and (home.cluster, list(home.queue_servers)) == ("us", us.servers)
    # The SDK follows once, and drops the fences the old cluster gave.
    conn = Connection(eu.servers, tls=eu.tls())
    p = Producer(conn, "munich")
    for i in range(30):  # eu's log well past us's
        p.send_batch(make_pings("before", i * 10, 10))
    us_commit = us.status()["nodes"][0]["commit_index"]
    assert conn.fence > us_commit
    d = Admin(conn).describe("denver")
    assert d.topic.spec.name == "denver" and (conn.cluster, conn.servers) == ("us", us.servers)
    assert conn.fence <= us.status()["nodes"][0]["commit_index"]  # eu's fence dropped
    assert list(Consumer(conn, "denver").read_to_end(0)) == []  # a fenced read answers there
    # A topic no one holds: the plain NOT_FOUND, no redirect.
    with pytest.raises(RoadlogError) as missing:
        Admin(Connection(eu.servers, tls=eu.tls())).describe("atlantis")
    assert missing.value.code == Code.NOT_FOUND
    # HTTP: 307 to the home's HTTP API, the same header.
    qs = eu.queue_servers[0]
    req = urllib.request.Request(f"{qs.http}/v1/topics/denver", headers=eu.tls().headers())
    no_follow = urllib.request.build_opener(
        urllib.request.HTTPSHandler(context=eu.ssl_context()), _NoRedirect()
    )
    with pytest.raises(urllib.error.HTTPError) as redirected:
        no_follow.open(req, timeout=10)
    r = redirected.value
    assert r.code == 307 and r.headers[HOME_HEADER] == f"us={us.servers[0]}"
    assert r.headers["Location"] == f"{us.queue_servers[0].http}/v1/topics/denver"


def test_an_idempotent_producer_follows_and_publishes_with_its_homes_producer_id(
    fed: Federation,
) -> None:
    conn = Connection(fed.eu.servers, tls=fed.eu.tls())
    p = Producer(conn, "munich-us", client="follower")
    issued_by_eu = p.producer_id
    acks = [p.send_batch(make_pings("follower", i * 30, 30)) for i in range(3)]
    assert (conn.cluster, conn.servers) == ("us", fed.us.servers)
    assert p.producer_id not in (0, issued_by_eu)
    assert [a.count for a in acks] == [30, 30, 30] and not any(a.duplicate for a in acks)


def test_a_publisher_follows_a_redirect_with_every_publish_acknowledged(fed: Federation) -> None:
    import asyncio

    async def run() -> tuple[str, int]:
        async with Publisher(fed.eu.servers, tls=fed.eu.tls()) as pub:
            answers = await asyncio.gather(
                *(
                    pub.publish(
                        client_pb2.PublishRequestView(
                            topic="munich-us", batch=_encoded(make_pings(f"pub{i}", 0, 20))
                        ).SerializeToString()
                    )
                    for i in range(16)
                )
            )
            return pub.cluster, sum(o.count for a in answers for o in a.offsets)

    cluster, count = asyncio.run(run())
    assert (cluster, count) == ("us", 16 * 20)


def test_a_directory_killed_stops_no_client_that_knows_the_home(fed: Federation) -> None:
    d = directory_of(str(fed.dd))
    conn = d.connection("munich-us")  # the home asked once, while the directory runs
    before = sum(len(r) for r in read_topic(conn, "munich-us").values())
    run = ProducerRun(conn, "munich-us", "through-kill", batch=100, pause_s=0.05).start()
    try:
        wait_for(lambda: len(run.acked) >= 500, 30, "publishes before the kill")
        directory = load_directory(fed.dd)
        for n in directory.nodes:
            directory.kill(n.id)
        directory.kill_queue_server(0)
        at_kill = len(run.acked)
        wait_for(lambda: len(run.acked) >= at_kill + 1000, 30, "publishes after the directory died")
        # New lookups wait for the directory: a clear error, not a hang.
        with directory_of(str(fed.dd)) as gone:
            gone.conn.timeout = 3
            with pytest.raises(RoadlogError) as e:
                gone.lookup("paris")
            assert e.value.code == Code.UNAVAILABLE
        # The other member serves its own topics too.
        eu = Connection(fed.eu.servers, tls=fed.eu.tls())
        Producer(eu, "munich").send_batch(make_pings("eu-after", 0, 20))
    finally:
        run.join()
    assert not run.errors, run.errors[:3]
    stored = read_topic(conn, "munich-us")
    d.close()
    assert sum(len(r) for r in stored.values()) == before + len(run.acked)
    acked_here = run.acked
    assert_exactly_once_in_order(
        {p: [r for r in rows if r[0].startswith("through-kill")] for p, rows in stored.items()},
        acked_here,
    )


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def _encoded(cols: Any) -> bytes:
    from roadlog import columnar

    return columnar.encode(cols)
