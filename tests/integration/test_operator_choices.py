"""What a self-registered phone may do is the operator's choice (issue 39,
item 3), on a live cluster (3 nodes, a queue server, TLS and tokens):
cluster settings read and set with ``roadlog cluster settings`` (admin
only, values checked) decide the scopes self-registration hands out and
the cluster's ceiling on registrations (429 with Retry-After); a topic made
or updated with ``--no-open-produce`` refuses a self-registered phone's
publishes over gRPC and HTTP while an admin-made ``produce:*`` still
publishes; give-to-get counts a contribution only once an identity sent
enough pings over enough seconds (one ping unlocks nothing); and the
cluster's layout shows node addresses only to ``admin`` or ``ops``, the
CLI's ``cluster status`` working with an ops token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from roadlog.client import Admin, Connection, PermissionDenied, Producer
from roadlog.client_tls import ClientTLS
from roadlog.tools.localcluster import LocalCluster
from roadlog.v1 import heatmaps_pb2
from tests.integration.conftest import REGION, contribute, make_pings, wait_for
from tests.integration.test_client_identities import http

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, test_ca: Any, cluster_tls: Any
) -> Iterator[LocalCluster]:
    lc = LocalCluster.create(
        tmp_path_factory.mktemp("choices"),
        3,
        1,
        ca=(test_ca.ca_dir, test_ca.ca_key),
        extra_queue_args=["--registrations-per-minute", "1000"],  # the cluster's ceiling decides
    )
    lc.start_all()
    try:
        lc.wait_ready(60)
        now = int(time.time() * 1000)
        with Connection(lc.servers, tls=lc.tls()) as conn:
            admin = Admin(conn)
            admin.create_topic("plain", REGION, 2)  # the defaults: 20 pings over 60 s
            admin.create_topic("quick", REGION, 2, contribution_min_pings=3,
                               contribution_min_seconds=2)  # fmt: skip
            for topic in ("plain", "quick"):
                admin.put_heatmap(heatmaps_pb2.HeatMap(
                    topic=topic, window_start_ms=now - 300_000, window_end_ms=now,
                    h3_resolution=9))  # fmt: skip
        yield lc
    finally:
        lc.down(grace=1)


def roadlog(
    lc: LocalCluster, *args: str, token: str | None = None
) -> subprocess.CompletedProcess[str]:
    """The CLI against ``lc``: with --cluster DIR (its admin token), or with
    --servers and ``token`` (ROADLOG_TOKEN, as an operator's machine)."""
    env = {**os.environ}
    where = ["--cluster", str(lc.dir)]
    if token is not None:
        env["ROADLOG_TOKEN"] = token
        where = ["--servers", ",".join(lc.servers)]
    return subprocess.run(
        [sys.executable, "-m", "roadlog.cli", *args, *where],
        capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def register(lc: LocalCluster) -> dict[str, Any]:
    code, headers, body = http("POST", f"{lc.queue_servers[0].http}/v1/clients", {}, token=None)
    assert code == 201, (code, headers, body)
    return dict(body)


def make(lc: LocalCluster, name: str, *scopes: str) -> str:
    with Connection(lc.servers, tls=lc.tls()) as conn:
        return str(Admin(conn).create_client(name, scopes).token)


def as_(token: str, lc: LocalCluster) -> Connection:
    return Connection(lc.servers, tls=ClientTLS.from_env().with_token(token))


def publish_one(conn: Connection, topic: str, k: int) -> None:
    """One ping (its own device and time), answered."""
    Producer(conn, topic, idempotent=False).send_batch(make_pings(f"p{k}", k, 1))


def test_settings_are_listed_with_defaults_and_set_by_admins_only(cluster: LocalCluster) -> None:
    got = roadlog(cluster, "cluster", "settings", "get", "--json")
    assert got.returncode == 0, got.stderr
    listed = {s["key"]: s for s in json.loads(got.stdout)}
    assert listed["open_registration_scopes"]["default"] == "produce:*,heatmap:*"
    assert listed["registration_per_minute"]["default"] == "600"
    assert not any(s["set"] for s in listed.values())
    for bad in ("admin", "produce:*,ops", "write:*"):
        refused = roadlog(cluster, "cluster", "settings", "set", "open_registration_scopes", bad)
        assert refused.returncode != 0 and "INVALID_ARGUMENT" in refused.stderr, refused.stderr
    unknown = roadlog(cluster, "cluster", "settings", "get", "no_such_key")
    assert unknown.returncode != 0 and "open_registration_scopes" in unknown.stderr
    phone = register(cluster)
    for args in (("get",), ("set", "registration_per_minute", "5")):
        refused = roadlog(cluster, "cluster", "settings", *args, token=phone["token"])
        assert refused.returncode != 0 and "needs scope admin" in refused.stderr, refused.stderr


def test_open_registration_scopes_decide_what_a_phone_gets(cluster: LocalCluster) -> None:
    assert register(cluster)["scopes"] == ["produce:*", "heatmap:*"]  # the default, as before
    chosen = "produce:quick heatmap:quick"
    done = roadlog(cluster, "cluster", "settings", "set", "open_registration_scopes", chosen,
                   "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["value"] == "produce:quick,heatmap:quick"
    try:
        phone = register(cluster)
        assert phone["scopes"] == ["produce:quick", "heatmap:quick"]
        with as_(phone["token"], cluster) as conn, pytest.raises(PermissionDenied) as e:
            publish_one(conn, "plain", 0)
        assert "produce:plain" in e.value.message
        got = json.loads(roadlog(cluster, "cluster", "settings", "get",
                                 "open_registration_scopes", "--json").stdout)  # fmt: skip
        assert got["set"] and got["value"] == "produce:quick,heatmap:quick"
    finally:
        back = roadlog(cluster, "cluster", "settings", "set", "open_registration_scopes",
                       "produce:*,heatmap:*")  # fmt: skip
        assert back.returncode == 0, back.stderr


def test_the_clusters_ceiling_on_registrations_answers_429(cluster: LocalCluster) -> None:
    base = cluster.queue_servers[0].http
    done = roadlog(cluster, "cluster", "settings", "set", "registration_per_minute", "2")
    assert done.returncode == 0, done.stderr
    try:
        codes = []
        for _ in range(4):
            code, headers, body = http("POST", f"{base}/v1/clients", {}, token=None)
            codes.append(code)
        assert 201 in codes and codes[-1] == 429, codes
        assert int(headers["Retry-After"]) >= 1
        assert "registration_per_minute" in body["error"]["reason"], body
    finally:
        back = roadlog(cluster, "cluster", "settings", "set", "registration_per_minute", "600")
        assert back.returncode == 0, back.stderr


def test_a_topic_closed_to_open_produce_refuses_self_registered_phones(
    cluster: LocalCluster,
) -> None:
    made = roadlog(cluster, "topic", "create", "closed", "--bbox", "11.4,48.05,11.75,48.25",
                   "--partitions", "2", "--no-open-produce", "--json")  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["no_open_produce"] is True
    phone = register(cluster)
    fleet = make(cluster, "fleet", "produce:*")  # an operator's identity: not open produce
    with as_(phone["token"], cluster) as conn:
        with pytest.raises(PermissionDenied) as e:
            publish_one(conn, "closed", 0)
        assert "closed to self-registered identities" in e.value.message
        publish_one(conn, "quick", 0)  # an open topic: as before
    ping = {"device_id": "a", "ts_ms": int(time.time() * 1000), "lat": 48.13, "lon": 11.57}
    code, _, body = http("POST", f"{cluster.queue_servers[0].http}/v1/topics/closed/pings",
                         {"client_id": phone["client_id"], "pings": [ping]},
                         token=phone["token"])  # fmt: skip
    assert code == 403 and "produce:closed" in body["error"]["reason"], body
    with as_(fleet, cluster) as conn:
        publish_one(conn, "closed", 1)
    opened = roadlog(cluster, "topic", "update", "closed", "--open-produce", "--json")
    assert opened.returncode == 0 and json.loads(opened.stdout)["no_open_produce"] is False
    with as_(phone["token"], cluster) as conn:
        publish_one(conn, "closed", 2)  # group 0's leader applied the update it answered


def test_one_made_up_ping_unlocks_nothing_and_a_run_does(cluster: LocalCluster) -> None:
    phone = register(cluster)
    with as_(phone["token"], cluster) as conn:
        publish_one(conn, "plain", 0)  # the defaults: 20 pings over 60 s
        with pytest.raises(PermissionDenied) as e:
            Admin(conn).heatmap("plain")
        assert "1 ping(s)" in e.value.message and "at least 20" in e.value.message
        publish_one(conn, "quick", 0)  # 3 over 2 s: one is not enough either
        with pytest.raises(PermissionDenied):
            Admin(conn).heatmap("quick")
        start = time.monotonic()

        def allowed() -> bool:
            try:
                Admin(conn).heatmap("quick")
            except PermissionDenied:
                publish_one(conn, "quick", int(time.monotonic() * 1000))
                return False
            return True

        wait_for(allowed, 60, "a contribution of 3 pings over 2 s", every=0.3)
        assert time.monotonic() - start >= 1.5  # not before the pings spanned the time


def test_topic_update_changes_what_counts(cluster: LocalCluster) -> None:
    phone = register(cluster)
    with as_(phone["token"], cluster) as conn:
        contribute(lambda k: publish_one(conn, "plain", k), pings=3, seconds=2)
        with pytest.raises(PermissionDenied):
            Admin(conn).heatmap("plain")  # 3 pings over 2 s: not 20 over 60
        done = roadlog(cluster, "topic", "update", "plain", "--contribution-min-pings", "3",
                       "--contribution-min-seconds", "2", "--json")  # fmt: skip
        assert done.returncode == 0, done.stderr
        doc = json.loads(done.stdout)
        assert (doc["contribution_min_pings"], doc["contribution_min_seconds"]) == (3, 2)
        # The update was answered by group 0's leader, which applied it; a
        # follower may not have yet: the read is fenced on the update's index.
        conn.raise_fence(int(doc["applied_index"]))
        assert Admin(conn).heatmap("plain").contributed_ms > 0
    bad = roadlog(cluster, "topic", "update", "plain", "--contribution-min-seconds", "100000")
    assert bad.returncode != 0 and "longer than the contribution window" in bad.stderr


def test_node_addresses_are_for_admin_and_ops_only(cluster: LocalCluster) -> None:
    phone = register(cluster)
    ops = make(cluster, "monitoring", "ops")
    with as_(phone["token"], cluster) as conn:
        wait_for(lambda: len(Admin(conn).status().nodes) == 3, 20, "3 nodes linked")
        st = Admin(conn).status()
    assert st.leader and {n.role for n in st.nodes} and all(not n.address for n in st.nodes)
    assert all(n.applied_index for n in st.nodes)  # roles and indexes: still there
    with as_(ops, cluster) as conn:
        assert all(n.address for n in Admin(conn).status().nodes)
    base = cluster.queue_servers[0].http
    for path in ("/v1/cluster", "/ui/api/cluster"):
        code, _, body = http("GET", base + path, token=phone["token"])
        assert code == 200 and all(n["address"] == "" for n in body["nodes"]), (path, body)
        code, _, body = http("GET", base + path, token=ops)
        assert code == 200 and all(n["address"] for n in body["nodes"]), (path, body)
    seen = roadlog(cluster, "cluster", "status", "--json", token=ops)
    assert seen.returncode == 0, seen.stderr
    doc = json.loads(seen.stdout)
    assert doc["leader"] and all(n["address"] for n in doc["nodes"]), doc
