"""Client identities with scopes (issue 19) on a live cluster: every rpc
and HTTP route refuses a caller without a token (UNAUTHENTICATED / 401)
and one without the scope (PERMISSION_DENIED / 403, naming it);
give-to-get, producer ids and group members follow the token's identity,
not a declared client id; an identity at its consumer-group quota does not
stop another; a consumer group is seen only by readers of its own topic
and an identity's concurrent InitProducers stop at its quota (issue 39,
finding 5); a revoked token stops working; the CLI makes,
lists and revokes identities; phones register themselves over HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from node_daemon.state.consumer_groups import MAX_GROUPS_PER_CLIENT
from roadlog.client import Admin, Connection, PermissionDenied, Producer, RoadlogError
from roadlog.client_tls import ClientTLS
from roadlog.errors import Code, NotFound
from roadlog.rpc import BY_NAME, PUBLIC, RPCS, SERVICE
from roadlog.tools.localcluster import LocalCluster
from roadlog.v1 import client_pb2, heatmaps_pb2
from tests.integration.conftest import (
    REGION,
    SMALL_PINGS,
    SMALL_SECONDS,
    contribute,
    make_pings,
    settled,
)

pytestmark = pytest.mark.integration


def http(
    method: str, url: str, body: Any = None, token: str | None = ""
) -> tuple[int, dict[str, str], Any]:
    """An HTTP call with exactly this credential: ``token`` None sends no
    Authorization header at all (not even the test's default one)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    ctx = ClientTLS.from_env().ssl_context()  # not the default opener: it adds a token
    opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=ctx))
    try:
        with opener.open(req, timeout=60) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


# The nodes' producer-id quota here (1,024 by default): small, so that 64
# concurrent calls of one identity would pass it many times over without
# the check at apply.
PRODUCER_QUOTA = 8


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, test_ca: Any, cluster_tls: Any
) -> Iterator[LocalCluster]:
    lc = LocalCluster.create(
        tmp_path_factory.mktemp("identities"),
        3,
        1,
        ca=(test_ca.ca_dir, test_ca.ca_key),
        extra_node_args=["--producer-ids-per-identity", str(PRODUCER_QUOTA)],
        extra_queue_args=["--registrations-per-minute", "1000"],
    )
    lc.start_all()
    try:
        lc.wait_ready(60)
        with Connection(lc.servers, tls=lc.tls()) as conn:
            Admin(conn).create_topic("munich", REGION, 4, contribution_min_pings=SMALL_PINGS,
                                     contribution_min_seconds=SMALL_SECONDS)  # fmt: skip
            Admin(conn).create_topic("berlin", REGION, 2)
        yield lc
    finally:
        lc.down(grace=1)


def connect(lc: LocalCluster, token: str | None) -> Connection:
    return Connection(lc.servers, tls=ClientTLS.from_env().with_token(None), token=token or None)


def make(lc: LocalCluster, name: str, *scopes: str) -> str:
    with Connection(lc.servers, tls=lc.tls()) as conn:
        return str(Admin(conn).create_client(name, scopes).token)


def register(lc: LocalCluster) -> dict[str, Any]:
    code, _, body = http("POST", f"{lc.queue_servers[0].http}/v1/clients", {}, token=None)
    assert code == 201, body
    assert body["scopes"] == ["produce:*", "heatmap:*"] and body["token"].startswith("rl_")
    return dict(body)


def raw_call(lc: LocalCluster, method: str, request: bytes, token: str | None) -> grpc.RpcError:
    tls = ClientTLS.from_env().with_token(None)
    md = (("authorization", f"Bearer {token}"),) if token else ()
    with tls.channel(lc.servers[0]) as ch:
        call: Any = ch.unary_unary(f"/{SERVICE}/{method}")
        try:
            call(request, metadata=md, timeout=20)
        except grpc.RpcError as e:
            return e
    raise AssertionError(f"{method} went through")


def _request(method: str) -> bytes:
    """A request of ``method`` naming topic munich where it names a topic."""
    cls = BY_NAME[method].request
    msg = cls()
    if "topic" in cls.DESCRIPTOR.fields_by_name:
        msg.topic = "munich"  # type: ignore[attr-defined]
    if method == "PublishBatch":
        msg.requests.add(topic="munich")  # type: ignore[attr-defined]
    return msg.SerializeToString()


def test_every_rpc_refuses_no_token_and_the_wrong_scope(cluster: LocalCluster) -> None:
    # Each holds a scope, of another kind than (some) rpcs need.
    outsiders = {
        kind: make(cluster, f"outsider-{kind}", scope)
        for kind, scope in (("heatmap", "produce:*"), ("other", "heatmap:elsewhere"))
    }
    checked = 0
    for rpc in RPCS:
        if rpc.needs == PUBLIC:
            continue
        e = raw_call(cluster, rpc.name, _request(rpc.name), None)
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED, (rpc.name, e.details())
        assert "Bearer" in (e.details() or "")
        e = raw_call(cluster, rpc.name, _request(rpc.name), "rl_not-one-we-issued")
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED, (rpc.name, e.details())
        if rpc.needs == "identity":
            continue
        outsider = outsiders["heatmap" if rpc.needs == "heatmap" else "other"]
        e = raw_call(cluster, rpc.name, _request(rpc.name), outsider)
        assert e.code() == grpc.StatusCode.PERMISSION_DENIED, (rpc.name, e.details())
        want = "admin" if rpc.needs == "admin" else rpc.needs
        assert f"needs scope {want}" in (e.details() or "") or f"a {want}:TOPIC scope" in (
            e.details() or ""
        ), (rpc.name, e.details())
        checked += 1
    assert checked >= 15


def test_the_client_port_tells_strangers_nothing_of_the_cluster(cluster: LocalCluster) -> None:
    """Finding 15: the cluster's layout needs an identity (any scope), and
    the client port offers no gRPC reflection (``grpc_reflection`` off)."""
    e = raw_call(cluster, "Status", b"", None)
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e.details()
    phone = make(cluster, "status-phone", "produce:munich")
    with Connection(cluster.servers, tls=ClientTLS.from_env().with_token(phone)) as conn:
        # The status lists the nodes linked to the queue server: a node's
        # work link may come up a moment after the cluster is ready.
        deadline = time.monotonic() + 20
        st = Admin(conn).status()
        while len(st.nodes) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
            st = Admin(conn).status()
    assert st.leader != 0 and len(st.nodes) == 3
    # Roles and indexes, not where the nodes listen (issue 39): no admin, no ops.
    assert all(n.role and not n.address for n in st.nodes)
    tls = ClientTLS.from_env().with_token(phone)
    with tls.channel(cluster.servers[0]) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.ServerReflectionInfo(iter([ask]), timeout=20))
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_every_http_route_refuses_no_token_and_the_wrong_scope(cluster: LocalCluster) -> None:
    base = cluster.queue_servers[0].http
    reader = make(cluster, "berlin-reader", "read:berlin")
    routes = [
        ("POST", "/v1/topics", {"name": "x", "bbox": [1, 1, 2, 2]}, "scope admin"),
        ("GET", "/v1/topics", None, None),
        ("GET", "/v1/cluster", None, None),  # the layout: not to strangers (finding 15)
        ("GET", "/ui/api/cluster", None, None),
        ("GET", "/v1/topics/munich", None, None),
        ("POST", "/v1/producers", {"client_id": "c"}, "a produce:TOPIC scope"),
        ("POST", "/v1/topics/munich/pings", {"client_id": "c", "pings": [{}]}, "produce:munich"),
        ("GET", "/v1/topics/munich/partitions/0/pings", None, "scope read:munich"),
        ("GET", "/v1/topics/munich/heatmap", None, "scope heatmap:munich"),
        ("GET", "/ui/api/heatmap?topic=munich", None, "scope heatmap:munich"),
    ]
    for method, path, body, missing in routes:
        code, headers, got = http(method, base + path, body, token=None)
        assert code == 401 and got["error"]["code"] == "UNAUTHENTICATED", (path, got)
        assert headers.get("WWW-Authenticate", "").startswith("Bearer")
        if missing is None:  # any identity may
            code, _, got = http(method, base + path, body, token=reader)
            assert code == 200, (path, got)
            continue
        code, _, got = http(method, base + path, body, token=reader)
        assert code == 403 and missing in got["error"]["reason"], (path, got)
    # Public: the documents, health and the page's settings.
    for path in ("/openapi.json", "/healthz", "/ui/api/config"):
        assert http("GET", base + path, token=None)[0] == 200, path
    code, _, got = http("GET", base + "/ui/api/cluster", token=reader)
    assert code == 200 and {t["name"] for t in got["topics"]} >= {"munich", "berlin"}


def test_a_forged_client_id_reads_nobodys_heat_map(cluster: LocalCluster) -> None:
    base = cluster.queue_servers[0].http
    alice, mallory = register(cluster), register(cluster)
    now = int(time.time() * 1000)

    def ping(k: int) -> None:  # alice contributes (SMALL_PINGS over SMALL_SECONDS)
        code, _, body = http(
            "POST",
            f"{base}/v1/topics/munich/pings",
            {
                "client_id": "anything",
                "pings": [{"device_id": f"a{k}", "ts_ms": now, "lat": 48.13, "lon": 11.57}],
            },
            token=alice["token"],
        )
        assert code == 200, body

    contribute(ping)
    with Connection(cluster.servers, tls=cluster.tls()) as conn:
        hm = heatmaps_pb2.HeatMap(topic="munich", window_start_ms=now - 300_000,
                                  window_end_ms=now, h3_resolution=9)  # fmt: skip
        fence = Admin(conn).put_heatmap(hm)
    q = f"min_applied_index={fence}"
    code, _, body = http("GET", f"{base}/v1/topics/munich/heatmap?{q}", token=alice["token"])
    assert code == 200 and body["window_start_ms"] == now - 300_000, body
    # Mallory names alice's client id (and the id alice declared): refused,
    # the rule is checked against mallory's own identity.
    for forged in (alice["client_id"], "anything"):
        code, _, body = http(
            "GET", f"{base}/v1/topics/munich/heatmap?client_id={forged}&{q}", token=mallory["token"]
        )
        assert code == 403 and mallory["client_id"] in body["error"]["reason"], body
        with connect(cluster, mallory["token"]) as conn, pytest.raises(PermissionDenied):
            Admin(conn).heatmap("munich", client=forged)
    with connect(cluster, alice["token"]) as conn:
        got = Admin(conn).heatmap("munich", client="whatever", min_applied_index=fence)
        assert got.heatmap.window_end_ms == now


def test_producer_ids_and_group_members_belong_to_their_identity(cluster: LocalCluster) -> None:
    a = make(cluster, "van-a", "produce:munich", "read:munich")
    b = make(cluster, "van-b", "produce:munich", "read:munich")
    with connect(cluster, a) as ca, connect(cluster, b) as cb:
        pa = Producer(ca, "munich", client="same-declared-id")
        assert pa.send_batch(make_pings("a", 0, 5)).count == 5
        # B declares A's client id and names A's producer id: refused.
        pb = Producer(cb, "munich", client="same-declared-id", idempotent=False)
        pb.producer_id, pb.sequence = pa.producer_id, pa.sequence
        with pytest.raises(RoadlogError) as err:
            pb.send_batch(make_pings("b", 0, 5))
        assert err.value.code == Code.PERMISSION_DENIED and "another client" in err.value.message
        joined = ca.call("JoinGroup", client_pb2.JoinGroupRequest(group="g1", topic="munich"))
        beat = client_pb2.HeartbeatRequest(group="g1", member_id=joined.member_id,
                                           generation=joined.generation)  # fmt: skip
        assert ca.call("Heartbeat", beat).generation == joined.generation
        for method, req in (
            ("Heartbeat", beat),
            ("LeaveGroup", client_pb2.LeaveGroupRequest(group="g1", member_id=joined.member_id)),
            ("CommitOffsets", client_pb2.CommitOffsetsRequest(
                group="g1", member_id=joined.member_id, generation=joined.generation)),
        ):  # fmt: skip
            with pytest.raises(PermissionDenied, match="belongs to another client"):
                cb.call(method, req)
        d = Admin(ca).describe_group("g1")
        assert [m.member_id for m in d.group.members] == [joined.member_id]


def test_an_identity_at_its_group_quota_is_refused_and_another_is_served(
    cluster: LocalCluster,
) -> None:
    """Consumer-group quotas per identity (issue 19, finding 10) through the
    queue server: past its quota an identity's join that would create a
    group is RESOURCE_EXHAUSTED, at once and saying what frees it; another
    identity still creates groups and joins; a group deleted frees a place."""
    a = make(cluster, "grouper-a", "read:munich")
    b = make(cluster, "grouper-b", "read:munich")
    with connect(cluster, a) as ca, connect(cluster, b) as cb:

        def join(conn: Connection, group: str) -> client_pb2.JoinGroupResponse:
            # A long session: no member expires while the test runs.
            req = client_pb2.JoinGroupRequest(
                group=group, topic="munich", session_timeout_ms=120_000
            )
            resp: client_pb2.JoinGroupResponse = conn.call("JoinGroup", req)
            return resp

        first = join(ca, "quota-a-0")
        for i in range(1, MAX_GROUPS_PER_CLIENT):
            join(ca, f"quota-a-{i}")
        with pytest.raises(RoadlogError) as err:
            join(ca, "quota-a-more")
        assert err.value.code == Code.RESOURCE_EXHAUSTED, err.value
        assert f"created {MAX_GROUPS_PER_CLIENT} consumer groups" in err.value.message
        assert "leave" in err.value.message and "admin" in err.value.message
        # Another identity is served: it creates a group, and joins one of A's.
        assert join(cb, "quota-b-0").partitions
        join(cb, "quota-a-1")
        d = Admin(ca).describe_group("quota-a-0").group
        assert d.owner == d.members[0].client_id  # charged to the identity that created it
        # A leaves a group, an admin deletes it: A may create one again.
        ca.call("LeaveGroup", client_pb2.LeaveGroupRequest(
            group="quota-a-0", member_id=first.member_id))  # fmt: skip
        with Connection(cluster.servers, tls=cluster.tls()) as admin:
            Admin(admin).delete_group("quota-a-0")
        assert join(ca, "quota-a-more").member_id


def test_a_consumer_group_is_seen_only_by_readers_of_its_topic(cluster: LocalCluster) -> None:
    """Issue 39, finding 5: an identity with read:berlin lists only berlin's
    groups, and a munich group is to it what a group that does not exist
    is (NOT_FOUND, the same words), describing it and naming its member
    alike; a join that collides with its name does not tell its topic. A
    munich reader and an admin see it whole."""
    mo = make(cluster, "munich-fleet", "read:munich")
    eve = make(cluster, "berlin-fleet", "read:berlin")
    with connect(cluster, mo) as cm, connect(cluster, eve) as ce:
        hidden = cm.call("JoinGroup", client_pb2.JoinGroupRequest(
            group="depot-7", topic="munich", session_timeout_ms=120_000))  # fmt: skip
        # Joined after depot-7: a replica that shows it has applied depot-7 too.
        mine = ce.call("JoinGroup", client_pb2.JoinGroupRequest(
            group="depot-8", topic="berlin", session_timeout_ms=120_000))  # fmt: skip
        fence = mine.applied_index

        def names(conn: Connection) -> set[str]:
            return {d.group.name for d in Admin(conn).list_groups()}

        seen = settled(lambda: names(ce), lambda n: "depot-8" in n, "eve's group listed")
        assert "depot-7" not in seen and all(
            Admin(ce).describe_group(n, fence).group.topic == "berlin" for n in seen
        )
        with pytest.raises(NotFound) as hid:
            Admin(ce).describe_group("depot-7", min_applied_index=fence)
        with pytest.raises(NotFound) as absent:
            Admin(ce).describe_group("depot-0", min_applied_index=fence)
        assert hid.value.message.replace("depot-7", "G") == absent.value.message.replace(
            "depot-0", "G"
        )
        member, gen = hidden.member_id, hidden.generation
        for method, req in (
            ("Heartbeat", client_pb2.HeartbeatRequest(
                group="depot-7", member_id=member, generation=gen)),
            ("CommitOffsets", client_pb2.CommitOffsetsRequest(
                group="depot-7", member_id=member, generation=gen)),
            ("LeaveGroup", client_pb2.LeaveGroupRequest(group="depot-7", member_id=member)),
        ):  # fmt: skip
            with pytest.raises(NotFound, match="no group 'depot-7'"):
                ce.call(method, req)
        with pytest.raises(RoadlogError) as taken:
            ce.call("JoinGroup", client_pb2.JoinGroupRequest(group="depot-7", topic="berlin"))
        assert taken.value.code == Code.FAILED_PRECONDITION and "munich" not in taken.value.message
        # Its own reader still sees it whole, member and all; so does an admin.
        d = Admin(cm).describe_group("depot-7", min_applied_index=fence).group
        assert [m.member_id for m in d.members] == [member] and d.generation == gen
        assert "depot-7" in names(cm) and "depot-8" not in names(cm)
        with Connection(cluster.servers, tls=cluster.tls()) as admin:
            assert {"depot-7", "depot-8"} <= settled(
                lambda: names(admin), lambda n: {"depot-7", "depot-8"} <= n, "both listed"
            )


def test_concurrent_init_producers_of_one_identity_stop_at_its_quota(
    cluster: LocalCluster,
) -> None:
    """Issue 39, finding 5: 64 InitProducer calls of one identity at once
    (they all pass the leader's check before proposing, which sees none of
    the others) get at most its quota of ids; the rest are refused
    RESOURCE_EXHAUSTED, at once, saying why. Another identity is served."""
    token = make(cluster, "burst-fleet", "produce:munich")
    calls = 64
    with connect(cluster, token) as conn:

        def init(_: int) -> int | RoadlogError:
            try:
                return int(conn.call("InitProducer", client_pb2.InitProducerRequest()).producer_id)
            except RoadlogError as e:
                return e

        with ThreadPoolExecutor(calls) as pool:
            results = list(pool.map(init, range(calls)))
    ids = [r for r in results if isinstance(r, int)]
    refused = [r for r in results if isinstance(r, RoadlogError)]
    assert len(ids) <= PRODUCER_QUOTA, f"{len(ids)} producer ids against {PRODUCER_QUOTA}"
    assert len(set(ids)) == len(ids) == PRODUCER_QUOTA, [str(r) for r in refused][:3]
    assert all(
        r.code == Code.RESOURCE_EXHAUSTED and "producer id quota" in r.message for r in refused
    ), [str(r) for r in refused][:3]
    with connect(cluster, make(cluster, "calm-fleet", "produce:munich")) as other:
        assert other.call("InitProducer", client_pb2.InitProducerRequest()).producer_id


def test_a_revoked_token_stops_working(cluster: LocalCluster) -> None:
    token = make(cluster, "short-lived", "read:*")
    with connect(cluster, token) as conn:
        assert Admin(conn).list_topics()
    with Connection(cluster.servers, tls=cluster.tls()) as conn:
        Admin(conn).revoke_client("short-lived")
    with connect(cluster, token) as conn, pytest.raises(RoadlogError) as err:
        Admin(conn).list_topics()
    assert err.value.code == Code.UNAUTHENTICATED and "revoked" in err.value.message


def test_the_cli_makes_lists_and_revokes_identities(cluster: LocalCluster) -> None:
    def roadlog(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "roadlog.cli", *args],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )

    d = str(cluster.dir)
    made = roadlog(
        "client", "create", "spark-reader", "--scope", "read:*", "--json", "--cluster", d
    )
    assert made.returncode == 0, made.stderr
    doc = json.loads(made.stdout)
    assert set(doc) == {"client_id", "token"} and doc["token"].startswith("rl_")
    bad = roadlog("client", "create", "x", "--scope", "write:munich", "--cluster", d)
    assert bad.returncode != 0 and "bad scope" in bad.stderr
    listed = roadlog("client", "list", "--json", "--cluster", d)
    names = {c["name"]: c for c in json.loads(listed.stdout)["clients"]}
    assert names["spark-reader"]["scopes"] == ["read:*"] and "admin" in names
    assert "token" not in json.dumps(names)  # never shown again
    # The token works for the CLI (--token) as the identity it names.
    env = {**os.environ, "ROADLOG_TOKEN": doc["token"]}
    servers = ",".join(cluster.servers)
    ok = roadlog("topic", "list", "--servers", servers, env=env)
    assert ok.returncode == 0 and "munich" in ok.stdout, ok.stderr
    denied = roadlog("topic", "delete", "munich", "--yes", "--servers", servers, env=env)
    assert denied.returncode != 0 and "needs scope admin" in denied.stderr
    gone = roadlog("client", "revoke", "spark-reader", "--yes", "--cluster", d)
    assert gone.returncode == 0, gone.stderr
    refused = roadlog("topic", "list", "--servers", servers, env=env)
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr


def test_phones_register_over_http_and_publish(cluster: LocalCluster) -> None:
    phone = register(cluster)
    base = cluster.queue_servers[0].http
    now = int(time.time() * 1000)
    ping = {"device_id": "p", "ts_ms": now, "lat": 48.13, "lon": 11.57}  # berlin: REGION too
    code, _, body = http(
        "POST",
        f"{base}/v1/topics/berlin/pings",
        {"client_id": "p", "pings": [ping]},
        token=phone["token"],
    )
    assert code == 200 and body["count"] == 1, body
    code, _, body = http("GET", f"{base}/v1/topics/berlin/partitions/0/pings", token=phone["token"])
    assert code == 403 and "read:berlin" in body["error"]["reason"]
    code, _, body = http("POST", f"{base}/v1/clients", {"scopes": ["admin"]}, token=None)
    assert code == 400  # a phone chooses nothing
